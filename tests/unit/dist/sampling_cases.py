"""Sampler log-probs under tensor parallelism (gloo); run by tests/unit/test_sampling_dist.py at
tp 1, 2 and 4: every rank keeps its shard of the same full logits and compares with the dense
float64 reference and with the single-process op on the full logits."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2  # noqa: E402

from _reference import reference_sampling  # noqa: E402
from megatron_vocabstats import (  # noqa: E402
    linear_vocab_parallel_sampling_logprobs,
    vocab_parallel_sampling_logprobs,
)
from megatron_vocabstats.profiling import count_collectives  # noqa: E402
from uneven_cases import ceil_split  # noqa: E402
from vocab_parallel_cases import assert_close, rank_size  # noqa: E402

CASES = Cases()
VOCAB, WIDTH = 61, 16  # padded to 16 * tp columns
FILTERS = [dict(top_k=6), dict(top_p=0.85), dict(min_p=0.05),
           dict(top_k=9, top_p=0.9, min_p=0.02, temperature=0.8)]


def _problem(group, dtype=torch.float32):
    rank, tp = rank_size(group)
    width = 64 // tp
    full = (torch.randn(3, 5, width * tp) * 2.5).to(dtype)
    target = torch.randint(0, VOCAB, (3, 5))
    target[0, 0] = full[0, 0, :VOCAB].float().argmax()
    target[1, 1] = -100
    shard = full[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    return full, shard, target, rank * width, width


@CASES.register
def matches_the_reference_and_one_process(group):
    for dtype in (torch.float32, torch.bfloat16):
        for kw in FILTERS:
            full, shard, target, start, width = _problem(group, dtype)
            out = vocab_parallel_sampling_logprobs(shard, target, tp_group=group,
                                                   vocab_size=VOCAB, chunk_size=2, **kw)
            single = vocab_parallel_sampling_logprobs(full, target, vocab_size=VOCAB, **kw)
            valid = target != -100
            ref, _ = reference_sampling(full, torch.where(valid, target, 0), vocab_size=VOCAB,
                                        **kw)
            ref = torch.where(valid, ref, 0.0)
            finite = torch.isfinite(ref)
            assert torch.equal(out.outside, ~finite), (kw, out.outside, ref)
            assert torch.equal(torch.isfinite(single.logprobs), finite), kw
            assert_close(out.logprobs[finite], ref[finite], rtol=1e-5, atol=1e-5,
                         what=f"logprobs {kw}")
            # The same kept sets; values equal across tp sizes up to the float64 mass sums.
            assert_close(out.logprobs[finite], single.logprobs[finite], rtol=1e-6, atol=1e-6,
                         what=f"tp vs one process {kw}")
            out.logprobs.masked_fill(~finite, 0).sum().backward()
            leaf = full.double().requires_grad_()
            r, _ = reference_sampling(leaf, torch.where(valid, target, 0), vocab_size=VOCAB,
                                      **kw)
            torch.where(valid & finite, r, 0.0).sum().backward()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert_close(shard.grad, leaf.grad[..., start:start + width], rtol=tol, atol=tol,
                         what=f"gradient {kw}")


@CASES.register
def uneven_shards(group):
    rank, tp = rank_size(group)
    full = torch.randn(4, VOCAB) * 2
    target = torch.randint(0, VOCAB, (4,))
    start, width = ceil_split(VOCAB, rank, tp)
    out = vocab_parallel_sampling_logprobs(full[:, start:start + width], target, tp_group=group,
                                           vocab_size=VOCAB, vocab_start=start, top_k=8,
                                           top_p=0.9)
    ref, _ = reference_sampling(full, target, top_k=8, top_p=0.9)
    finite = torch.isfinite(ref)
    assert torch.equal(out.outside, ~finite)
    assert_close(out.logprobs[finite], ref[finite], rtol=1e-5, atol=1e-5, what="uneven")


@CASES.register
def a_tie_across_shards_splits_as_vllm(group):
    # Ten columns spread over every shard share the second largest value; top-p keeps the
    # highest ids of the tie (vLLM's stable ascending sort drops the lowest first), so the
    # split falls inside some rank's shard and the ranks above keep all of theirs.
    rank, tp = rank_size(group)
    width = 64 // tp
    tied = [2, 9, 15, 22, 30, 33, 41, 47, 52, 60]
    full = torch.full((len(tied) + 2, 64), -3.0)
    full[:, 11] = 1.5
    full[:, tied] = 0.5
    target = torch.tensor([*tied, 11, 12])
    shard = full[:, rank * width:(rank + 1) * width]
    for top_p in (0.3, 0.5, 0.62, 0.8, 0.97):
        leaf = shard.clone().requires_grad_()
        out = vocab_parallel_sampling_logprobs(leaf, target, tp_group=group, vocab_size=VOCAB,
                                               chunk_size=5, top_p=top_p)
        ref_leaf = full.double().requires_grad_()
        ref, keep = reference_sampling(ref_leaf, target, vocab_size=VOCAB, top_p=top_p)
        finite = torch.isfinite(ref)
        assert torch.equal(out.outside, ~finite), (top_p, out.outside, keep[0, tied])
        assert_close(out.logprobs[finite], ref.detach()[finite], rtol=1e-5, atol=1e-5,
                     what=f"tied logprobs top_p={top_p}")
        out.logprobs.masked_fill(out.outside, 0).sum().backward()
        torch.where(finite, ref, 0.0).sum().backward()
        assert_close(leaf.grad, ref_leaf.grad[:, rank * width:(rank + 1) * width], rtol=1e-5,
                     atol=1e-5, what=f"tied gradient top_p={top_p}")


@CASES.register
def bounded_collectives_and_none_in_backward(group):
    _, tp = needs_tp2(group)
    full, shard, target, _, _ = _problem(group)
    with count_collectives() as fwd:
        out = vocab_parallel_sampling_logprobs(shard, target, tp_group=group, vocab_size=VOCAB,
                                               top_k=5, top_p=0.9, validate=False)
    with count_collectives() as bwd:
        out.logprobs.masked_fill(out.outside, 0).sum().backward()
    # maxima and target logits, 6 radix steps each for top-k and top-p, the kept mass
    assert len(fwd) == 1 + 6 + 6 + 1, fwd
    assert len(bwd) == 0, bwd


@CASES.register
def filters_differing_across_ranks_raise_everywhere(group):
    rank, tp = needs_tp2(group)
    _, shard, target, _, _ = _problem(group)
    for kw, message in ((dict(top_k=4 + rank), "top_k differs"),
                        (dict(top_p=0.5 + 0.25 * (rank % 2)), "top_p differs"),
                        (dict(min_p=None if rank else 0.1), "min_p differs"),
                        (dict(top_p=0.0 if rank == tp - 1 else 0.9),
                         "top_p must be" if rank == tp - 1 else "rejected their inputs")):
        try:
            vocab_parallel_sampling_logprobs(shard, target, tp_group=group, vocab_size=VOCAB,
                                             **kw)
        except ValueError as exc:
            assert message in str(exc), str(exc)
        else:
            raise AssertionError(f"no error for {kw}")



@CASES.register
def fused_head_with_and_without_sequence_parallel(group):
    rank, tp = rank_size(group)
    width = 64 // tp
    hidden, weight = torch.randn(4 * tp, 2, 16), torch.randn(64, 16) * 0.6
    target = torch.randint(0, VOCAB, (4 * tp, 2))
    kw = dict(top_k=6, top_p=0.9, temperature=0.9)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref, _ = reference_sampling(h64 @ w64.T, target, vocab_size=VOCAB, **kw)
    finite = torch.isfinite(ref)
    torch.where(finite, ref, 0.0).sum().backward()
    for sp in (False, True) if tp > 1 else (False,):
        rows = slice(rank * 4, (rank + 1) * 4) if sp else slice(None)
        h = hidden[rows].clone().requires_grad_()
        w = weight[rank * width:(rank + 1) * width].clone().requires_grad_()
        out = linear_vocab_parallel_sampling_logprobs(h, w, target, tp_group=group,
                                                      sequence_parallel=sp, vocab_size=VOCAB,
                                                      chunk_size=3, **kw)
        assert torch.equal(out.outside, ~finite), (sp, out.outside, ref)
        assert_close(out.logprobs[finite], ref[finite], rtol=1e-5, atol=1e-5, what=f"sp={sp}")
        out.logprobs.masked_fill(out.outside, 0).sum().backward()
        assert_close(h.grad, h64.grad[rows], rtol=1e-4, atol=1e-5, what=f"dX sp={sp}")
        assert_close(w.grad, w64.grad[rank * width:(rank + 1) * width], rtol=1e-4, atol=1e-5,
                     what=f"dW sp={sp}")


if __name__ == "__main__":
    main(CASES)
