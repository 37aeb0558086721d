"""Multi-process cases for the vocab-parallel op; run by tests/unit/test_vocab_parallel_dist.py.

Every rank builds the same full logits from the same seed, keeps its own vocabulary shard, and
compares with the float64 single-process reference on the full vocabulary.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main, needs_tp2  # noqa: E402

from _reference import reference_stats  # noqa: E402
from megatron_vocabstats import (  # noqa: E402
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)
from megatron_vocabstats.ops import _comm  # noqa: E402
from megatron_vocabstats.profiling import count_collectives, peak_memory_bytes  # noqa: E402

CASES = Cases()
def rank_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def padded_width(vocab, tp):
    return -(-vocab // tp)


def make_case(group, *, tokens=(3, 7), vocab=101, dtype=torch.float32, scale=3.0, target_ranks=None,
              ignore_first=True):
    """Same full logits on every rank; returns (full padded logits, this rank's shard leaf, target)."""
    rank, tp = rank_size(group)
    width = padded_width(vocab, tp)
    full = (torch.randn(*tokens, width * tp, dtype=torch.float64) * scale).to(dtype)
    if target_ranks is None:
        target = torch.randint(0, vocab, tokens)
    else:
        owner = torch.tensor(target_ranks)[torch.randint(0, len(target_ranks), tokens)]
        target = owner * width + torch.randint(0, width, tokens)
        target = target.clamp(max=vocab - 1)
    if ignore_first:
        target.view(-1)[0] = -100
    shard = full[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    return full, shard, target


def reference_grads(full, target, vocab, weights_lp, weights_h, **kw):
    leaf = full.double().detach().requires_grad_()
    lp, ent, lse = reference_stats(leaf, target, vocab_size=vocab, **kw)
    (lp * weights_lp + ent * weights_h).sum().backward()
    return lp.detach(), ent.detach(), lse.detach(), leaf.grad


def my_columns(grad_full, group, width):
    rank, _ = rank_size(group)
    return grad_full[..., rank * width:(rank + 1) * width]


def assert_close(actual, expected, *, rtol, atol, what):
    err = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3g} over bound"


def check_against_reference(group, dtype, *, rtol, atol, grad_rtol, grad_atol, **options):
    vocab = 101
    full, shard, target = make_case(group, vocab=vocab, dtype=dtype)
    w_lp = torch.arange(target.numel(), dtype=torch.float64).view(target.shape) * 0.1 + 0.5
    w_h = torch.linspace(-1, 1, target.numel(), dtype=torch.float64).view(target.shape)
    st = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=vocab, chunk_size=4,
                              entropy="grad", **options)
    (st.logprobs * w_lp.float() + st.entropy * w_h.float()).sum().backward()
    ref_lp, ref_h, ref_lse, ref_grad = reference_grads(full, target, vocab, w_lp, w_h, **options)
    assert_close(st.logprobs, ref_lp, rtol=rtol, atol=atol, what="logprobs")
    assert_close(st.entropy, ref_h, rtol=rtol, atol=atol, what="entropy")
    assert_close(st.logsumexp, ref_lse, rtol=rtol, atol=atol, what="logsumexp")
    width = shard.shape[-1]
    assert_close(shard.grad, my_columns(ref_grad, group, width), rtol=grad_rtol, atol=grad_atol,
                 what="gradient")


@CASES.register
def fp32_matches_float64(group):
    check_against_reference(group, torch.float32, rtol=1e-5, atol=1e-5, grad_rtol=1e-5,
                            grad_atol=1e-6)


@CASES.register
def fp32_temperature_and_label_smoothing(group):
    check_against_reference(group, torch.float32, rtol=1e-5, atol=1e-5, grad_rtol=1e-5,
                            grad_atol=1e-6, temperature=0.7, label_smoothing=0.1)


@CASES.register
def bf16_matches_float64(group):
    # Values: 2e-2 absolute (numerics.md); gradients: one bf16 rounding of the fp32 result.
    check_against_reference(group, torch.bfloat16, rtol=2e-2, atol=2e-2, grad_rtol=2 ** -8,
                            grad_atol=1e-6)


@CASES.register
def fp16_matches_float64(group):
    check_against_reference(group, torch.float16, rtol=1e-3, atol=1e-3, grad_rtol=2 ** -10,
                            grad_atol=1e-7)


def _targets_on(group, owner_rank):
    vocab = 101
    full, shard, target = make_case(group, vocab=vocab, target_ranks=[owner_rank])
    st = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=vocab, chunk_size=5)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    ones = torch.ones(target.shape, dtype=torch.float64)
    ref_lp, ref_h, _, ref_grad = reference_grads(full, target, vocab, ones, ones)
    assert_close(st.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="logprobs")
    assert_close(st.entropy, ref_h, rtol=1e-5, atol=1e-5, what="entropy")
    assert_close(shard.grad, my_columns(ref_grad, group, shard.shape[-1]), rtol=1e-5, atol=1e-6,
                 what="gradient")


@CASES.register
def all_targets_on_first_rank(group):
    _targets_on(group, 0)


@CASES.register
def all_targets_on_last_rank(group):
    _targets_on(group, rank_size(group)[1] - 1)


@CASES.register
def tp2_v8_gradient_is_softmax_minus_onehot(group):
    rank, tp = rank_size(group)
    if tp != 2:
        raise Skip("needs tp=2")
    full = torch.randn(6, 8)
    target = torch.randint(0, 4, (6,))  # every target on rank 0
    shard = full[:, rank * 4:(rank + 1) * 4].clone().requires_grad_()
    vocab_parallel_cross_entropy(shard, target, tp_group=group).sum().backward()
    expected = torch.softmax(full.double(), -1) - torch.nn.functional.one_hot(target, 8).double()
    err = (shard.grad.double() - expected[:, rank * 4:(rank + 1) * 4]).abs().max().item()
    assert err <= 1e-6, f"rank {rank}: gradient off by {err}"


@CASES.register
def odd_shard_width_targets_on_other_rank(group):
    rank, tp = needs_tp2(group)
    width, tokens = 97, 13  # a prime width: no internal tile divides it
    full = torch.randn(tokens, width * tp) * 4
    target = (tp - 1) * width + torch.randint(0, width, (tokens,))  # all on the last rank
    shard = full[:, rank * width:(rank + 1) * width].clone()
    loss = vocab_parallel_cross_entropy(shard, target, tp_group=group, chunk_size=3)
    dense = torch.nn.functional.cross_entropy(full.double(), target, reduction="none")
    assert torch.isfinite(loss).all()
    assert (loss.double() - dense).abs().max().item() <= 1e-5


@CASES.register
def chunked_equals_unchunked_bitwise(group):
    vocab = 101
    for tokens in ((17,), (1,)):
        full, shard, target = make_case(group, tokens=tokens, vocab=vocab, dtype=torch.bfloat16)
        results = []
        for chunk in (5, 17, 1):
            leaf = shard.detach().clone().requires_grad_()
            st = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=vocab,
                                      chunk_size=chunk)
            (st.logprobs * 1.5 + st.entropy * 0.25).sum().backward()
            results.append((st.logprobs, st.entropy, st.logsumexp, leaf.grad))
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert torch.equal(a, b), f"chunk size changed a result for tokens={tokens}"


@CASES.register
def ranks_agree_bitwise(group):
    _, shard, target = make_case(group, vocab=101)
    st = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=101, chunk_size=4,
                              argmax=True)
    for t in st:
        table = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(table, t.contiguous(), group=group)
        assert all(torch.equal(table[0], x) for x in table), "ranks returned different statistics"


@CASES.register
def collective_budget(group):
    _, tp = rank_size(group)
    _, shard, target = make_case(group, tokens=(3, 7), vocab=101)
    for chunk in (1, 3, 21):
        for validate, budget in ((True, 2), (False, 1)):
            leaf = shard.detach().clone().requires_grad_()
            with count_collectives() as fwd:
                st = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=101,
                                          chunk_size=chunk, validate=validate, label_smoothing=0.1)
            with count_collectives() as bwd:
                (st.logprobs.sum() + st.entropy.sum()).backward()
            expected = budget if tp > 1 else 0
            assert len(fwd) == expected, f"chunk {chunk}: forward made {fwd}"
            assert bwd == [], f"backward made collectives {bwd}"


@CASES.register
def peak_memory_within_bound(group):
    # Fails if the op gathers the vocabulary (+ the other shards) or upcasts the shard (+2x bf16).
    rank, tp = rank_size(group)
    tokens, width, chunk = 512, 2048, 32
    # (each rank its own shard: the same one on every rank is refused as a wrong group)
    shard = torch.randn(tokens, width, generator=torch.Generator().manual_seed(rank))
    shard = shard.to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, width * tp, (tokens,))
    weight = torch.rand(tokens)

    def step():
        st = vocab_parallel_stats(shard, target, tp_group=group, chunk_size=chunk)
        (st.logprobs * weight + st.entropy).sum().backward()

    shard_bytes = shard.numel() * shard.element_size()
    bound = 1.05 * (2 * shard_bytes + 2 * chunk * width * 4 + 64 * tp * tokens * 4)
    peak = peak_memory_bytes(step, shard, target, weight)
    assert peak <= bound, f"peak {peak} B exceeds bound {bound:.0f} B ({peak / shard_bytes:.2f}x shard)"


@CASES.register
def mismatched_shard_widths_raise_everywhere(group):
    rank, tp = needs_tp2(group)
    width = 16 if rank == 0 else 17  # vocab_size=16*tp-1 fits either width: only the width differs
    logits = torch.randn(5, width)
    target = torch.zeros(5, dtype=torch.long)
    try:
        vocab_parallel_stats(logits, target, tp_group=group, vocab_size=16 * tp - 1)
    except ValueError as exc:
        assert "logits shard width differs" in str(exc), str(exc)
    else:
        raise AssertionError("mismatched shard widths were accepted")


@CASES.register
def mismatched_options_raise_everywhere(group):
    rank, tp = needs_tp2(group)
    logits, target = torch.randn(5, 16), torch.zeros(5, dtype=torch.long)
    for option, mine in (("temperature", 1.0 + rank), ("label_smoothing", 0.1 * rank)):
        try:
            vocab_parallel_stats(logits, target, tp_group=group, **{option: mine})
        except ValueError as exc:
            assert f"{option} differs" in str(exc), str(exc)
        else:
            raise AssertionError(f"{option} that differs across ranks was accepted")


@CASES.register
def mismatched_targets_raise_everywhere(group):
    rank, tp = needs_tp2(group)
    logits = torch.randn(5, 16)
    target = torch.full((5,), rank, dtype=torch.long)
    try:
        vocab_parallel_stats(logits, target, tp_group=group)
    except ValueError as exc:
        assert "target" in str(exc), str(exc)
    else:
        raise AssertionError("targets that differ across ranks were accepted")


@CASES.register
def out_of_range_target_on_one_rank_raises_everywhere(group):
    rank, tp = needs_tp2(group)
    logits = torch.randn(5, 16)
    target = torch.zeros(5, dtype=torch.long)
    if rank == tp - 1:
        target[2] = 16 * tp
    try:
        vocab_parallel_stats(logits, target, tp_group=group)
    except ValueError as exc:
        assert "target" in str(exc) or "rejected" in str(exc), str(exc)
    else:
        raise AssertionError("an out-of-range target was accepted")


@CASES.register
def replicated_full_vocab_is_rejected(group):
    _, tp = needs_tp2(group)
    try:
        vocab_parallel_stats(torch.randn(4, 50), torch.zeros(4, dtype=torch.long),
                             tp_group=group, vocab_size=50)
    except ValueError as exc:
        assert "tp_group holds the same" in str(exc) and "replicated" in str(exc), str(exc)
    else:
        raise AssertionError("full logits passed as a shard were accepted")


@CASES.register
def padding_filling_whole_shards(group):
    # Megatron pads a small vocabulary to a multiple of 128 * tp: V=100 on tp=2 gives 256 columns,
    # so rank 1's shard is all padding and rank 0's is as wide as the real vocabulary.
    rank, tp = rank_size(group)
    vocab, width = 7, 8
    full = torch.randn(6, width * tp, dtype=torch.float64) * 2
    target = torch.randint(0, vocab, (6,))
    shard = full[:, rank * width:(rank + 1) * width].float().requires_grad_()
    st = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=vocab)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    ones = torch.ones(6, dtype=torch.float64)
    ref_lp, ref_h, _, ref_grad = reference_grads(full, target, vocab, ones, ones)
    assert_close(st.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="logprobs")
    assert_close(st.entropy, ref_h, rtol=1e-5, atol=1e-5, what="entropy")
    assert_close(shard.grad, my_columns(ref_grad, group, width), rtol=1e-5, atol=1e-6,
                 what="gradient")


@CASES.register
def wrappers_match_stats(group):
    _, shard, target = make_case(group, vocab=101)
    st = vocab_parallel_stats(shard, target, tp_group=group, vocab_size=101, entropy="metric")
    lp = vocab_parallel_logprobs(shard, target, tp_group=group, vocab_size=101)
    ent = vocab_parallel_entropy(shard, tp_group=group, vocab_size=101)
    ce = vocab_parallel_cross_entropy(shard, target, tp_group=group, vocab_size=101)
    assert torch.equal(lp, st.logprobs) and torch.equal(ce, -st.logprobs)
    valid = target != -100
    assert torch.equal(ent[valid], st.entropy[valid])
    assert math.isfinite(ent.sum().item())


@CASES.register
def gather_stats_uses_one_collective(group):
    _, tp = rank_size(group)
    local = torch.randn(5, 9)
    with count_collectives() as calls:
        gathered = _comm.gather_stats(local, group)
    assert gathered.shape == (tp, 5, 9)
    assert len(calls) == (1 if tp > 1 else 0)


if __name__ == "__main__":
    main(CASES)
