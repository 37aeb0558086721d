"""Multi-process cases of batch-invariant mode and of no host sync on tp gloo ranks.

Run by ``tests/unit/test_batch_invariant_dist.py`` for tp = 1, 2, 4. Every rank builds the same
full logits from the same seed and keeps its own vocabulary shard; tp = 1 results are computed
on every rank from the full logits with ``tp_group=None``, so "tp = k equals tp = 1 bitwise" is
checked inside one launch.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2  # noqa: E402

from _reference import reference_stats  # noqa: E402
from megatron_vocabstats import linear_vocab_parallel_stats, vocab_parallel_stats  # noqa: E402
from megatron_vocabstats.profiling import count_collectives  # noqa: E402
from megatron_vocabstats.testing import forbid_host_sync  # noqa: E402

CASES = Cases()
VOCAB, PADDED = 500, 512  # Megatron pads 500 to a multiple of 128 * tp for tp = 1, 2, 4
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _shard(full, group):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    width = full.shape[-1] // tp
    return full[..., rank * width:(rank + 1) * width]


def _problem(dtype, tokens=(2, 9)):
    full = (torch.randn(*tokens, PADDED, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, VOCAB, tokens)
    target.view(-1)[0] = -100
    return full, target


def _run(logits, target, group, **options):
    leaf = logits.detach().clone().requires_grad_()
    st = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=VOCAB, **options)
    (st.logprobs * 0.7 + st.entropy * 0.2).sum().backward()
    return st, leaf.grad


def _tp_equals_tp1(group, dtype, **options):
    full, target = _problem(dtype)
    mine, grad = _run(_shard(full, group), target, group, batch_invariant="tp", chunk_size=4,
                      **options)
    for logits in (full, full[..., :VOCAB]):  # tp = 1 with and without the padding columns
        one, grad_one = _run(logits, target, None, batch_invariant="tp", chunk_size=5, **options)
        for name, a, b in zip(("logprobs", "entropy", "logsumexp"), mine, one):
            assert torch.equal(a, b), f"{name}: tp differs from tp=1 by {(a - b).abs().max()}"
        width = grad.shape[-1]
        rank = dist.get_rank(group)
        ref_cols = torch.nn.functional.pad(grad_one, (0, PADDED - grad_one.shape[-1]))
        assert torch.equal(grad, ref_cols[..., rank * width:(rank + 1) * width]), "gradient"
    lp, ent, lse = reference_stats(full.double(), target, vocab_size=VOCAB, **options)
    for name, a, b in zip(("logprobs", "entropy", "logsumexp"), mine, (lp, ent, lse)):
        err = (a.double() - b).abs() / b.abs().clamp(min=1)
        assert err.max() <= TOL[dtype], f"{name}: {err.max():.3g} from float64"


@CASES.register
def tp_mode_equals_tp1_bitwise_fp32(group):
    _tp_equals_tp1(group, torch.float32)


@CASES.register
def tp_mode_equals_tp1_bitwise_bf16_smoothing_temperature(group):
    _tp_equals_tp1(group, torch.bfloat16, label_smoothing=0.1, temperature=0.7)


@CASES.register
def batch_mode_rows_are_invariant_under_tp(group):
    full, target = _problem(torch.float32, tokens=(37,))
    shard = _shard(full, group)
    for mode in (True, "tp"):
        whole = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=VOCAB,
                                     batch_invariant=mode, chunk_size=16)
        for rows, chunk in ((slice(11, 12), 1), (slice(5, 13), 3), (slice(11, 37), None)):
            part = vocab_parallel_stats(shard[rows], target[rows], tp_group=group,
                                        vocab_size=VOCAB, batch_invariant=mode, chunk_size=chunk)
            at = 11 - rows.start
            for a, b in zip(part[:3], whole[:3]):
                assert torch.equal(a[at], b[11]), f"mode {mode}, rows {rows}"


@CASES.register
def fused_op_rows_are_invariant_under_tp(group):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    hidden = torch.randn(37, 24)
    weight_full = torch.randn(PADDED, 24) * 0.4
    weight = _shard(weight_full.t(), group).t().contiguous()
    target = torch.randint(0, VOCAB, (37,))
    opts = dict(tp_group=group, vocab_size=VOCAB, batch_invariant=True)
    whole = linear_vocab_parallel_stats(hidden, weight, target, chunk_size=16, **opts)
    for rows, chunk in ((slice(20, 21), 1), (slice(14, 22), 3), (slice(3, 37), None)):
        part = linear_vocab_parallel_stats(hidden[rows], weight, target[rows], chunk_size=chunk,
                                           **opts)
        for a, b in zip(part[:3], whole[:3]):
            assert torch.equal(a[20 - rows.start], b[20]), f"rows {rows}"
    # Sequence parallel: this rank's shard of the sequence, gathered inside.
    local = hidden[:36].view(tp, 36 // tp, 24)[rank] if 36 % tp == 0 else None
    if local is not None:
        sp = linear_vocab_parallel_stats(local.unsqueeze(1), weight, target[:36].view(36, 1),
                                         sequence_parallel=True, chunk_size=5, **opts)
        for a, b in zip(sp[:3], whole[:3]):
            assert torch.equal(a.view(-1), b[:36]), "sequence parallel"


@CASES.register
def no_host_sync_and_one_collective_under_tp(group):
    _, tp = dist.get_rank(group), dist.get_world_size(group)
    full, target = _problem(torch.bfloat16)
    shard = _shard(full, group)
    hidden = torch.randn(8 // tp * tp, 1, 16)
    weight = torch.randn(PADDED // tp, 16, dtype=torch.float32) * 0.3
    for mode in (False, True, "tp"):
        leaf = shard.detach().clone().requires_grad_()
        with forbid_host_sync(), count_collectives() as calls:
            st = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=VOCAB,
                                      chunk_size=4, validate=False, batch_invariant=mode)
        assert len(calls) == (1 if tp > 1 else 0), f"mode {mode}: {calls}"
        with forbid_host_sync():
            (st.logprobs.sum() + st.entropy.sum()).backward()
            h = hidden.clone().requires_grad_()
            local = h.view(tp, -1, 1, 16)[dist.get_rank(group)]
            fused = linear_vocab_parallel_stats(local, weight, target.view(-1)[:h.shape[0]].view(
                -1, 1).clamp(min=0), tp_group=group, sequence_parallel=True, vocab_size=VOCAB,
                validate=False, batch_invariant=mode, chunk_size=3)
            fused.logprobs.sum().backward()


@CASES.register
def tp_mode_needs_whole_blocks_and_agreement(group):
    rank, tp = needs_tp2(group)
    logits, target = torch.randn(3, 100), torch.zeros(3, dtype=torch.long)
    try:
        vocab_parallel_stats(logits, target, tp_group=group, batch_invariant="tp")
    except ValueError as exc:
        assert "multiple of 128" in str(exc), str(exc)
    else:
        raise AssertionError("a shard width of 100 was accepted in 'tp' mode")
    mine = True if rank == 0 else False
    try:
        vocab_parallel_stats(torch.randn(3, 128), target, tp_group=group, batch_invariant=mine)
    except ValueError as exc:
        assert "batch_invariant differs" in str(exc), str(exc)
    else:
        raise AssertionError("batch_invariant that differs across ranks was accepted")
    # A small vocabulary (shard as wide as it), logits that require grad, validate on: the
    # replicated-logits check reads one row without warning about requires_grad.
    leaf = (torch.arange(3 * 128, dtype=torch.float32).view(3, 128) * (rank + 1)).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=100, batch_invariant="tp")


if __name__ == "__main__":
    main(CASES)
