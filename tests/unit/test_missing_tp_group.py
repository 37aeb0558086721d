"""A missing ``tp_group`` is refused where it can be detected, with a message naming
``tp_group`` (one process, Megatron's parallel state faked; the real tp 2 runs are
``dist/per_rank_options_cases.py::missing_or_wrong_group``). Before: forgetting the group at tp 2
gave per-shard log-probs, up to 1.85 nats off, with no error, and when an error fired it blamed
``target``."""

from __future__ import annotations

import pytest
import torch

import megatron_vocabstats as mv

parallel_state = pytest.importorskip("megatron.core.parallel_state")

LOGITS = torch.randn(3, 8)
TARGET = torch.tensor([1, 5, 7])


@pytest.fixture
def megatron_tp(monkeypatch):
    """Megatron's parallel state initialised with the given tensor-parallel size."""
    def set_tp(tp):
        monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda: None)
    return set_tp


OPS = {
    "stats": lambda **kw: mv.vocab_parallel_stats(LOGITS, TARGET, **kw),
    "entropy": lambda **kw: mv.vocab_parallel_entropy(LOGITS, **kw),
    "topk": lambda **kw: mv.vocab_parallel_topk(LOGITS, 2, **kw),
    "topk_logprobs": lambda **kw: mv.vocab_parallel_topk_logprobs(LOGITS, TARGET[:, None], **kw),
    "gather_logits": lambda **kw: mv.vocab_parallel_gather_logits(LOGITS, TARGET[:, None], **kw),
    "sampling": lambda **kw: mv.vocab_parallel_sampling_logprobs(LOGITS, TARGET, **kw),
    "linear_stats": lambda **kw: mv.linear_vocab_parallel_stats(torch.randn(3, 4),
                                                                torch.randn(8, 4), TARGET, **kw),
    "sft_loss": lambda **kw: mv.sft_loss(LOGITS, TARGET, torch.ones(3), **kw),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_no_group_under_megatron_tensor_parallelism_is_refused(op, megatron_tp):
    megatron_tp(2)
    with pytest.raises(ValueError, match="tp_group is None .* Megatron's tensor-parallel group "
                                         "has 2 ranks"):
        OPS[op]()
    OPS[op](vocab_size=8)  # says the logits hold the whole vocabulary: no error
    megatron_tp(1)
    OPS[op]()


def test_no_group_outside_megatron_is_no_tensor_parallelism():
    stats = OPS["stats"]()  # Megatron imported, not initialised, one process
    assert torch.isfinite(stats.logprobs).all()


def test_errors_that_a_missing_group_causes_name_it():
    """Without Megatron: a target id beyond the shard, or a vocab_size wider than it, say that
    tp_group is None (was: blamed the target alone)."""
    with pytest.raises(ValueError, match=r"target holds id 9, .*tp_group is None"):
        mv.vocab_parallel_stats(LOGITS, torch.tensor([1, 9, 2]))
    with pytest.raises(ValueError, match="vocab_size=16 does not fit .*pass tp_group"):
        mv.vocab_parallel_stats(LOGITS, TARGET, vocab_size=16)
