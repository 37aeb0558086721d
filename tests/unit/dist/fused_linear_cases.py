"""Multi-process cases for the fused LM head; run by tests/unit/test_fused_linear_dist.py.

Every rank builds the same full hidden states and full output weight from the same seed, keeps
its vocabulary shard of the weight (and, with sequence parallelism, its sequence shard of the
hidden states), and compares values and the gradients of hidden and of its weight shard with a
float64 single-process reference on the full vocabulary.

Reference semantics (the op's docstring): logits = hidden @ W.T rounded once to the model dtype;
the reference differentiates float64 statistics of those rounded logits, so its logits gradient
G gives dX = G @ W and dW = G.T @ hidden. Gradient bounds are elementwise and matmul-aware:
|error| <= rtol * (|G| @ |W|) (resp. |G|.T @ |hidden|) + atol, the standard bound of a product
whose factors carry a relative error rtol.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2
from _reference import reference_stats
from megatron_vocabstats import profiling
from megatron_vocabstats.ops import _comm
from megatron_vocabstats.ops.stats.from_hidden import (
    linear_vocab_parallel_cross_entropy,
    linear_vocab_parallel_stats,
)
from megatron_vocabstats.ops.stats.from_logits import vocab_parallel_stats

CASES = Cases()

# Values: numerics.md. Gradients: rtol on the matmul-aware scale. bf16/fp16: the logits gradient
# and dX/dW are each rounded once (2 x 2^-8 resp. 2 x 2^-11), and a logit may round one ulp away
# from the float64 product; fp32: numerics.md's 1e-5.
TOLERANCES = {
    torch.float32: dict(value=1e-5, grad=1e-5, atol=1e-6),
    torch.bfloat16: dict(value=2e-2, grad=2**-5, atol=1e-6),
    torch.float16: dict(value=1e-3, grad=2**-8, atol=1e-7),
}


def rank_size(group):
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def make_problem(tp, *, tokens=(5, 3), hidden_size=23, vocab=101, dtype=torch.float32, seed=0,
                 ignore=(0,)):
    """Full inputs, the same on every rank: hidden [*tokens, H], weight [W * tp, H], target.

    ``ignore``: flat positions whose target is ``-100``.
    """
    gen = torch.Generator().manual_seed(seed)
    width = -(-vocab // tp)
    hidden = torch.randn(*tokens, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(width * tp, hidden_size, generator=gen, dtype=torch.float64)
              * 2.5 / hidden_size**0.5).to(dtype)
    target = torch.randint(0, vocab, tokens, generator=gen)
    for i in ignore:
        target.view(-1)[i] = -100
    return hidden, weight, target


def shard_rows(full, rank, tp):
    rows = full.shape[0] // tp
    return full[rank * rows:(rank + 1) * rows]


def reference_linear(hidden, weight, target, *, dtype, w_lp, w_h=None, **options):
    """Float64 values, gradients and gradient scales for logits ``round_dtype(hidden @ weight.T)``.

    ``w_lp``/``w_h``: upstream weights of logprobs / entropy (the objective is
    ``sum(w_lp * logprobs + w_h * entropy)``). Returns a dict of float64 tensors.
    """
    h, w = hidden.double(), weight.double()
    logits = (h @ w.T).to(dtype).double().requires_grad_()
    lp, ent, lse = reference_stats(logits, target, **options)
    objective = (lp * w_lp.double()).sum()
    if w_h is not None:
        objective = objective + (ent * w_h.double()).sum()
    objective.backward()
    g = logits.grad.reshape(-1, w.shape[0])
    h2 = h.reshape(-1, h.shape[-1])
    return dict(logprobs=lp.detach(), entropy=ent.detach(), logsumexp=lse.detach(),
                dx=(g @ w).view(h.shape), dw=g.T @ h2,
                dx_scale=(g.abs() @ w.abs()).view(h.shape), dw_scale=g.abs().T @ h2.abs())


def assert_close(actual, expected, *, rtol, atol, what, scale=None):
    """``|actual - expected| <= atol + rtol * scale`` elementwise (scale defaults to |expected|)."""
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != " \
                                           f"{tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).abs()
    bound = atol + rtol * (expected.double().abs() if scale is None else scale)
    bad = err > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements over the bound, worst "
                                 f"error {err[bad].max().item():.3g} (bound there "
                                 f"{bound[bad][err[bad].argmax()].item():.3g})")


def run_and_check(group, *, dtype=torch.float32, sequence_parallel=False, forward_grad=False,
                  entropy="grad", chunk_size=4, seed=0, tokens=None, ignore=(0,),
                  kernel="torch", batch_invariant=False, **options):
    """Run the op on this rank's shards and check it against the float64 reference (``kernel``
    and ``batch_invariant`` go to the op only: the reference is the same)."""
    rank, tp = rank_size(group)
    tokens = tokens or ((3 * tp, 2) if sequence_parallel else (5, 3))
    vocab = options.pop("vocab_size", 101)
    hidden, weight, target = make_problem(tp, tokens=tokens, vocab=vocab, dtype=dtype, seed=seed,
                                          ignore=ignore)
    gen = torch.Generator().manual_seed(seed + 1)
    w_lp = torch.rand(tokens, generator=gen) + 0.5
    w_h = None if forward_grad or entropy != "grad" else torch.randn(tokens, generator=gen)
    if forward_grad:
        entropy = "metric"
    h_leaf = (shard_rows(hidden, rank, tp) if sequence_parallel else hidden).clone()
    h_leaf.requires_grad_()
    w_leaf = shard_rows(weight, rank, tp).clone().requires_grad_()
    st = linear_vocab_parallel_stats(
        h_leaf, w_leaf, target, tp_group=group, sequence_parallel=sequence_parallel,
        vocab_size=vocab, chunk_size=chunk_size, entropy=entropy,
        grad_weights=w_lp if forward_grad else None, kernel=kernel,
        batch_invariant=batch_invariant, **options)
    # With grad_weights the upstream gradient is c * w_lp; c = -0.37 tests its scaling.
    c = -0.37 if forward_grad else 1.0
    objective = (st.logprobs * w_lp).sum() * c
    if w_h is not None:
        objective = objective + (st.entropy * w_h).sum()
    objective.backward()
    ref = reference_linear(hidden, weight, target, dtype=dtype, w_lp=w_lp * c, w_h=w_h,
                           vocab_size=vocab, **options)
    tol = TOLERANCES[dtype]
    for name in ("logprobs", "logsumexp") + (("entropy",) if entropy != "off" else ()):
        assert_close(getattr(st, name), ref[name], rtol=tol["value"], atol=tol["value"],
                     what=name)
    dx, dx_scale = ref["dx"], ref["dx_scale"]
    if sequence_parallel:
        dx, dx_scale = shard_rows(dx, rank, tp), shard_rows(dx_scale, rank, tp)
    assert h_leaf.grad.dtype == dtype and w_leaf.grad.dtype == dtype
    assert_close(h_leaf.grad, dx, rtol=tol["grad"], atol=tol["atol"], scale=dx_scale,
                 what="hidden gradient")
    assert_close(w_leaf.grad, shard_rows(ref["dw"], rank, tp), rtol=tol["grad"],
                 atol=tol["atol"], scale=shard_rows(ref["dw_scale"], rank, tp),
                 what="weight gradient")
    return st, h_leaf, w_leaf


@CASES.register
def fp32_matches_float64(group):
    run_and_check(group)


@CASES.register
def fp32_temperature_smoothing_padded_vocab(group):
    run_and_check(group, temperature=0.7, label_smoothing=0.1, vocab_size=99)


@CASES.register
def bf16_matches_float64(group):
    run_and_check(group, dtype=torch.bfloat16)


@CASES.register
def sequence_parallel_fp32_matches_float64(group):
    run_and_check(group, sequence_parallel=True, temperature=0.9)


@CASES.register
def sequence_parallel_bf16_matches_float64(group):
    run_and_check(group, sequence_parallel=True, dtype=torch.bfloat16)


@CASES.register
def forward_grad_matches_float64(group):
    run_and_check(group, forward_grad=True, label_smoothing=0.05)


@CASES.register
def forward_grad_sequence_parallel_bf16(group):
    run_and_check(group, forward_grad=True, sequence_parallel=True, dtype=torch.bfloat16)


@CASES.register
def all_ignored_chunk_has_zero_gradient(group):
    # chunk 4: the first chunk (flat rows 0..3) is entirely ignored.
    _, tp = rank_size(group)
    for sp in (False, True):
        st, h_leaf, _ = run_and_check(group, sequence_parallel=sp, ignore=(0, 1, 2, 3),
                                      tokens=(4 * tp, 2) if sp else (5, 3))
        assert torch.equal(st.logprobs.reshape(-1)[:4], torch.zeros(4))
        if not sp:
            assert torch.equal(h_leaf.grad.reshape(-1, h_leaf.shape[-1])[:4],
                               torch.zeros(4, h_leaf.shape[-1]))


class _VocabParallelEmbedding(torch.autograd.Function):
    """Megatron's vocab-parallel lookup: masked local rows, summed over ranks; identity backward."""

    @staticmethod
    def forward(ctx, local, group):
        total = local.clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@CASES.register
def tied_embedding_weight(group):
    rank, tp = rank_size(group)
    hidden_size, vocab = 23, 101
    _, weight, target = make_problem(tp, vocab=vocab, hidden_size=hidden_size)
    width = weight.shape[0] // tp
    tokens = torch.randint(0, vocab, target.shape, generator=torch.Generator().manual_seed(7))
    w_lp = torch.linspace(0.5, 1.5, target.numel()).view(target.shape)

    w_leaf = shard_rows(weight, rank, tp).clone().requires_grad_()
    local_ids = tokens - rank * width
    mine = (local_ids >= 0) & (local_ids < width)
    local = torch.nn.functional.embedding(local_ids.clamp(0, width - 1), w_leaf) * mine[..., None]
    hidden = torch.tanh(_VocabParallelEmbedding.apply(local, group)) * 2.0
    st = linear_vocab_parallel_stats(hidden, w_leaf, target, tp_group=group, vocab_size=vocab,
                                     chunk_size=4, entropy="off")
    (st.logprobs * w_lp).sum().backward()

    w_ref = weight.double().requires_grad_()
    h_ref = torch.tanh(torch.nn.functional.embedding(tokens, w_ref)) * 2.0
    lp, _, _ = reference_stats(h_ref @ w_ref.T, target, vocab_size=vocab)
    (lp * w_lp.double()).sum().backward()
    assert_close(st.logprobs, lp.detach(), rtol=1e-5, atol=1e-5, what="logprobs")
    assert_close(w_leaf.grad, shard_rows(w_ref.grad, rank, tp), rtol=1e-5, atol=1e-5,
                 what="tied weight gradient")


def megatron_like_weight(shard, *, zero_out_wgrad, main_grad_dtype=torch.float32):
    """A parameter as Megatron's DDP prepares it for gradient-accumulation fusion."""
    param = torch.nn.Parameter(shard.clone())
    param.main_grad = torch.zeros(shard.shape, dtype=main_grad_dtype)
    param.grad_added_to_main_grad = False
    param.zero_out_wgrad = zero_out_wgrad
    return param


@CASES.register
def main_grad_accumulates_over_two_micro_batches(group):
    rank, tp = rank_size(group)
    for forward_grad in (False, True):
        param = None
        expected = scale = 0
        for micro in range(2):
            hidden, weight_m, target = make_problem(tp, seed=10 + micro, dtype=torch.bfloat16)
            if param is None:  # one weight, two micro-batches of tokens
                weight = weight_m
                param = megatron_like_weight(shard_rows(weight, rank, tp), zero_out_wgrad=True)
            mask = (torch.rand(target.shape, generator=torch.Generator().manual_seed(micro))
                    > 0.3).float()
            loss = linear_vocab_parallel_cross_entropy(
                hidden, param, target, tp_group=group, vocab_size=101, chunk_size=4,
                loss_weights=mask if forward_grad else None, accumulate_into_main_grad=True)
            ((loss * mask).sum() / 7.0).backward()
            ref = reference_linear(hidden, weight, target, dtype=torch.bfloat16,
                                   w_lp=-mask / 7.0, vocab_size=101)
            expected = expected + shard_rows(ref["dw"], rank, tp)
            scale = scale + shard_rows(ref["dw_scale"], rank, tp)
            assert param.grad_added_to_main_grad is True
            assert torch.equal(param.grad, torch.zeros_like(param.grad)), "dummy grad not zero"
            param.grad_added_to_main_grad = False
        assert param.main_grad.dtype == torch.float32
        assert_close(param.main_grad, expected, rtol=2**-7, atol=1e-6, scale=scale,
                     what=f"main_grad (forward_grad={forward_grad})")


def _count_all():
    # torch >= 2.12 spells reduce-scatter reduce_scatter_single; count it too.
    names = profiling.COLLECTIVES
    if "reduce_scatter_single" not in names:
        profiling.COLLECTIVES = names + ("reduce_scatter_single",)
    return profiling.count_collectives()


@CASES.register
def collective_budget(group):
    rank, tp = rank_size(group)
    multi = tp > 1
    for sp in (False, True):
        hidden, weight, target = make_problem(tp, tokens=(3 * tp, 2), ignore=())
        mask = torch.ones(target.shape)
        for forward_grad in (False, True):
            for validate in (True, False):
                h = (shard_rows(hidden, rank, tp) if sp else hidden).clone().requires_grad_()
                w = shard_rows(weight, rank, tp).clone().requires_grad_()
                with _count_all() as fwd:
                    loss = linear_vocab_parallel_cross_entropy(
                        h, w, target, tp_group=group, sequence_parallel=sp, vocab_size=101,
                        chunk_size=4, validate=validate,
                        loss_weights=mask if forward_grad else None)
                with _count_all() as bwd:
                    loss.sum().backward()
                chunks = -(-target.numel() // 4)
                if forward_grad:  # per-chunk stats, validate, SP gather, dX reduction
                    want_fwd = (chunks + validate + sp + 1) if multi else 0
                    want_bwd = int(validate and multi)
                else:  # stats, validate, SP gather | dX reduction, SP re-gather
                    want_fwd = (1 + validate + sp) if multi else 0
                    want_bwd = (1 + sp) if multi else 0
                what = f"sp={sp} forward_grad={forward_grad} validate={validate}"
                assert len(fwd) == want_fwd, f"{what}: forward made {fwd}"
                assert len(bwd) == want_bwd, f"{what}: backward made {bwd}"


@CASES.register
def ranks_agree_bitwise(group):
    st, _, _ = run_and_check(group, dtype=torch.bfloat16, sequence_parallel=True)
    for t in st[:3]:
        table = [torch.empty_like(t) for _ in range(rank_size(group)[1])]
        dist.all_gather(table, t.contiguous(), group=group)
        assert all(torch.equal(table[0], x) for x in table), "ranks returned different values"


@CASES.register
def partial_hidden_grad_is_this_ranks_share(group):
    """partial_hidden_grad=True (verl's convention): dX is this rank's share G_r @ W_r, with no
    collective in backward; the shares sum to the full dX; values and dW as without it. With
    sequence_parallel it is refused."""
    rank, tp = rank_size(group)
    hidden, weight, target = make_problem(tp)
    gen = torch.Generator().manual_seed(1)
    w_lp, w_h = torch.rand(target.shape, generator=gen) + 0.5, torch.randn(target.shape,
                                                                          generator=gen)
    ref = reference_linear(hidden, weight, target, dtype=torch.float32, w_lp=w_lp, w_h=w_h,
                           vocab_size=101)
    logits = (hidden.double() @ weight.double().T).requires_grad_()
    lp, ent, _ = reference_stats(logits, target, vocab_size=101)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    width = weight.shape[0] // tp
    g = logits.grad.reshape(-1, weight.shape[0])[:, rank * width:(rank + 1) * width]
    w_r = shard_rows(weight, rank, tp).double()
    share, scale = (g @ w_r).view(hidden.shape), (g.abs() @ w_r.abs()).view(hidden.shape)

    h = hidden.clone().requires_grad_()
    w = shard_rows(weight, rank, tp).clone().requires_grad_()
    st = linear_vocab_parallel_stats(h, w, target, tp_group=group, vocab_size=101, chunk_size=4,
                                     partial_hidden_grad=True)
    with _count_all() as bwd:
        ((st.logprobs * w_lp).sum() + (st.entropy * w_h).sum()).backward()
    assert bwd == [], f"backward made {bwd}"
    tol = TOLERANCES[torch.float32]
    assert_close(st.logprobs, ref["logprobs"], rtol=tol["value"], atol=tol["value"],
                 what="logprobs")
    assert_close(h.grad, share, rtol=tol["grad"], atol=tol["atol"], scale=scale,
                 what="this rank's share of dX")
    summed = h.grad.clone()
    dist.all_reduce(summed, group=group)
    assert_close(summed, ref["dx"], rtol=tol["grad"], atol=tol["atol"], scale=ref["dx_scale"],
                 what="sum of the shares")
    assert_close(w.grad, shard_rows(ref["dw"], rank, tp), rtol=tol["grad"], atol=tol["atol"],
                 scale=shard_rows(ref["dw_scale"], rank, tp), what="weight gradient")
    sp_hidden, sp_weight, sp_target = make_problem(tp, tokens=(3 * tp, 2))
    expect_value_error(lambda: linear_vocab_parallel_stats(
        shard_rows(sp_hidden, rank, tp), shard_rows(sp_weight, rank, tp), sp_target,
        tp_group=group, vocab_size=101, sequence_parallel=True, partial_hidden_grad=True),
        "partial_hidden_grad=True cannot be combined with sequence_parallel=True")


def expect_value_error(fn, expected):
    """``fn()`` must raise a ``ValueError`` whose message contains ``expected``."""
    try:
        fn()
    except ValueError as exc:
        assert expected in str(exc), str(exc)
    else:
        raise AssertionError(f"no ValueError (expected one saying {expected!r})")


def _last_rank_input_is_bad(group, spoil, own_message, **options):
    """The last rank's (hidden, weight shard) go through ``spoil``; every rank must raise: that
    rank with ``own_message``, the others saying it rejected its inputs (no hang)."""
    rank, tp = needs_tp2(group)
    hidden, weight, target = make_problem(tp, tokens=(3 * tp, 2))
    h = shard_rows(hidden, rank, tp) if options.get("sequence_parallel") else hidden
    w = shard_rows(weight, rank, tp)
    if rank == tp - 1:
        h, w = spoil(h, w)
    expected = own_message if rank == tp - 1 else f"ranks [{tp - 1}] of tp_group rejected"
    expect_value_error(lambda: linear_vocab_parallel_stats(h, w, target, tp_group=group,
                                                           vocab_size=101, **options), expected)


@CASES.register
def sequence_parallel_shard_length_mismatch_raises_everywhere(group):
    _last_rank_input_is_bad(group, lambda h, w: (h[:-1], w), "the gathered sequence",
                            sequence_parallel=True)


@CASES.register
def rank_local_bad_input_raises_everywhere(group):
    _last_rank_input_is_bad(group, lambda h, w: (h, w.to(torch.bfloat16)), "weight dtype")


@CASES.register
def empty_hidden_dimension_raises_everywhere(group):
    _last_rank_input_is_bad(group, lambda h, w: (h[..., :0], w[:, :0]),
                            "hidden: the hidden dimension is empty")


@CASES.register
def options_differing_across_ranks_raise_everywhere(group):
    """``sequence_parallel``, ``grad_weights``, ``accumulate_into_main_grad`` or
    ``partial_hidden_grad`` set on rank 0 only: every rank raises naming the field, with each
    rank's value (was: a failed or mismatched collective on one rank and wrong gradients on the
    others)."""
    rank, tp = needs_tp2(group)
    hidden, weight, target = make_problem(tp, tokens=(3 * tp, 2))
    first = rank == 0
    param = megatron_like_weight(shard_rows(weight, rank, tp), zero_out_wgrad=True)
    sp_hidden = shard_rows(hidden, rank, tp) if first else hidden  # same gathered tokens
    cases = [
        ("sequence_parallel", bool, dict(sequence_parallel=first, hidden=sp_hidden)),
        ("grad_weights", lambda given: "tensor" if given else None,
         dict(grad_weights=torch.ones(target.shape) if first else None)),
        ("accumulate_into_main_grad", bool, dict(accumulate_into_main_grad=first)),
        ("argmax", bool, dict(argmax=first)),
        ("partial_hidden_grad", bool, dict(partial_hidden_grad=first)),
    ]
    for field, show, options in cases:
        h = options.pop("hidden", hidden).clone().requires_grad_()
        values = [show(r == 0) for r in range(tp)]
        expect_value_error(
            lambda: linear_vocab_parallel_stats(h, param, target, tp_group=group, vocab_size=101,
                                                chunk_size=4, entropy="off", **options),
            f"{field} differs across the ranks of tp_group: {values}")
    # Given everywhere but with other values on one rank: compared by checksum.
    h = hidden.clone().requires_grad_()
    expect_value_error(
        lambda: linear_vocab_parallel_stats(h, param, target, tp_group=group, vocab_size=101,
                                            chunk_size=4, entropy="off",
                                            grad_weights=torch.full(target.shape, 1.0 + first)),
        "grad_weights values differs across the ranks of tp_group")


@CASES.register
def argmax_is_torch_argmax_of_the_full_logits(group):
    """``argmax=True``: the global id of each row's largest logit equals ``torch.argmax`` of
    the full float64 logits (ties to the lowest id, padding beyond ``vocab_size`` never wins), on
    every rank, for even shards, sequence parallelism and the per-block mode "tp". Hidden states
    and weights are small integers, so every logit is an exact integer in any summation order
    and ties across shards are many and exact; the logits' maxima are made to tie on purpose
    (duplicated weight rows on both halves of the vocabulary, the second half rolled by one row)."""
    rank, tp = rank_size(group)
    gen = torch.Generator().manual_seed(5)
    vocab, width, tokens = 128 * tp - 5, 128, (4 * tp, 3)
    hidden = torch.randint(-2, 3, (*tokens, 8), generator=gen).float()
    weight = torch.randint(-2, 3, (width * tp, 8), generator=gen).float()
    # every logit appears on both halves; rolled by one row so the shards' first rows (the
    # sample by which the checks refuse a weight replicated across the tp_group) differ
    weight[width * tp // 2:] = weight[: width * tp // 2].roll(1, dims=0)
    weight[vocab:] = 40.0  # padding rows: the largest logits, yet never the argmax
    target = torch.randint(0, vocab, tokens, generator=gen)
    expected = (hidden.double() @ weight[:vocab].double().T).argmax(dim=-1)
    assert (expected < width * tp // 2).all()  # ties resolved to the lower copy
    for options in (dict(), dict(sequence_parallel=True), dict(batch_invariant="tp")):
        h = shard_rows(hidden, rank, tp) if options.get("sequence_parallel") else hidden
        h = h.clone().requires_grad_()
        st = linear_vocab_parallel_stats(
            h, shard_rows(weight, rank, tp), target, tp_group=group, vocab_size=vocab,
            chunk_size=5, kernel="torch", argmax=True, **options)
        assert st.argmax.dtype == torch.int64 and not st.argmax.requires_grad
        assert torch.equal(st.argmax, expected), f"{options}: argmax differs"
        plain = linear_vocab_parallel_stats(h, shard_rows(weight, rank, tp), target,
                                            tp_group=group, vocab_size=vocab, chunk_size=5,
                                            kernel="torch", **options)
        assert plain.argmax is None
        for a, b in zip(st[:3], plain[:3]):  # the statistics are untouched by the extra row
            assert a is None and b is None or torch.equal(a, b)
        if not options.get("sequence_parallel"):  # the unfused op from the same logits
            logits = hidden @ shard_rows(weight, rank, tp).T
            unfused = vocab_parallel_stats(logits, target, tp_group=group, vocab_size=vocab,
                                           chunk_size=5, argmax=True, **options)
            assert torch.equal(unfused.argmax, expected), f"{options}: unfused argmax differs"
        st.logprobs.sum().backward()


@CASES.register
def reduce_scatter_fallback_matches(group):
    rank, tp = needs_tp2(group)
    full = torch.randn(3 * tp, 2, 5, generator=torch.Generator().manual_seed(rank))
    expected = full.clone()
    dist.all_reduce(expected, group=group)
    direct = _comm.reduce_scatter_sequence(full.clone(), group)
    fallback = _comm.reduce_scatter_by_all_reduce(full.clone(), group)
    assert torch.equal(direct, shard_rows(expected, rank, tp))
    assert torch.equal(fallback, shard_rows(expected, rank, tp))
    gathered = _comm.gather_sequence(direct, group)
    assert torch.equal(gathered, expected)


if __name__ == "__main__":
    main(CASES)
