"""One checker of bool options (``ops.options.check_bool``), used by every op,
loss, settings object and packing function of the public API. It accepts a Python bool and
numpy's ``bool_`` and refuses everything else (0 and 1 included, as the checks before it did),
naming the option, with a huge int cut short in the message. Before, ``StatsOptions(validate=)``,
``vocab_parallel_entropy(differentiable=)``, ``logprobs_step(entropy=, non_loss_data=)``,
``score_tokens(non_loss_data=)``, ``token_loss(non_loss_data=)``, ``pack_sequences(seq_params=,
validate=)``, the other packing functions' ``validate``, ``make_packed_seq_params(
pad_between_seqs=)`` and ``distillation_loss(validate=)`` took any truthy value; the checked
ones refused numpy's ``bool_`` and printed all 401 digits of ``10**400``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megatron_vocabstats as mv
from megatron_vocabstats.megatron import settings
from megatron_vocabstats.ops.options import bool_error, check_bool
from megatron_vocabstats.packing import (
    context_parallel_indices,
    gather_from_context_parallel,
    make_packed_seq_params,
    pack_sequences,
    sequence_alignment,
    shard_for_context_parallel,
    shift_packed_labels,
    unpack_sequences,
)

HUGE = 10**400
BAD = [1, 0, np.int64(1), 1.0, "yes", "False", None, torch.tensor(True), np.array([True]), HUGE]
BAD_IDS = ["1", "0", "np.int64(1)", "1.0", "yes", "False-str", "None", "tensor", "array", "huge"]


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.False_])
def test_bools_are_taken_as_python_bools(value):
    got = check_bool("flag", value)
    assert type(got) is bool and got == bool(value)
    assert bool_error("flag", value) is None


@pytest.mark.parametrize("value", BAD, ids=BAD_IDS)
def test_anything_else_is_refused_naming_the_option(value):
    with pytest.raises(TypeError, match=r"^flag must be a bool, got ") as info:
        check_bool("flag", value)
    assert isinstance(info.value, ValueError)  # InputTypeError: caught as either
    assert isinstance(bool_error("flag", value), TypeError)


def test_a_huge_int_is_cut_short_in_the_message():
    with pytest.raises(ValueError) as info:
        check_bool("validate", HUGE)
    assert len(str(info.value)) < 100 and "(401 characters)" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Every consumer: (call with the option set to v, the name the error must carry, a good value)

LOGITS, TARGET = torch.randn(3, 8), torch.tensor([1, 2, -100])
HIDDEN, WEIGHT = torch.randn(3, 4), torch.randn(8, 4)
MASK = torch.ones(3)
TEACHER = mv.TopK(torch.log_softmax(torch.randn(3, 2), -1), torch.tensor([[0, 1]] * 3))
LP = torch.full((3,), -1.0)
CU = torch.tensor([0, 2, 4], dtype=torch.int32)
T, F = np.True_, np.False_


def _distill(**kw):
    return mv.distillation_loss(LOGITS, TEACHER, MASK, **kw)


def _linear(**kw):
    return mv.linear_vocab_parallel_stats(HIDDEN, WEIGHT, TARGET, **kw)


CONSUMERS = {
    "stats.validate": (lambda v: mv.vocab_parallel_stats(LOGITS, TARGET, validate=v), "validate",
                       T),
    "entropy.differentiable": (lambda v: mv.vocab_parallel_entropy(LOGITS, differentiable=v),
                               "differentiable", F),
    "topk.validate": (lambda v: mv.vocab_parallel_topk(LOGITS, 2, validate=v), "validate", T),
    "topk_logprobs.validate": (lambda v: mv.vocab_parallel_topk_logprobs(
        LOGITS, TEACHER.indices, validate=v), "validate", T),
    "sampling.validate": (lambda v: mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET,
                                                                       validate=v), "validate", T),
    "stats.batch_invariant": (lambda v: mv.vocab_parallel_stats(LOGITS, TARGET,
                                                                batch_invariant=v),
                              "batch_invariant", T),
    **{f"linear.{name}": ((lambda v, name=name: _linear(**{name: v})), name, good)
       for name, good in (("sequence_parallel", F), ("accumulate_into_main_grad", F),
                          ("partial_hidden_grad", T), ("argmax", T))},
    "StatsOptions.validate": (lambda v: mv.StatsOptions(validate=v), "validate", T),
    "sft_loss.validate": (lambda v: mv.sft_loss(LOGITS, TARGET, MASK, validate=v), "validate",
                          T),
    "logprobs_step.entropy": (lambda v: mv.logprobs_step(LOGITS, TARGET, MASK, entropy=v),
                              "entropy", F),
    "logprobs_step.non_loss_data": (lambda v: mv.logprobs_step(LOGITS, TARGET, MASK,
                                                               non_loss_data=v),
                                    "non_loss_data", T),
    "token_loss.non_loss_data": (lambda v: mv.token_loss(
        LOGITS, TARGET, MASK, loss_fn=mv.score_tokens, non_loss_data=v), "non_loss_data", T),
    "score_tokens.non_loss_data": (lambda v: mv.score_tokens(LP, MASK, non_loss_data=v),
                                   "non_loss_data", T),
    "RolloutCorrection.validate": (lambda v: mv.RolloutCorrection(validate=v), "validate", T),
    **{f"distill.{name}": ((lambda v, name=name: _distill(**{name: v})), name, T)
       for name in ("tail_bucket", "renormalize", "temperature_scale", "validate")},
    **{f"topk_divergence.{name}": ((lambda v, name=name: mv.topk_divergence(
        TEACHER.logprobs, TEACHER.logprobs, MASK, **{name: v})), name, T)
       for name in ("tail_bucket", "renormalize")},
    "pack.seq_params": (lambda v: pack_sequences([torch.arange(3)], seq_params=v), "seq_params",
                        F),
    "pack.validate": (lambda v: pack_sequences(torch.zeros(2, 3, dtype=torch.long), [3, 1],
                                               validate=v), "validate", T),
    "make_packed_seq_params.pad_between_seqs": (lambda v: make_packed_seq_params(
        CU, CU, 2, pad_between_seqs=v), "pad_between_seqs", F),
    "sequence_alignment.sequence_parallel": (lambda v: sequence_alignment(
        sequence_parallel=v), "sequence_parallel", T),
    "shift_packed_labels.validate": (lambda v: shift_packed_labels(
        torch.arange(4), CU, validate=v), "validate", T),
    "unpack.validate": (lambda v: unpack_sequences(torch.zeros(4), CU, max_seqlen=2,
                                                   validate=v), "validate", T),
    "cp_indices.validate": (lambda v: context_parallel_indices(None, 4, cp_size=1, cp_rank=0,
                                                               validate=v), "validate", T),
    "cp_shard.validate": (lambda v: shard_for_context_parallel(torch.zeros(1, 4), None,
                                                               validate=v), "validate", T),
    "cp_gather.validate": (lambda v: gather_from_context_parallel(torch.zeros(1, 4), None,
                                                                  validate=v), "validate", T),
    **{f"settings.{name}": ((lambda v, name=name: settings.PluginSettings(**{name: v})), name,
                            F)
       for name in ("active", "validate", "require_fused_lm_head")},
}


@pytest.mark.parametrize("bad", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("case", sorted(CONSUMERS))
def test_every_bool_option_refuses_a_non_bool_naming_it(case, bad):
    call, name, _ = CONSUMERS[case]
    if bad is None and name == "pad_between_seqs":
        pytest.skip("None leaves the field unset")
    with pytest.raises(ValueError, match=rf"\b{name}\b") as info:
        call(bad)
    assert len(str(info.value)) < 400  # never the 401 digits of 10**400


@pytest.mark.parametrize("case", sorted(CONSUMERS))
def test_every_bool_option_takes_numpy_bools(case):
    call, _, good = CONSUMERS[case]
    call(good)  # no error


def test_numpy_bools_are_stored_as_python_bools():
    assert mv.StatsOptions(validate=T).validate is True
    assert mv.RolloutCorrection(validate=T).validate is True
    assert settings.PluginSettings(validate=F).validate is False
    assert mv.vocab_parallel_stats(LOGITS, TARGET, batch_invariant=T).logprobs.shape == (3,)


def test_bool_fill_values_take_bools_and_0_1_and_cut_a_huge_int_short():
    """A pad value for bool tensors: a bool (numpy's too) or the int 0 or 1; anything else names
    the option, 10**400 cut short (it printed all 401 digits)."""
    values = torch.ones(4, dtype=torch.bool)
    for fill in (False, 0, np.False_):
        out = unpack_sequences(values, CU, max_seqlen=3, padding_value=fill)[0]
        assert out.dtype == torch.bool and not out[:, 2].any()
    for bad in (2, -1, 0.5, "x", HUGE):
        with pytest.raises(ValueError, match=r"^padding_value \(for bool values\) must be") as e:
            unpack_sequences(values, CU, max_seqlen=3, padding_value=bad)
        assert len(str(e.value)) < 120
