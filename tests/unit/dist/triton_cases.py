"""Multi-process cases of the Triton kernels under Triton's interpreter (tp 2 on gloo); run by
tests/unit/test_triton_kernels.py.

Run as a script (its own process), it turns the interpreter on (``TRITON_INTERPRET=1``) before
the first case imports the kernels (importing the package does not import triton); imported for
its case names (by the pytest side) it changes nothing. Every rank builds the same full
logits, keeps its shard, and compares the Triton path with the torch path and the float64
reference within the bounds of ``_reference.py`` (the online rescaling counted as in
``_triton_interp.online_parts``, plus the tp shards as merged parts).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2
from _reference import (
    assert_within,
    reference_stats,
    smoothed_logprob_bound,
    stats_bounds,
    stats_grad_bound,
    temperature_dz,
)
from _triton_parity import online_parts
from fused_linear_cases import expect_value_error
from fused_linear_cases import run_and_check as fused_run_and_check
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops.kernels import block_columns

CASES = Cases()


def _shards(group, *, width, vocab, dtype, tokens=6):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(7)
    full = (torch.randn(tokens, width * tp, generator=gen) * 3).to(dtype)
    full[0, 1] = float("-inf")
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[2] = -100
    return full, full[:, rank * width:(rank + 1) * width].clone(), target


def _parity(group, dtype, *, width, vocab, tau, eps):
    rank, tp = needs_tp2(group)
    full, shard, target = _shards(group, width=width, vocab=vocab, dtype=dtype)
    valid = target != -100
    w_lp = torch.linspace(-1, 2, target.numel())
    w_h = torch.linspace(1, -0.5, target.numel())
    leaf = shard.clone().requires_grad_()
    st = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=vocab, temperature=tau,
                              label_smoothing=eps, kernel="triton")
    ((st.logprobs * w_lp).sum() + (st.entropy * w_h).sum()).backward()
    ref_leaf = full.double().requires_grad_()
    ref = reference_stats(ref_leaf, target, vocab_size=vocab, temperature=tau,
                          label_smoothing=eps)
    ((ref[0] * w_lp.double()).sum() + (ref[1] * w_h.double()).sum()).backward()
    z = full.double()[:, :vocab] / tau
    parts = tp * online_parts(width, block_columns(width, dtype.itemsize))
    b = stats_bounds(z, dz=temperature_dz(z, tau), width=width, parts=parts, exp2=True)
    assert_within(st.logsumexp, ref[2], b.logsumexp, "logsumexp")
    assert_within(st.entropy[valid], ref[1][valid], b.entropy[valid], "entropy")
    safe = torch.where(valid, target, 0)
    assert_within(st.logprobs[valid], ref[0][valid],
                  smoothed_logprob_bound(b, safe, eps)[valid], "logprobs")
    keep = valid.double() / tau
    grad_ref = ref_leaf.grad[:, :vocab]
    bound = stats_grad_bound(b, grad_ref, c_lp=w_lp.double() * keep, c_h=w_h.double() * keep,
                             target=safe, eps=eps, scaled=tau != 1.0, dtype=dtype)
    # This rank's real columns of the full gradient and bound.
    lo, hi = rank * width, min((rank + 1) * width, vocab)
    mine = leaf.grad[:, :max(hi - lo, 0)]
    assert_within(mine[valid], grad_ref[:, lo:hi][valid], bound[:, lo:hi][valid], "gradient")
    assert bool((leaf.grad[:, max(hi - lo, 0):] == 0).all()), "gradient at padding columns"
    assert bool((leaf.grad[~valid] == 0).all()), "gradient at ignored rows"
    # Identical on every rank.
    gathered = [torch.empty_like(st.logsumexp) for _ in range(tp)]
    dist.all_gather(gathered, st.logsumexp, group=group)
    assert all(torch.equal(g, gathered[0]) for g in gathered)


@CASES.register
def tp_parity_fp32_padding_smoothing(group):
    _parity(group, torch.float32, width=40, vocab=71, tau=1.0, eps=0.1)


@CASES.register
def tp_parity_bf16_multi_block_temperature(group):
    _parity(group, torch.bfloat16, width=1100, vocab=2150, tau=0.8, eps=0.0)


@CASES.register
def tp_kernels_must_agree(group):
    """A rank on the torch path and one on the Triton path: the agreement check names it."""
    rank, tp = needs_tp2(group)
    _, shard, target = _shards(group, width=40, vocab=80, dtype=torch.float32)
    expect_value_error(lambda: vocab_parallel_stats(shard, target, tp_group=group,
                                                    kernel="triton" if rank == 0 else "torch"),
                       "kernel (resolved) differs")


@CASES.register
def tp_fused_bf16_temperature_smoothing(group):
    fused_run_and_check(group, dtype=torch.bfloat16, temperature=0.9, label_smoothing=0.1,
                        kernel="triton")


@CASES.register
def tp_fused_sequence_parallel_forward_grad(group):
    fused_run_and_check(group, sequence_parallel=True, forward_grad=True, kernel="triton")


@CASES.register
def tp_invariant_mode_gives_the_bits_of_tp1(group):
    """``batch_invariant="tp"`` on the kernels: the shards' per-block statistics merged over tp
    give the bits of one process on the full logits."""
    needs_tp2(group)
    full, shard, target = _shards(group, width=256, vocab=500, dtype=torch.bfloat16)
    opts = dict(vocab_size=500, label_smoothing=0.1, batch_invariant="tp", kernel="triton")
    sharded = vocab_parallel_stats(shard, target, tp_group=group, **opts)
    alone = vocab_parallel_stats(full, target, **opts)
    for a, b in zip(sharded[:3], alone[:3]):
        assert torch.equal(a, b)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
    import _interp_fast

    _interp_fast.install()  # the interpreter's shortcuts (same results, _interp_fast.py)
    main(CASES)
