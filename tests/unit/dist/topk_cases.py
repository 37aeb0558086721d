"""Multi-process cases for the top-k ops and the distillation loss; run by test_topk_dist.py.

Every rank builds the same full logits from the same seed, keeps its own vocabulary shard, and
compares with a float64 single-process reference on the full vocabulary.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2  # noqa: E402

from megatron_vocabstats import (  # noqa: E402
    TopK,
    distillation_loss,
    linear_vocab_parallel_topk,
    linear_vocab_parallel_topk_logprobs,
    vocab_parallel_topk,
    vocab_parallel_topk_logprobs,
)
from megatron_vocabstats.profiling import count_collectives  # noqa: E402
from test_distill import reference_divergence  # noqa: E402
from test_topk import reference_topk  # noqa: E402
from vocab_parallel_cases import assert_close as close  # noqa: E402
from vocab_parallel_cases import rank_size  # noqa: E402

CASES = Cases()
VOCAB = 101


def shard_of(full, group):
    rank, tp = rank_size(group)
    width = full.shape[-1] // tp
    return full[..., rank * width:(rank + 1) * width]


def full_logits(group, *, tokens=(3, 5), vocab=VOCAB, dtype=torch.float32, scale=3.0):
    _, tp = rank_size(group)
    width = -(-vocab // tp)
    return (torch.randn(*tokens, width * tp, dtype=torch.float64) * scale).to(dtype)


def expect_error(fn, *fragments):
    try:
        fn()
    except ValueError as exc:
        assert any(f in str(exc) for f in fragments), str(exc)
    else:
        raise AssertionError(f"no ValueError (expected one of {fragments})")


@CASES.register
def topk_matches_float64(group):
    for dtype, temperature in ((torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.0)):
        full = full_logits(group, dtype=dtype)
        top = vocab_parallel_topk(shard_of(full, group), 7, tp_group=group, vocab_size=VOCAB,
                                  temperature=temperature, chunk_size=4)
        ref_lp, ref_ids = reference_topk(full, 7, VOCAB, temperature)
        assert torch.equal(top.indices, ref_ids), f"{dtype} ids differ"
        close(top.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what=f"{dtype} top-k logprobs")


@CASES.register
def ties_across_shards_take_lowest_ids(group):
    _, tp = rank_size(group)
    width = 8
    full = torch.zeros(2, width * tp)
    full[0] = 1.0  # every column ties: ids 0..k-1 whatever the sharding
    last = width * tp - 1
    tied = sorted({c for c in (last, last - width, 3) if c >= 0})  # spread over the shards
    full[1, tied] = 5.0
    top = vocab_parallel_topk(shard_of(full, group), 3, tp_group=group)
    assert top.indices[0].tolist() == [0, 1, 2], top.indices[0].tolist()
    assert top.indices[1, :len(tied)].tolist() == tied, top.indices[1].tolist()


@CASES.register
def kth_place_tie_cut_across_shards(group):
    # More tied values than places left, spread over the shards: the cut at the k-th place keeps
    # the lowest ids whatever shard they sit on; -0.0 and +0.0 tie too.
    _, tp = rank_size(group)
    width = 6
    full = torch.randn(3, width * tp).clamp(max=1.0)
    top_col = width * tp - 2  # the strict maximum, on the last shard
    full[0, top_col] = 9.0
    tied = [c for c in (width * tp - 1, 2 * width + 1, width, width - 1, 1, 3 * width + 2)
            if c < width * tp and c != top_col]
    full[0, tied] = 4.0
    k = 1 + len(tied) - 1  # one tied id misses out
    full[1] = torch.where(torch.arange(width * tp) % 2 == 0, 0.0, -0.0)  # signed zeros only
    full[2, :] = -5.0
    full[2, [width * tp - 1, 0]] = 0.0
    full[2, width - 1] = -0.0
    top = vocab_parallel_topk(shard_of(full, group), k, tp_group=group)
    assert top.indices[0].tolist() == [top_col, *sorted(tied)[:k - 1]], top.indices[0].tolist()
    assert top.indices[1].tolist() == list(range(k)), top.indices[1].tolist()
    want = sorted({0, width - 1, width * tp - 1})
    assert top.indices[2, :len(want)].tolist() == want, top.indices[2].tolist()
    ref_lp, ref_ids = reference_topk(full, k, width * tp)
    assert torch.equal(top.indices, ref_ids)
    close(top.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="tied logprobs")


@CASES.register
def padding_filling_whole_shards_never_selected(group):
    _, tp = rank_size(group)
    vocab, width = 5, 8  # rank >= 1 holds only padding
    full = torch.randn(4, width * tp) * 2
    full[:, vocab:] = 100.0
    top = vocab_parallel_topk(shard_of(full, group), 5, tp_group=group, vocab_size=vocab)
    ref_lp, ref_ids = reference_topk(full, 5, vocab)
    assert torch.equal(top.indices, ref_ids)
    close(top.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="logprobs")


def _logprobs_against_reference(group, dtype, *, rtol, atol, grad_rtol, grad_atol):
    full = full_logits(group, dtype=dtype)
    indices = torch.randint(0, VOCAB, (3, 5, 6))
    indices[0, 0] = 0  # padded row: k copies of id 0, masked
    indices[1, 1, :3] = indices[1, 1, 3]  # duplicates at a counted row
    mask = torch.ones(3, 5)
    mask[0, 0] = 0
    g = torch.randn(3, 5, 6)
    leaf = shard_of(full, group).clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, indices, tp_group=group, mask=mask, vocab_size=VOCAB,
                                      temperature=0.8, chunk_size=4)
    (lp * g).sum().backward()
    ref_leaf = full.double().requires_grad_()
    ref = torch.log_softmax(ref_leaf[..., :VOCAB] / 0.8, -1).gather(-1, indices)
    ref = torch.where(mask[..., None] != 0, ref, 0.0)
    (ref * g.double()).sum().backward()
    close(lp, ref, rtol=rtol, atol=atol, what="logprobs")
    close(leaf.grad, shard_of(ref_leaf.grad, group), rtol=grad_rtol, atol=grad_atol, what="grad")
    assert bool((leaf.grad[0, 0] == 0).all())


@CASES.register
def topk_logprobs_fp32_matches_float64(group):
    _logprobs_against_reference(group, torch.float32, rtol=1e-5, atol=1e-5, grad_rtol=1e-5,
                                grad_atol=1e-6)


@CASES.register
def topk_logprobs_bf16_matches_float64(group):
    _logprobs_against_reference(group, torch.bfloat16, rtol=2e-2, atol=2e-2, grad_rtol=2**-8,
                                grad_atol=1e-6)


@CASES.register
def fused_equals_unfused(group):
    _, tp = rank_size(group)
    width, chunk = 26, 4
    hidden = torch.randn(2, 5, 16).to(torch.bfloat16)
    weight_full = (torch.randn(width * tp, 16) * 0.5).to(torch.bfloat16)
    weight = shard_of(weight_full.t(), group).t().contiguous()
    h2 = hidden.view(-1, 16)
    logits = torch.cat([h2[i:i + chunk] @ weight.t() for i in range(0, 10, chunk)]).view(2, 5, -1)
    vocab = width * tp - 3
    top = vocab_parallel_topk(logits, 4, tp_group=group, vocab_size=vocab)
    ftop = linear_vocab_parallel_topk(hidden, weight, 4, tp_group=group, vocab_size=vocab,
                                      chunk_size=chunk)
    assert torch.equal(top.indices, ftop.indices) and torch.equal(top.logprobs, ftop.logprobs)
    g = torch.randn(2, 5, 4)
    leaf = logits.clone().requires_grad_()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, top.indices, tp_group=group, vocab_size=vocab)
    lp_f = linear_vocab_parallel_topk_logprobs(h, w, top.indices, tp_group=group,
                                               vocab_size=vocab, chunk_size=chunk)
    assert torch.equal(lp, lp_f)
    (lp * g).sum().backward()
    (lp_f * g).sum().backward()
    grad = leaf.grad.reshape(-1, width)
    dx = (grad.double() @ weight.double()).view(hidden.shape)
    dist.all_reduce(dx, group=group)
    # Each shard's dX is rounded to bf16, then summed over tp shards in bf16 (as Megatron).
    close(h.grad, dx, rtol=2**-7, atol=tp * 2**-8 * dx.abs().max().item(),
          what="dX (summed over shards)")
    close(w.grad, grad.t().double() @ h2.double(), rtol=2**-7, atol=1e-3, what="dW")


@CASES.register
def distillation_loss_matches_float64(group):
    teacher_full = full_logits(group, scale=2.0)
    student_full = full_logits(group, scale=2.0)
    teacher = vocab_parallel_topk(shard_of(teacher_full, group), 5, tp_group=group,
                                  vocab_size=VOCAB, temperature=0.9)
    mask = torch.rand(3, 5) > 0.3
    for divergence, beta, mode in (("forward_kl", 0.5, {}), ("reverse_kl", 0.5,
                                   {"tail_bucket": True}), ("jsd", 0.9, {"tail_bucket": True}),
                                   ("jsd", 0.1, {"renormalize": True})):
        leaf = shard_of(student_full, group).clone().requires_grad_()
        out = distillation_loss(leaf, teacher, mask, tp_group=group, vocab_size=VOCAB,
                                temperature=0.9, divergence=divergence, beta=beta, **mode)
        out.loss_sum.backward()
        ref_leaf = student_full.double().requires_grad_()
        lq = torch.log_softmax(ref_leaf[..., :VOCAB] / 0.9, -1).gather(-1, teacher.indices)
        ref = torch.where(mask, reference_divergence(lq, teacher.logprobs, divergence, beta,
                                                     **mode), 0.0).sum()
        ref.backward()
        assert abs(out.loss_sum.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item())), divergence
        close(leaf.grad, shard_of(ref_leaf.grad, group), rtol=1e-5, atol=1e-6, what=divergence)


@CASES.register
def student_equal_to_teacher_is_exactly_zero(group):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        shard = shard_of(full_logits(group, dtype=dtype), group)
        teacher = vocab_parallel_topk(shard, 6, tp_group=group, vocab_size=VOCAB)
        for divergence in ("forward_kl", "reverse_kl", "jsd"):
            out = distillation_loss(shard, teacher, torch.ones(3, 5), tp_group=group,
                                    vocab_size=VOCAB, divergence=divergence, tail_bucket=True)
            assert out.loss_sum.item() == 0.0, (dtype, divergence, out.loss_sum.item())


@CASES.register
def reverse_kl_minus_inf_teacher_at_masked_rows(group):
    shard = shard_of(full_logits(group), group)
    teacher = vocab_parallel_topk(shard, 4, tp_group=group, vocab_size=VOCAB)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    lp, idx = teacher.logprobs.clone(), teacher.indices.clone()
    lp[~mask], idx[~mask] = float("-inf"), 0
    leaf = shard.clone().requires_grad_()
    out = distillation_loss(leaf, TopK(lp, idx), mask, tp_group=group, vocab_size=VOCAB,
                            divergence="reverse_kl", tail_bucket=True)
    out.loss_sum.backward()
    assert math.isfinite(out.loss_sum.item()) and torch.isfinite(leaf.grad).all()
    assert bool((leaf.grad[~mask] == 0).all())


@CASES.register
def collective_budget(group):
    rank, tp = rank_size(group)
    shard = shard_of(full_logits(group), group)
    # validate: one int64 all-gather for the core checks and the k/mask/indices agreement.
    for validate in (False, True):
        with count_collectives() as calls:
            top = vocab_parallel_topk(shard, 5, tp_group=group, vocab_size=VOCAB,
                                      validate=validate)
        assert len(calls) == (1 + validate if tp > 1 else 0), calls
        leaf = shard.clone().requires_grad_()
        with count_collectives() as fwd:
            lp = vocab_parallel_topk_logprobs(leaf, top.indices, tp_group=group,
                                              vocab_size=VOCAB, validate=validate)
        with count_collectives() as bwd:
            lp.sum().backward()
        assert len(fwd) == (1 + validate if tp > 1 else 0) and bwd == [], (fwd, bwd)
        # (each rank its own weight shard: the same one everywhere is a wrong group)
        hidden, weight = torch.randn(3, 5, 8), torch.randn(shard.shape[-1], 8) + rank
        with count_collectives() as fused:
            linear_vocab_parallel_topk(hidden, weight, 5, tp_group=group, vocab_size=VOCAB,
                                       validate=validate)
            linear_vocab_parallel_topk_logprobs(hidden, weight, top.indices, tp_group=group,
                                                vocab_size=VOCAB, validate=validate)
        assert len(fused) == (2 * (1 + validate) if tp > 1 else 0), fused


@CASES.register
def k_larger_than_vocab_raises_everywhere(group):
    shard = shard_of(full_logits(group), group)
    expect_error(lambda: vocab_parallel_topk(shard, VOCAB + 1, tp_group=group, vocab_size=VOCAB),
                 "k must be")


@CASES.register
def out_of_range_index_on_one_rank_raises_everywhere(group):
    rank, tp = needs_tp2(group)
    shard = shard_of(full_logits(group), group)
    indices = torch.zeros(3, 5, 2, dtype=torch.long)
    if rank == tp - 1:
        indices[1, 2, 1] = VOCAB
    expect_error(lambda: vocab_parallel_topk_logprobs(shard, indices, tp_group=group,
                                                      vocab_size=VOCAB),
                 "outside", "rejected")
    # (each rank its own weight shard: the same one everywhere is a wrong group)
    hidden, weight = torch.randn(3, 5, 8), torch.randn(shard.shape[-1], 8) + rank
    expect_error(lambda: linear_vocab_parallel_topk_logprobs(hidden, weight, indices,
                                                             tp_group=group, vocab_size=VOCAB),
                 "outside", "rejected")


@CASES.register
def vocab_mismatch_raises_everywhere(group):
    shard = shard_of(full_logits(group), group)
    teacher = vocab_parallel_topk(shard, 3, tp_group=group, vocab_size=VOCAB)
    expect_error(lambda: distillation_loss(shard, teacher, torch.ones(3, 5), tp_group=group,
                                           vocab_size=VOCAB, teacher_vocab_size=VOCAB + 27),
                 "teacher_vocab_size")
    big = TopK(teacher.logprobs, teacher.indices + VOCAB)
    expect_error(lambda: distillation_loss(shard, big, torch.ones(3, 5), tp_group=group,
                                           vocab_size=VOCAB, validate=True),
                 "outside", "rejected")


@CASES.register
def mismatched_k_mask_indices_raise_everywhere(group):
    # With validate, a k, mask or ids that differ on one rank raise on every rank, naming the
    # argument (a differing k would otherwise fail inside the gather; ids or masks would give
    # silently wrong sums).
    rank, tp = needs_tp2(group)
    last = rank == tp - 1
    shard = shard_of(full_logits(group), group)
    # (each rank its own weight shard: the same one everywhere is a wrong group)
    hidden, weight = torch.randn(3, 5, 8), torch.randn(shard.shape[-1], 8) + rank
    expect_error(lambda: vocab_parallel_topk(shard, 3 + last, tp_group=group, vocab_size=VOCAB),
                 "k differs")
    expect_error(lambda: linear_vocab_parallel_topk(hidden, weight, 3 + last, tp_group=group,
                                                    vocab_size=VOCAB), "k differs")
    indices = torch.randint(0, VOCAB, (3, 5, 4))  # the same on every rank (same seed)
    mask = torch.ones(3, 5)
    mask[2, 4] = 0
    wrong_ids = indices.clone()
    wrong_ids[1, 2, 0] = (wrong_ids[1, 2, 0] + last) % VOCAB
    wrong_mask = mask.clone()
    wrong_mask[0, 1] = 1 - last
    garbage = indices.clone()
    garbage[2, 4] = rank  # differs only at a masked row: allowed
    for ids, m, name in ((indices[..., :3 + last], mask, "k"), (wrong_ids, mask, "indices"),
                         (indices, wrong_mask, "mask")):
        expect_error(lambda: vocab_parallel_topk_logprobs(shard, ids, tp_group=group, mask=m,
                                                          vocab_size=VOCAB), f"{name} differs")
        expect_error(lambda: linear_vocab_parallel_topk_logprobs(
            hidden, weight, ids, tp_group=group, mask=m, vocab_size=VOCAB), f"{name} differs")
    for fn in (lambda: vocab_parallel_topk_logprobs(shard, garbage, tp_group=group, mask=mask,
                                                    vocab_size=VOCAB),
               lambda: linear_vocab_parallel_topk_logprobs(hidden, weight, garbage,
                                                           tp_group=group, mask=mask,
                                                           vocab_size=VOCAB)):
        assert bool((fn()[2, 4] == 0).all())
    teacher = TopK(torch.full((3, 5, 4), -2.0), indices)
    expect_error(lambda: distillation_loss(shard, teacher, wrong_mask, tp_group=group,
                                           vocab_size=VOCAB, validate=True), "mask differs")


@CASES.register
def fused_sequence_parallel_and_main_grad_equal_unfused(group):
    # Megatron's fused LM-head path: hidden is this rank's sequence shard [s/tp, b, H]
    # (gathered inside, dX reduce-scattered back), the weight gradient goes into main_grad.
    rank, tp = rank_size(group)
    seq, batch, size, width, chunk = 3 * tp, 2, 16, 24, 4
    vocab = width * tp - 2
    hidden_full = torch.randn(seq, batch, size).to(torch.bfloat16)
    weight_full = (torch.randn(width * tp, size) * 0.5).to(torch.bfloat16)
    weight = weight_full[rank * width:(rank + 1) * width].contiguous()
    rows = slice(rank * seq // tp, (rank + 1) * seq // tp)
    h2 = hidden_full.reshape(-1, size)
    logits = torch.cat([h2[i:i + chunk] @ weight.t() for i in range(0, h2.shape[0], chunk)])
    logits = logits.view(seq, batch, width)
    top = vocab_parallel_topk(logits, 4, tp_group=group, vocab_size=vocab)
    ftop = linear_vocab_parallel_topk(hidden_full[rows], weight, 4, tp_group=group,
                                      sequence_parallel=True, vocab_size=vocab, chunk_size=chunk)
    assert torch.equal(top.indices, ftop.indices) and torch.equal(top.logprobs, ftop.logprobs)

    mask = torch.ones(seq, batch)
    mask[0, 1] = 0
    g = torch.randn(seq, batch, 4)
    leaf = logits.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, top.indices, tp_group=group, mask=mask,
                                      vocab_size=vocab)
    (lp * g).sum().backward()
    grad = leaf.grad.reshape(-1, width).double()
    dx = (grad @ weight.double()).view(seq, batch, size)
    dist.all_reduce(dx, group=group)
    dw = grad.t() @ h2.double()
    for main_grad in (False, True):
        h = hidden_full[rows].clone().requires_grad_()
        w = weight.clone().requires_grad_()
        if main_grad:
            w.main_grad = torch.zeros(width, size)
        lp_f = linear_vocab_parallel_topk_logprobs(
            h, w, top.indices, tp_group=group, sequence_parallel=True, mask=mask,
            vocab_size=vocab, chunk_size=chunk, accumulate_into_main_grad=main_grad)
        assert torch.equal(lp, lp_f)
        (lp_f * g).sum().backward()
        close(h.grad, dx[rows], rtol=2**-7, atol=tp * 2**-8 * dx.abs().max().item(),
              what="dX (reduce-scattered)")
        got_dw = w.main_grad if main_grad else w.grad
        assert (w.grad is None) == main_grad
        close(got_dw, dw, rtol=2**-7, atol=1e-3, what=f"dW (main_grad={main_grad})")


if __name__ == "__main__":
    main(CASES)
