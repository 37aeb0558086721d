"""One checker of number-like options (``ops.options.check_number``), used by every op,
loss, settings object, flag and command line. It accepts Python and numpy numbers and refuses a
bool, NaN, +-inf, a string, a tensor and out-of-range values, huge ints included, with an error
that names the option (a ``ValueError``; a wrong type is ``InputTypeError``, also a
``TypeError``). Before, ``temperature=10**400`` and its kin raised ``OverflowError`` naming
nothing, numpy ints were refused by some checks, and ``top_k=2**70`` was accepted at tp 1 but
refused at tp > 1.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

import megatron_vocabstats as mv
from megatron_vocabstats.megatron import settings
from megatron_vocabstats.megatron.flag_types import FLAG_TYPES
from megatron_vocabstats.ops.options import check_number, number_problem
from megatron_vocabstats.packing import (
    context_parallel_indices,
    pack_sequences,
    sequence_alignment,
    unpack_sequences,
)

HUGE = 10**400


# ---------------------------------------------------------------------------------------------
# The checker


@pytest.mark.parametrize("value, expected", [
    (0.5, 0.5), (np.float32(0.5), 0.5), (np.float64(0.25), 0.25), (np.float16(0.5), 0.5),
    (Fraction(1, 4), 0.25), (1, 1.0), (np.int64(1), 1.0)])
def test_real_options_take_python_and_numpy_numbers(value, expected):
    got = check_number("x", value, low=0.0, high=1.0)
    assert got == expected and type(got) is float


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)])
def test_int_options_take_python_and_numpy_ints(value):
    got = check_number("n", value, integer=True, low=1)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value, kind", [
    (True, TypeError), (np.bool_(True), TypeError), ("0.5", TypeError),
    (torch.tensor(0.5), TypeError), (None, TypeError), (math.nan, ValueError),
    (np.float32("nan"), ValueError), (math.inf, ValueError), (-math.inf, ValueError),
    (HUGE, ValueError), (-HUGE, ValueError), (2.0, ValueError), (-0.5, ValueError)])
def test_bad_real_values_name_the_option(value, kind):
    with pytest.raises(kind, match=r"^opt must be a finite number in \[0, 1\], got "):
        check_number("opt", value, low=0.0, high=1.0)
    assert number_problem(value, low=0.0, high=1.0) is not None


@pytest.mark.parametrize("value", [True, 2.0, np.float64(2.0), "2", math.nan, HUGE, -HUGE, 0])
def test_bad_int_values_name_the_option(value):
    with pytest.raises(ValueError, match=r"^count must be an int in \[1, 9\]"):
        check_number("count", value, integer=True, low=1, high=9)


def test_unbounded_real_refuses_what_no_float_holds():
    with pytest.raises(ValueError, match="coef must be a finite number .*fits a float64"):
        check_number("coef", HUGE)
    assert check_number("coef", 10**300) == 1e300


def test_none_and_fill_values():
    assert check_number("k", None, integer=True, low=1, none_ok=True) is None
    with pytest.raises(ValueError, match="k must be an int >= 1 or None, got 0"):
        check_number("k", 0, integer=True, low=1, none_ok=True)
    assert math.isnan(check_number("pad", math.nan, low=-1.0, high=1.0, finite=False))
    with pytest.raises(ValueError, match="pad must be a number in"):
        check_number("pad", 2.0, low=-1.0, high=1.0, finite=False)


# ---------------------------------------------------------------------------------------------
# Every consumer: (call with the option set to v, the name the error must carry, a good value)

LOGITS, TARGET = torch.randn(3, 8), torch.tensor([1, 2, -100])
HIDDEN, WEIGHT = torch.randn(3, 4), torch.randn(8, 4)
LP = torch.full((2, 3), -1.0)
MASK = torch.ones(2, 3)
TEACHER = mv.TopK(torch.log_softmax(torch.randn(3, 2), -1), torch.tensor([[0, 1]] * 3))


def _policy(**kw):
    return mv.policy_loss(LP, LP, LP, MASK, **kw)


REAL = {  # float options: (call, name, good numpy value)
    "stats.temperature": (lambda v: mv.vocab_parallel_stats(LOGITS, TARGET, temperature=v),
                          "temperature", np.float32(0.7)),
    "stats.label_smoothing": (
        lambda v: mv.vocab_parallel_stats(LOGITS, TARGET, label_smoothing=v),
        "label_smoothing", np.float64(0.1)),
    "linear.temperature": (lambda v: mv.linear_vocab_parallel_stats(
        HIDDEN, WEIGHT, TARGET, temperature=v), "temperature", np.float32(2.0)),
    "topk_logprobs.temperature": (lambda v: mv.vocab_parallel_topk_logprobs(
        LOGITS, TARGET.clamp(min=0)[:, None], temperature=v), "temperature", np.float64(0.5)),
    "sampling.top_p": (lambda v: mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET, top_p=v),
                       "top_p", np.float32(0.9)),
    "sampling.min_p": (lambda v: mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET, min_p=v),
                       "min_p", np.float64(0.05)),
    "sampling.temperature": (lambda v: mv.vocab_parallel_sampling_logprobs(
        LOGITS, TARGET, temperature=v), "temperature", np.float32(0.3)),
    "linear_sampling.top_p": (lambda v: mv.linear_vocab_parallel_sampling_logprobs(
        HIDDEN, WEIGHT, TARGET, top_p=v), "top_p", np.float32(0.5)),
    "sft_loss.label_smoothing": (lambda v: mv.sft_loss(LOGITS, TARGET, torch.ones(3),
                                                       label_smoothing=v),
                                 "label_smoothing", np.float64(0.1)),
    "StatsOptions.temperature": (lambda v: mv.StatsOptions(temperature=v), "temperature",
                                 np.float32(1.5)),
    "policy.clip_eps": (lambda v: _policy(clip_eps=v), "clip_eps", np.float32(0.2)),
    "policy.clip_eps_high": (lambda v: _policy(clip_eps_high=v), "clip_eps_high",
                             np.float64(0.28)),
    "policy.dual_clip": (lambda v: _policy(dual_clip=v), "dual_clip", np.float32(3.0)),
    "policy.kl_coef": (lambda v: _policy(kl_coef=v, ref_logprobs=LP), "kl_coef",
                       np.float64(0.01)),
    "policy.entropy_coef": (lambda v: _policy(entropy_coef=v, entropy=LP), "entropy_coef",
                            np.float32(0.01)),
    "rollout.threshold": (lambda v: mv.RolloutCorrection(mode="tis", threshold=v), "threshold",
                          np.float32(2.0)),
    "rollout.low": (lambda v: mv.RolloutCorrection(mode="mis", low=v), "low", np.float64(0.5)),
    "rollout.high": (lambda v: mv.RolloutCorrection(mode="icepop", high=v), "high",
                     np.float32(4.0)),
    "distill.beta": (lambda v: mv.distillation_loss(LOGITS, TEACHER, torch.ones(3),
                                                    divergence="jsd", beta=v),
                     "beta", np.float32(0.3)),
    "distill.temperature": (lambda v: mv.distillation_loss(LOGITS, TEACHER, torch.ones(3),
                                                           temperature=v),
                            "temperature", np.float64(2.0)),
    "unpack.padding_value": (lambda v: unpack_sequences(
        torch.zeros(4, dtype=torch.float16), torch.tensor([0, 4]), max_seqlen=4,
        padding_value=v), "padding_value", np.float32(-1.0)),
    **{f"settings.{name}": ((lambda v, name=name: settings.PluginSettings(
        entropy="grad", **{name: v})), name, np.float32(0.5))
       for name in ("entropy_coef", "label_smoothing", "rollout_temperature", "rollout_top_p",
                    "rollout_min_p")},
}
INT = {  # int options: (call, name, good numpy value)
    "stats.chunk_size": (lambda v: mv.vocab_parallel_stats(LOGITS, TARGET, chunk_size=v),
                         "chunk_size", np.int64(2)),
    "stats.vocab_size": (lambda v: mv.vocab_parallel_stats(LOGITS, TARGET, vocab_size=v),
                         "vocab_size", np.int32(7)),
    "stats.ignore_index": (lambda v: mv.vocab_parallel_stats(LOGITS, TARGET, ignore_index=v),
                           "ignore_index", np.int64(-100)),
    "linear.chunk_size": (lambda v: mv.linear_vocab_parallel_stats(
        HIDDEN, WEIGHT, TARGET, chunk_size=v), "chunk_size", np.int64(2)),
    "topk.k": (lambda v: mv.vocab_parallel_topk(LOGITS, v), "k", np.int64(3)),
    "linear_topk.k": (lambda v: mv.linear_vocab_parallel_topk(HIDDEN, WEIGHT, v), "k",
                      np.int32(2)),
    "sampling.top_k": (lambda v: mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET, top_k=v),
                       "top_k", np.int64(3)),
    "StatsOptions.chunk_size": (lambda v: mv.StatsOptions(chunk_size=v), "chunk_size",
                                np.int64(4)),
    "distill.teacher_vocab_size": (lambda v: mv.distillation_loss(
        LOGITS, TEACHER, torch.ones(3), teacher_vocab_size=v), "teacher_vocab_size",
        np.int64(8)),
    "pack.alignment": (lambda v: pack_sequences([torch.arange(3)], alignment=v), "alignment",
                       np.int64(4)),
    "pack.total_length": (lambda v: pack_sequences([torch.arange(3)], total_length=v),
                          "total_length", np.int64(8)),
    "pack.pad_token_id": (lambda v: pack_sequences([torch.arange(3)], pad_token_id=v),
                          "pad_token_id", np.int64(0)),
    "pack.ignore_index": (lambda v: pack_sequences([torch.arange(3)], ignore_index=v),
                          "ignore_index", np.int64(-1)),
    "sequence_alignment.cp_size": (lambda v: sequence_alignment(cp_size=v), "cp_size",
                                   np.int64(2)),
    "cp_indices.cp_rank": (lambda v: context_parallel_indices(None, 8, cp_size=2, cp_rank=v),
                           "cp_rank", np.int64(1)),
    "cp_indices.total_tokens": (lambda v: context_parallel_indices(None, v, cp_size=1,
                                                                   cp_rank=0),
                                "total_tokens", np.int64(4)),
    "unpack.max_seqlen": (lambda v: unpack_sequences(torch.zeros(4), torch.tensor([0, 4]),
                                                     max_seqlen=v), "max_seqlen", np.int64(4)),
    "workspace.max_buffers": (lambda v: mv.configure_workspace(max_buffers=v), "max_buffers",
                              np.int64(8)),
    **{f"settings.{name}": ((lambda v, name=name: settings.PluginSettings(**{name: v})), name,
                            np.int64(4))
       for name in ("logprobs_chunk_size", "lm_head_chunk_size", "vocab_size",
                    "token_alignment", "rollout_top_k")},
}
BAD_REAL = [True, np.bool_(False), "0.5", math.nan, math.inf, -math.inf, HUGE, -HUGE]
BAD_INT = [True, 2.5, np.float64(2.0), "3", math.nan, HUGE, -HUGE]


@pytest.fixture(autouse=True)
def _restore_workspace():
    yield
    mv.configure_workspace(max_buffers=8)


@pytest.mark.parametrize("bad", BAD_REAL, ids=repr)
@pytest.mark.parametrize("case", sorted(REAL))
def test_every_real_option_refuses_naming_it(case, bad):
    call, name, _ = REAL[case]
    if name == "padding_value" and isinstance(bad, float) and not math.isfinite(bad):
        pytest.skip("a fill value may be NaN or +-inf")
    with pytest.raises(ValueError, match=rf"\b{name}\b") as info:
        call(bad)
    assert not isinstance(info.value, OverflowError)


@pytest.mark.parametrize("bad", BAD_INT, ids=repr)
@pytest.mark.parametrize("case", sorted(INT))
def test_every_int_option_refuses_naming_it(case, bad):
    call, name, _ = INT[case]
    if bad is HUGE and name in ("top_k", "rollout_top_k"):
        pytest.skip("a k of V or more keeps everything: see test_huge_top_k_keeps_everything")
    if bad is -HUGE and name in ("ignore_index", "pad_token_id"):
        bad = -(2**80)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call(bad)


@pytest.mark.parametrize("case", sorted(REAL) + sorted(INT))
def test_every_option_takes_numpy_numbers(case):
    call, _, good = {**REAL, **INT}[case]
    call(good)  # no error


def test_huge_top_k_keeps_everything_at_any_tp():
    """A k of V or more keeps every column; 2**70 and 10**400 included (at tp > 1 the agreement
    compared it as an int64: refused; 10**400 overflowed the search's float)."""
    plain = mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET)
    for k in (8, 2**70, HUGE):
        assert torch.equal(mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET, top_k=k).logprobs,
                           plain.logprobs)


def test_distillation_temperature_scale_of_a_huge_temperature_names_it():
    """Section 4: ``temperature_scale`` multiplies the loss by ``temperature ** 2``: from 1.4e154
    on Python raised ``OverflowError`` naming nothing, above 1.8e19 the factor did not fit fp32
    (an inf loss without an error). Refused naming ``temperature``; at the largest temperature
    whose square fits fp32 the loss is finite."""
    teacher = mv.TopK(torch.log(torch.tensor([[0.5, 0.3]] * 3)), torch.tensor([[1, 2]] * 3))
    for tau in (1e20, 1e155, float(HUGE // 10**100), np.float64(1e300)):
        with pytest.raises(ValueError, match="temperature=.* temperature_scale=True"):
            mv.distillation_loss(LOGITS, teacher, torch.ones(3), temperature=tau,
                                 temperature_scale=True)
    out = mv.distillation_loss(LOGITS, teacher, torch.ones(3), temperature=1e19,
                               temperature_scale=True)
    assert torch.isfinite(out.loss_sum)
    mv.distillation_loss(LOGITS, teacher, torch.ones(3), temperature=1e155)  # no factor: fine


@pytest.mark.parametrize("flag", sorted(FLAG_TYPES))
def test_every_flag_type_refuses_through_the_checker(flag):
    kind = FLAG_TYPES[flag]
    for bad in (True, "1", math.nan, math.inf, -HUGE) + ((HUGE,) if flag != "rollout_top_k"
                                                        else ()):
        problem = kind.problem(bad)
        assert problem and problem.startswith("must be"), (flag, bad, problem)
    for text in ("nan", "inf", "-" + "1" * 400) + (("1" + "0" * 400,) if flag != "rollout_top_k"
                                                  else ()):
        with pytest.raises(Exception, match="must be") as info:  # argparse.ArgumentTypeError
            kind(text)
        assert not isinstance(info.value, OverflowError)


def test_settings_take_vllms_minus_one_as_off():
    assert settings.PluginSettings(rollout_top_k=-1).rollout_top_k is None
    assert settings.PluginSettings(rollout_top_k=np.int64(5)).rollout_top_k == 5


@pytest.mark.parametrize("fields", [
    dict(rollout_correction_mode="tis", rollout_correction_threshold=HUGE),
    dict(rollout_correction_mode="tis", rollout_correction_threshold=-1.0),
    dict(rollout_correction_mode="tis", rollout_correction_threshold="2"),
    dict(rollout_correction_mode="tis", rollout_correction_threshold=True),
    dict(rollout_correction_mode="tis", rollout_correction_low=0.5),
    dict(rollout_correction_mode="mis", rollout_correction_threshold=2.0),
    dict(rollout_correction_mode="mis", rollout_correction_low=math.nan),
    dict(rollout_correction_mode="mis", rollout_correction_low=HUGE),
    dict(rollout_correction_mode="icepop", rollout_correction_high=np.bool_(True)),
    dict(rollout_correction_mode="icepop", rollout_correction_low=3.0,
         rollout_correction_high=2.0),
    dict(rollout_correction_mode="mis", rollout_correction_low=1.5, rollout_correction_high=4.0),
    dict(rollout_correction_mode="mis", rollout_correction_high=0.9),
    dict(rollout_correction_mode="icepop", rollout_correction_level="sequence"),
], ids=lambda f: ",".join(f"{k[19:] or k}={str(v)[:8]}" for k, v in f.items()))
def test_settings_rollout_errors_name_the_settings_fields(fields):
    """``PluginSettings`` passed its rollout-correction fields to
    ``RolloutCorrection`` and its errors named that class's fields (``threshold``, ``low``,
    ``high``), not the settings' (``rollout_correction_threshold``, ...). Every field the message
    names is now a settings field; a huge int is cut short."""
    with pytest.raises(ValueError) as info:
        settings.PluginSettings(**fields)
    message = str(info.value)
    assert message.startswith("rollout_correction_"), message
    bare = re.findall(r"(?<![\w'])(threshold|low|high|level|mode)\b", message)
    assert not bare, f"names {bare} without the settings' prefix: {message}"
    assert len(message) < 300


def test_settings_store_the_checked_rollout_bounds():
    s = settings.PluginSettings(rollout_correction_mode="mis", rollout_correction_low=np.float32(
        0.25), rollout_correction_high=4)
    assert (s.rollout_correction_low, s.rollout_correction_high) == (0.25, 4.0)
    assert type(s.rollout_correction_high) is float and s.rollout_correction_threshold is None
    assert s.rollout_correction() == mv.RolloutCorrection(mode="mis", low=0.25, high=4.0,
                                                          validate=True)
    assert settings.PluginSettings(rollout_correction_mode="tis").rollout_correction_threshold \
        is None  # unset: the mode's default, filled by RolloutCorrection
