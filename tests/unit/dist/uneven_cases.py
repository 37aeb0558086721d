"""Shards of unequal widths given per rank (``vocab_start``), as torchtitan's ``ceil(V / tp)``
split with a shorter last shard; run by tests/unit/test_uneven_dist.py at tp 2 and 3.

Every rank builds the same full logits, keeps ``[start, start + width)`` and compares with the
float64 single-process reference over the full vocabulary.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main, needs_tp2  # noqa: E402

from _reference import reference_stats, reference_topk  # noqa: E402
from megatron_vocabstats import (  # noqa: E402
    linear_vocab_parallel_stats,
    vocab_parallel_gather_logits,
    vocab_parallel_stats,
    vocab_parallel_topk,
    vocab_parallel_topk_logits,
    vocab_parallel_topk_logprobs,
)
from vocab_parallel_cases import assert_close, rank_size  # noqa: E402

CASES = Cases()
VOCAB = 37


def ceil_split(vocab: int, rank: int, tp: int, total: int | None = None) -> tuple[int, int]:
    """torchtitan's split: ``ceil(total / tp)`` columns per rank, the last one shorter.
    ``total`` (default ``vocab``) may exceed ``vocab``: the columns past it are padding."""
    per = math.ceil((total or vocab) / tp)
    start = min(rank * per, total or vocab)
    return start, min(per, (total or vocab) - start)


def _problem(group, *, total=None, tokens=(3, 5), scale=3.0, dtype=torch.float32):
    rank, tp = rank_size(group)
    columns = total or VOCAB
    full = (torch.randn(*tokens, columns, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, VOCAB, tokens)
    target.view(-1)[1] = -100
    start, width = ceil_split(VOCAB, rank, tp, total)
    if width == 0:
        raise Skip(f"tp={tp} leaves a rank with no columns of {columns}")
    shard = full[..., start:start + width].clone().requires_grad_()
    return full, shard, target, start, width


@CASES.register
def stats_and_gradients_match_the_reference(group):
    for total in (None, VOCAB + 4):  # no padding (torchtitan), and padding in the last shard
        full, shard, target, start, width = _problem(group, total=total)
        options = dict(temperature=0.7, label_smoothing=0.1)
        st = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=VOCAB,
                                  vocab_start=start, chunk_size=4, **options)
        leaf = full.double().detach().requires_grad_()
        lp, ent, lse = reference_stats(leaf, target, vocab_size=VOCAB, **options)
        w = torch.linspace(0.5, 1.5, target.numel()).view(target.shape)
        (lp * w + ent * (w - 1)).sum().backward()
        (st.logprobs * w + st.entropy * (w - 1)).sum().backward()
        for name, a, b in (("logprobs", st.logprobs, lp), ("entropy", st.entropy, ent),
                           ("logsumexp", st.logsumexp, lse)):
            assert_close(a, b.detach(), rtol=1e-5, atol=1e-5, what=name)
        assert_close(shard.grad, leaf.grad[..., start:start + width], rtol=1e-5, atol=1e-6,
                     what="logits gradient")


@CASES.register
def topk_ops_match_the_reference(group):
    full, shard, target, start, width = _problem(group)
    k = 5  # wider than the last shard at tp = 3 only for small splits: tested with k = 12 too
    for k in (5, 12):
        top = vocab_parallel_topk(shard, k, tp_group=group, vocab_size=VOCAB, vocab_start=start)
        ref_lp, ref_ids = reference_topk(full, k, vocab_size=VOCAB)
        assert torch.equal(top.indices, ref_ids), (top.indices, ref_ids)
        assert_close(top.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="topk logprobs")
        raw = vocab_parallel_topk_logits(shard, k, tp_group=group, vocab_size=VOCAB,
                                         vocab_start=start)
        assert torch.equal(raw.indices, ref_ids)
        assert torch.equal(raw.logits, full.gather(-1, ref_ids)), "raw top-k logits"
    ids = torch.randint(0, VOCAB, (*target.shape, 4))
    picked = vocab_parallel_gather_logits(shard, ids, tp_group=group, vocab_size=VOCAB,
                                          vocab_start=start)
    assert torch.equal(picked, full.gather(-1, ids)), "gathered logits"
    picked.sum().backward()
    expected = torch.zeros_like(full).scatter_add_(-1, ids, torch.ones(ids.shape))
    assert torch.equal(shard.grad, expected[..., start:start + width]), "gather gradient"
    shard.grad = None
    lp = vocab_parallel_topk_logprobs(shard, ids, tp_group=group, vocab_size=VOCAB,
                                      vocab_start=start)
    leaf = full.double().detach().requires_grad_()
    ref = torch.log_softmax(leaf, -1).gather(-1, ids)
    assert_close(lp, ref.detach(), rtol=1e-5, atol=1e-5, what="logprobs at ids")
    lp.sum().backward()
    ref.sum().backward()
    assert_close(shard.grad, leaf.grad[..., start:start + width], rtol=1e-5, atol=1e-6,
                 what="logprobs-at-ids gradient")


@CASES.register
def fused_head_matches_the_reference(group):
    rank, tp = rank_size(group)
    hidden = torch.randn(7, 16, dtype=torch.float64)
    weight = torch.randn(VOCAB, 16, dtype=torch.float64) * 0.5
    target = torch.randint(0, VOCAB, (7,))
    start, width = ceil_split(VOCAB, rank, tp)
    h = hidden.float().clone().requires_grad_()
    w = weight[start:start + width].float().clone().requires_grad_()
    st = linear_vocab_parallel_stats(h, w, target, tp_group=group, vocab_size=VOCAB,
                                     vocab_start=start, chunk_size=3, label_smoothing=0.05)
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, _ = reference_stats(h64 @ w64.T, target, label_smoothing=0.05)
    (lp + ent).sum().backward()
    (st.logprobs + st.entropy).sum().backward()
    assert_close(st.logprobs, lp.detach(), rtol=1e-5, atol=1e-5, what="fused logprobs")
    assert_close(h.grad, h64.grad, rtol=1e-4, atol=1e-5, what="fused dX")
    assert_close(w.grad, w64.grad[start:start + width], rtol=1e-4, atol=1e-5, what="fused dW")


def _expect(fn, fragment):
    try:
        fn()
    except ValueError as exc:
        assert fragment in str(exc), str(exc)
        return
    raise AssertionError(f"no error (expected {fragment!r})")


@CASES.register
def bad_ranges_raise_on_every_rank(group):
    rank, tp = needs_tp2(group)
    _, shard, target, start, _ = _problem(group)
    last = rank == tp - 1
    call = vocab_parallel_stats
    _expect(lambda: call(shard, target, tp_group=group, vocab_size=VOCAB,
                         vocab_start=start + last), "vocab_start: the shards must cover")
    _expect(lambda: call(shard, target, tp_group=group, vocab_size=VOCAB + 10,
                         vocab_start=start), "vocab_size=47")
    _expect(lambda: call(shard, target, tp_group=group, vocab_size=VOCAB,
                         vocab_start=None if last else start),
            "rejected their inputs" if not last else "vocab_start")
    _expect(lambda: call(shard, target, tp_group=group, vocab_size=VOCAB, vocab_start=start,
                         batch_invariant="tp"), "batch_invariant='tp' needs equal shards")


if __name__ == "__main__":
    main(CASES)
