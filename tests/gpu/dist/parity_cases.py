"""Tensor-parallel parity on NCCL, one GPU per rank; run by tests/gpu/test_parity_dist.py.

The float64 parity cases of the CPU suite (``tests/unit/dist/vocab_parallel_cases.py`` and
``fused_linear_cases.py``) run unchanged here, with the ops they call swapped for
:func:`on_device` versions: the CPU inputs move to this rank's GPU (differentiably, so the CPU
leaves get the gradients), the op runs there with its collectives on NCCL, and the results come
back for the same float64 comparisons. Cases that need NCCL itself (the bitwise agreement of the
ranks, read back with an all-gather of CUDA tensors) are written here.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _nccl import Cases, Skip, device, main  # noqa: E402  (puts tests/unit/dist on sys.path)

import fused_linear_cases as fused_cases  # noqa: E402
import vocab_parallel_cases as core_cases  # noqa: E402
from megatron_vocabstats import linear_vocab_parallel_stats, vocab_parallel_stats  # noqa: E402

CASES = Cases()

# The ops the CPU cases call by their module-level names.
OPS = ("vocab_parallel_stats", "vocab_parallel_logprobs", "vocab_parallel_entropy",
       "vocab_parallel_cross_entropy", "linear_vocab_parallel_stats",
       "linear_vocab_parallel_cross_entropy")
CORE = ("fp32_matches_float64", "fp32_temperature_and_label_smoothing", "bf16_matches_float64",
        "fp16_matches_float64", "all_targets_on_first_rank", "all_targets_on_last_rank",
        "odd_shard_width_targets_on_other_rank", "chunked_equals_unchunked_bitwise",
        "collective_budget", "padding_filling_whole_shards", "wrappers_match_stats",
        "mismatched_shard_widths_raise_everywhere", "mismatched_options_raise_everywhere",
        "mismatched_targets_raise_everywhere",
        "out_of_range_target_on_one_rank_raises_everywhere", "replicated_full_vocab_is_rejected")
FUSED = ("fp32_matches_float64", "fp32_temperature_smoothing_padded_vocab",
         "bf16_matches_float64", "sequence_parallel_fp32_matches_float64",
         "sequence_parallel_bf16_matches_float64", "forward_grad_matches_float64",
         "forward_grad_sequence_parallel_bf16", "all_ignored_chunk_has_zero_gradient",
         "collective_budget", "sequence_parallel_shard_length_mismatch_raises_everywhere",
         "rank_local_bad_input_raises_everywhere")


def _move(x, dev):
    return x.to(dev) if isinstance(x, torch.Tensor) else x


def on_device(op, dev):
    """``op`` with its tensor arguments moved to ``dev`` and its tensor results moved to the CPU.

    Both moves are differentiable: gradients reach the caller's CPU leaves. A tuple result (such
    as ``VocabStats``) keeps its type.
    """
    @functools.wraps(op)
    def wrapped(*args, **kwargs):
        out = op(*(_move(a, dev) for a in args), **{k: _move(v, dev) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return type(out)(*(_move(o, "cpu") for o in out))
        return _move(out, "cpu")

    return wrapped


@contextmanager
def ops_on_device(module, dev):
    """Swap the ops ``module`` calls by name for their :func:`on_device` versions, then restore."""
    saved = {name: getattr(module, name) for name in OPS if hasattr(module, name)}
    try:
        for name, op in saved.items():
            setattr(module, name, on_device(op, dev))
        yield
    finally:
        for name, op in saved.items():
            setattr(module, name, op)


def _register_cpu_case(module, prefix: str, name: str) -> None:
    fn = module.CASES[name]  # a KeyError here means the CPU case was renamed

    def case(group):
        with ops_on_device(module, device()):
            fn(group)

    CASES[f"{prefix}_{name}"] = case


for _name in CORE:
    _register_cpu_case(core_cases, "core", _name)
for _name in FUSED:
    _register_cpu_case(fused_cases, "fused", _name)


def _assert_ranks_agree(group, tensors) -> None:
    for t in tensors:
        if t is None:
            continue
        table = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(table, t.contiguous(), group=group)
        assert all(torch.equal(table[0], x) for x in table), "ranks returned different values"


@CASES.register
def core_ranks_agree_bitwise_on_nccl(group):
    _, shard, target = core_cases.make_case(group, tokens=(37, 3), vocab=1001,
                                            dtype=torch.bfloat16)
    leaf = shard.detach().to(device()).requires_grad_()
    st = vocab_parallel_stats(leaf, target.to(device()), tp_group=group, vocab_size=1001,
                              chunk_size=16, temperature=0.8)
    (st.logprobs.sum() + 0.5 * st.entropy.sum()).backward()
    _assert_ranks_agree(group, st)


@CASES.register
def fused_ranks_agree_bitwise_on_nccl(group):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    hidden, weight, target = fused_cases.make_problem(tp, tokens=(8 * tp, 3), hidden_size=96,
                                                      vocab=1001, dtype=torch.bfloat16)
    h = fused_cases.shard_rows(hidden, rank, tp).to(device()).requires_grad_()
    w = fused_cases.shard_rows(weight, rank, tp).to(device()).requires_grad_()
    st = linear_vocab_parallel_stats(h, w, target.to(device()), tp_group=group,
                                     sequence_parallel=True, vocab_size=1001, chunk_size=10)
    (st.logprobs.sum() + 0.5 * st.entropy.sum()).backward()
    _assert_ranks_agree(group, st)


@CASES.register
def core_tp_invariant_mode_equals_tp1_bitwise_on_nccl(group):
    if "batch_invariant" not in inspect.signature(vocab_parallel_stats).parameters:
        raise Skip("vocab_parallel_stats has no batch_invariant argument")
    # Shards of 1024 / tp columns: multiples of 128, as the "tp" mode needs.
    full, shard, target = core_cases.make_case(group, tokens=(37, 3), vocab=1024,
                                               dtype=torch.bfloat16)
    dev, target = device(), target.to(device())
    one = vocab_parallel_stats(full.to(dev), target, batch_invariant="tp", temperature=0.8)
    many = vocab_parallel_stats(shard.detach().to(dev), target, tp_group=group,
                                batch_invariant="tp", temperature=0.8)
    for name, a, b in zip(one._fields[:3], one, many):
        assert torch.equal(a, b), f"{name}: tp={dist.get_world_size(group)} differs from tp=1"


if __name__ == "__main__":
    main(CASES)
