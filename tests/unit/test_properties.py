"""Property-based tests (hypothesis) of the public ops against float64 references, tp = 1.

Every example draws shapes (empty ones included), a padded vocabulary, a dtype, a chunk size,
ignored rows, -inf logits at random columns (never a whole row), a temperature, label smoothing
and an entropy mode, and compares values and gradients with the float64 reference within the
bounds of ``_reference.py`` (derived in ``docs/numerics.md``, "Test tolerances"). The second half
draws bad arguments that must raise ``ValueError``/``TypeError`` naming the argument.

The examples come from the hypothesis profile of ``conftest.py`` (``ci``: a fixed, bounded set).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _reference import (
    U32,
    assert_within,
    gamma,
    linear_grad_bounds,
    linear_logits_error,
    picked_grad_bound,
    reference_stats,
    reference_topk,
    smoothed_logprob_bound,
    stats_bounds,
    stats_grad_bound,
    sum_bound,
    temperature_dz,
)
from megatron_vocabstats import (
    TopK,
    distillation_loss,
    linear_vocab_parallel_stats,
    sft_loss,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
    vocab_parallel_topk,
    vocab_parallel_topk_logprobs,
)
from megatron_vocabstats.ops._layout import BLOCK

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENTROPY_MODES = ("off", "metric", "grad")


# ---------------------------------------------------------------------------------------------
# Strategies


def _numel(shape) -> int:
    return math.prod(shape)


lead_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).filter(
    lambda s: _numel(s) <= 24)
temperatures = st.one_of(st.just(1.0), st.floats(0.05, 20.0))
smoothings = st.one_of(st.just(0.0), st.floats(0.0, 0.99))


@st.composite
def chunk_sizes(draw, tokens: int):
    return draw(st.one_of(st.none(), st.just(1), st.integers(1, 7).map(lambda n: 2 * n + 1),
                          st.integers(tokens + 1, tokens + 9)))


@st.composite
def logits_case(draw, *, max_width: int = 70):
    """``(logits [*lead, W], vocab_size, generator)``: random logits of a drawn dtype, scale and
    offset (the offset sets max|z|, the condition of the fp32 sums), -inf at random real
    columns (each row keeps one finite), padding columns holding large finite garbage."""
    lead = tuple(draw(lead_shapes))
    width = draw(st.one_of(st.integers(1, max_width), st.integers(BLOCK, 3 * BLOCK)))
    vocab = draw(st.one_of(st.just(width), st.integers(1, width)))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([0.01, 1.0, 4.0, 30.0]))
    offset = draw(st.sampled_from([0.0, -50.0, 300.0]))
    inf_frac = draw(st.sampled_from([0.0, 0.3, 0.9]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tokens = _numel(lead)
    x = torch.randn(tokens, width, generator=gen, dtype=torch.float64) * scale + offset
    masked = torch.rand(tokens, width, generator=gen) < inf_frac
    keep = torch.randint(0, vocab, (tokens, 1), generator=gen)
    masked.scatter_(1, keep, False)
    x = torch.where(masked, float("-inf"), x)
    x[:, vocab:] = torch.finfo(dtype).max / 2 if draw(st.booleans()) else 0.5
    return x.to(dtype).reshape(*lead, width), vocab, gen


def draw_target(draw, gen, lead, vocab):
    """``(target, ignore_index, valid)``: ids in [0, V), some rows set to a drawn ignore_index
    (negative, beyond V, or a real id)."""
    ignore_index = draw(st.one_of(st.sampled_from([-100, -1, vocab + 3]),
                                  st.integers(0, vocab - 1)))
    frac = draw(st.sampled_from([0.0, 0.3, 1.0]))
    tokens = _numel(lead)
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    ignored = torch.rand(tokens, generator=gen) < frac
    target = torch.where(ignored, ignore_index, target)
    return target.reshape(lead), ignore_index, target != ignore_index


def _z(logits, vocab, temperature):
    """The float64 tempered real-vocabulary logits ``[T, V]`` the bounds are derived from."""
    return logits.double().reshape(-1, logits.shape[-1])[:, :vocab] / temperature


# ---------------------------------------------------------------------------------------------
# vocab_parallel_stats


@given(data=st.data())
def test_stats_match_float64_within_derived_bounds(data):
    draw = data.draw
    logits, vocab, gen = draw(logits_case())
    lead, width, dtype = logits.shape[:-1], logits.shape[-1], logits.dtype
    tokens = _numel(lead)
    target, ignore_index, valid = draw_target(draw, gen, lead, vocab)
    with_target = bool(draw(st.integers(0, 4)))  # one example in five: entropy only
    if not with_target:
        target, valid = None, torch.ones(tokens, dtype=torch.bool)
    temperature = draw(temperatures)
    eps = draw(smoothings) if with_target else 0.0
    mode = draw(st.sampled_from(ENTROPY_MODES if with_target else ("metric", "grad")))
    chunk = draw(chunk_sizes(tokens))
    batch_invariant = draw(st.booleans())

    leaf = logits.clone().requires_grad_()
    st_ = vocab_parallel_stats(leaf, target, vocab_size=vocab, chunk_size=chunk, entropy=mode,
                               temperature=temperature, ignore_index=ignore_index,
                               label_smoothing=eps, batch_invariant=batch_invariant)
    ref_leaf = logits.double().requires_grad_()
    ref = reference_stats(ref_leaf, target, vocab_size=vocab, temperature=temperature,
                          ignore_index=ignore_index, label_smoothing=eps)

    for out in st_:
        assert out is None or (out.dtype == torch.float32 and out.shape == lead)
    assert (st_.entropy is None) == (mode == "off")
    assert (st_.logprobs is None) == (target is None)

    z = _z(logits, vocab, temperature)
    blocks = -(-width // BLOCK) if batch_invariant else 1
    pad_width = blocks * BLOCK if batch_invariant else width
    b = stats_bounds(z, dz=temperature_dz(z, temperature), width=pad_width, parts=blocks)
    assert_within(st_.logsumexp.reshape(-1), ref[2].reshape(-1), b.logsumexp, "logsumexp")
    if st_.entropy is not None:
        ent = st_.entropy.reshape(-1)
        assert_within(ent[valid], ref[1].reshape(-1)[valid], b.entropy[valid], "entropy")
        assert bool((ent[~valid] == 0).all()), "entropy at ignored rows"
    if target is not None:
        lp = st_.logprobs.reshape(-1)
        safe = torch.where(valid, target.reshape(-1), 0)
        bound = smoothed_logprob_bound(b, safe, eps)
        assert_within(lp[valid], ref[0].reshape(-1)[valid], bound[valid], "logprobs")
        assert bool((lp[~valid] == 0).all()), "logprobs at ignored rows"

    # Gradient of sum(w_lp * logprobs + w_h * entropy), w drawn in fp32.
    w_lp = torch.randn(lead, generator=gen)
    w_h = torch.randn(lead, generator=gen)
    loss, ref_loss = 0.0, 0.0
    if target is not None:
        loss, ref_loss = (st_.logprobs * w_lp).sum(), (ref[0] * w_lp.double()).sum()
    if mode == "grad":
        loss, ref_loss = loss + (st_.entropy * w_h).sum(), ref_loss + (ref[1] * w_h.double()).sum()
    if not isinstance(loss, torch.Tensor):
        return
    loss.backward()
    ref_loss.backward()
    grad = leaf.grad.reshape(-1, width)
    ref_grad = ref_leaf.grad.reshape(-1, width)
    assert grad.dtype == dtype
    assert bool((grad[:, vocab:] == 0).all()), "gradient at padding columns"
    keep = valid.double() / temperature
    c_lp = w_lp.reshape(-1).double() * keep if target is not None else None
    c_h = w_h.reshape(-1).double() * keep if mode == "grad" else None
    targets = torch.where(valid, target.reshape(-1), 0) if target is not None else None
    bound = stats_grad_bound(b, ref_grad[:, :vocab], c_lp=c_lp, c_h=c_h, target=targets,
                             eps=eps, scaled=temperature != 1.0, dtype=dtype)
    assert_within(grad[:, :vocab][valid], ref_grad[:, :vocab][valid], bound[valid], "gradient")
    assert bool((grad[~valid] == 0).all()), "gradient at ignored rows"


@given(data=st.data())
def test_wrappers_equal_the_stats_fields(data):
    draw = data.draw
    logits, vocab, gen = draw(logits_case())
    lead = logits.shape[:-1]
    target, ignore_index, _ = draw_target(draw, gen, lead, vocab)
    temperature = draw(temperatures)
    eps = draw(smoothings)
    chunk = draw(chunk_sizes(_numel(lead)))
    common = dict(vocab_size=vocab, chunk_size=chunk)
    full = vocab_parallel_stats(logits, target, entropy="metric", temperature=temperature,
                                ignore_index=ignore_index, **common)
    lp = vocab_parallel_logprobs(logits, target, temperature=temperature,
                                 ignore_index=ignore_index, **common)
    ent = vocab_parallel_entropy(logits, temperature=temperature, differentiable=False, **common)
    assert torch.equal(lp, full.logprobs)
    valid = target != ignore_index
    assert torch.equal(ent[valid], full.entropy[valid])
    smooth = vocab_parallel_stats(logits, target, entropy="off", ignore_index=ignore_index,
                                  label_smoothing=eps, **common)
    ce = vocab_parallel_cross_entropy(logits, target, eps, None, ignore_index=ignore_index,
                                      **common)
    assert torch.equal(ce, 0.0 - smooth.logprobs)


# ---------------------------------------------------------------------------------------------
# Top-k


@given(data=st.data())
def test_topk_matches_float64_within_derived_bounds(data):
    draw = data.draw
    logits, vocab, _ = draw(logits_case())
    lead, width = logits.shape[:-1], logits.shape[-1]
    k = draw(st.integers(1, vocab))
    temperature = draw(temperatures)
    chunk = draw(chunk_sizes(_numel(lead)))
    top = vocab_parallel_topk(logits, k, vocab_size=vocab, temperature=temperature,
                              chunk_size=chunk)
    assert isinstance(top, TopK)
    assert top.logprobs.shape == (*lead, k) and top.logprobs.dtype == torch.float32
    assert top.indices.shape == (*lead, k) and top.indices.dtype == torch.int64
    lp, ids = top.logprobs.reshape(-1, k), top.indices.reshape(-1, k)
    ref_lp, ref_ids = reference_topk(logits.reshape(-1, width), k, vocab_size=vocab,
                                     temperature=temperature)
    assert bool(((ids >= 0) & (ids < vocab)).all()), "ids outside [0, V)"
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()), "an id twice in one top-k"
    assert bool((lp[:, 1:] <= lp[:, :-1]).all()), "top-k not sorted"
    z = _z(logits, vocab, temperature)
    b = stats_bounds(z, dz=temperature_dz(z, temperature), width=width)
    # Each returned id carries its own log-prob, and the i-th value is the i-th largest (sorting
    # is 1-Lipschitz in the max norm, so it moves by at most the largest per-column bound).
    assert_within(lp, b.logp_ref.gather(-1, ids), b.logp.gather(-1, ids), "top-k log-probs")
    row_bound = torch.where(torch.isfinite(b.logp_ref), b.logp, 0.0).amax(-1, keepdim=True)
    assert_within(lp, ref_lp, row_bound.expand_as(ref_lp), "top-k values vs sorted reference")
    if temperature == 1.0:
        # fp32 z equals the input exactly: the order, ties by lowest id, is exact.
        assert torch.equal(ids, ref_ids)


@given(data=st.data())
def test_topk_logprobs_match_float64_within_derived_bounds(data):
    draw = data.draw
    logits, vocab, gen = draw(logits_case())
    lead, width, dtype = logits.shape[:-1], logits.shape[-1], logits.dtype
    tokens = _numel(lead)
    k = draw(st.integers(1, 6))
    temperature = draw(temperatures)
    chunk = draw(chunk_sizes(tokens))
    indices = torch.randint(0, vocab, (*lead, k), generator=gen)  # duplicates allowed
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    rows = torch.rand(lead, generator=gen) < 0.7
    mask = None if mask_kind == "none" else rows if mask_kind == "bool" else rows.float()
    valid = torch.ones(tokens, dtype=torch.bool) if mask is None else rows.reshape(-1)

    leaf = logits.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, indices, mask=mask, vocab_size=vocab,
                                      temperature=temperature, chunk_size=chunk)
    assert lp.shape == (*lead, k) and lp.dtype == torch.float32
    g = torch.randn(lp.shape, generator=gen)
    (lp * g).sum().backward()
    ref_leaf = logits.double().requires_grad_()
    ref_logp = torch.log_softmax(ref_leaf[..., :vocab] / temperature, -1).gather(-1, indices)
    ref_lp = torch.where(valid.reshape(*lead, 1), ref_logp, 0.0)
    (ref_lp * g.double()).sum().backward()

    z = _z(logits, vocab, temperature)
    b = stats_bounds(z, dz=temperature_dz(z, temperature), width=width)
    ids = indices.reshape(-1, k)
    lp2, ref2 = lp.reshape(-1, k), ref_lp.reshape(-1, k)
    assert_within(lp2[valid], ref2[valid], b.logp.gather(-1, ids)[valid], "log-probs at ids")
    assert bool((lp2[~valid] == 0).all()), "log-probs at masked rows"
    grad = leaf.grad.reshape(-1, width)
    ref_grad = ref_leaf.grad.reshape(-1, width)[:, :vocab]
    g_rows = torch.where(valid.unsqueeze(1), g.reshape(-1, k).double(), 0.0) / temperature
    bound = picked_grad_bound(b, ref_grad, g=g_rows, indices=ids, scaled=temperature != 1.0,
                              dtype=dtype)
    assert_within(grad[:, :vocab], ref_grad, bound, "gradient")
    assert bool((grad[:, vocab:] == 0).all()) and bool((grad[~valid] == 0).all())


# ---------------------------------------------------------------------------------------------
# Fused LM head


@given(data=st.data())
def test_linear_stats_match_float64_within_derived_bounds(data):
    draw = data.draw
    lead = tuple(draw(lead_shapes))
    tokens = _numel(lead)
    hidden_size = draw(st.integers(1, 16))
    width = draw(st.integers(1, 60))
    vocab = draw(st.one_of(st.just(width), st.integers(1, width)))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 1.0, 3.0]))
    hidden = (torch.randn(*lead, hidden_size, generator=gen) * scale).to(dtype)
    weight = (torch.randn(width, hidden_size, generator=gen) * scale).to(dtype)
    target, ignore_index, valid = draw_target(draw, gen, lead, vocab)
    temperature = draw(temperatures)
    eps = draw(smoothings)
    mode = draw(st.sampled_from(ENTROPY_MODES))
    chunk = draw(chunk_sizes(tokens))

    h_leaf, w_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_vocab_parallel_stats(h_leaf, w_leaf, target, vocab_size=vocab, chunk_size=chunk,
                                      entropy=mode, temperature=temperature,
                                      ignore_index=ignore_index, label_smoothing=eps)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits64 = h64 @ w64.T
    logits64.retain_grad()
    ref = reference_stats(logits64, target, vocab_size=vocab, temperature=temperature,
                          ignore_index=ignore_index, label_smoothing=eps)

    z, dz = linear_logits_error(hidden, weight, vocab, temperature)
    b = stats_bounds(z, dz=dz, width=width)
    assert_within(out.logsumexp.reshape(-1), ref[2].reshape(-1), b.logsumexp, "logsumexp")
    safe = torch.where(valid, target.reshape(-1), 0)
    lp = out.logprobs.reshape(-1)
    assert_within(lp[valid], ref[0].reshape(-1)[valid],
                  smoothed_logprob_bound(b, safe, eps)[valid], "logprobs")
    assert bool((lp[~valid] == 0).all())
    if mode != "off":
        ent = out.entropy.reshape(-1)
        assert_within(ent[valid], ref[1].reshape(-1)[valid], b.entropy[valid], "entropy")

    w_lp = torch.randn(lead, generator=gen)
    w_h = torch.randn(lead, generator=gen)
    loss, ref_loss = (out.logprobs * w_lp).sum(), (ref[0] * w_lp.double()).sum()
    if mode == "grad":
        loss, ref_loss = loss + (out.entropy * w_h).sum(), ref_loss + (ref[1] * w_h.double()).sum()
    loss.backward()
    ref_loss.backward()
    # The logits gradient the op forms (bounded as the core op's, cast to the model dtype), then
    # dX = g W and dW = g^T h, each a GEMM with fp32 accumulation.
    keep = valid.double() / temperature
    c_h = w_h.reshape(-1).double() * keep if mode == "grad" else None
    g_ref = logits64.grad.reshape(-1, width)[:, :vocab]
    e_g = stats_grad_bound(b, g_ref, c_lp=w_lp.reshape(-1).double() * keep, c_h=c_h, target=safe,
                           eps=eps, scaled=temperature != 1.0, dtype=dtype)
    dx_bound, dw_bound = linear_grad_bounds(e_g, g_ref, hidden, weight,
                                            h64.grad.reshape(-1, hidden_size), w64.grad[:vocab])
    assert_within(h_leaf.grad.reshape(-1, hidden_size), h64.grad.reshape(-1, hidden_size),
                  dx_bound, "hidden gradient")
    assert_within(w_leaf.grad[:vocab], w64.grad[:vocab], dw_bound, "weight gradient")
    assert bool((w_leaf.grad[vocab:] == 0).all()), "weight gradient at padding rows"


# ---------------------------------------------------------------------------------------------
# Losses


@given(data=st.data())
def test_sft_loss_matches_float64_within_derived_bounds(data):
    draw = data.draw
    logits, vocab, gen = draw(logits_case())
    lead, width, dtype = logits.shape[:-1], logits.shape[-1], logits.dtype
    if not lead:
        lead = (1,)
        logits = logits.reshape(1, width)
    labels = torch.randint(0, vocab, lead, generator=gen)
    labels = torch.where(torch.rand(lead, generator=gen) < 0.2, -100, labels)
    loss_mask = (torch.rand(lead, generator=gen) < 0.8).to(draw(st.sampled_from(
        [torch.float32, torch.bool, torch.int64])))
    temperature = draw(temperatures)
    eps = draw(smoothings)
    chunk = draw(chunk_sizes(_numel(lead)))
    validate = draw(st.booleans())
    leaf = logits.clone().requires_grad_()
    out = sft_loss(leaf, labels, loss_mask, vocab_size=vocab, chunk_size=chunk,
                   label_smoothing=eps, temperature=temperature, entropy="metric",
                   validate=validate)
    sel = (loss_mask != 0) & (labels != -100)
    assert out.num_tokens.dtype == torch.int32 and int(out.num_tokens) == int(sel.sum())
    ref_leaf = logits.double().requires_grad_()
    target = torch.where(sel, labels, -100)
    ref = reference_stats(ref_leaf, target, vocab_size=vocab, temperature=temperature,
                          label_smoothing=eps)
    ref_sum = -ref[0][sel].sum()
    z = _z(logits, vocab, temperature)
    b = stats_bounds(z, dz=temperature_dz(z, temperature), width=width)
    flat_sel = sel.reshape(-1)
    safe = torch.where(flat_sel, labels.reshape(-1), 0)
    lp_bound = smoothed_logprob_bound(b, safe, eps)[flat_sel]
    lp_ref = ref[0].reshape(-1)[flat_sel]
    assert_within(out.loss_sum, ref_sum, sum_bound(lp_ref, lp_bound), "loss_sum")
    assert_within(out.report["lm loss"], torch.stack([ref_sum, sel.sum().double()]),
                  sum_bound(lp_ref, lp_bound), "report lm loss")
    ent_ref = ref[1].reshape(-1)[flat_sel]
    assert_within(out.report["entropy"][0], ent_ref.sum(),
                  sum_bound(ent_ref, b.entropy[flat_sel]), "report entropy")
    out.loss_sum.backward()
    ref_sum.backward()
    ref_grad = ref_leaf.grad.reshape(-1, width)[:, :vocab]
    bound = stats_grad_bound(b, ref_grad, c_lp=-flat_sel.double() / temperature, c_h=None,
                             target=safe, eps=eps, scaled=temperature != 1.0, dtype=dtype)
    assert_within(leaf.grad.reshape(-1, width)[:, :vocab], ref_grad, bound, "gradient")


def _bregman(lp, lq):
    """Float64 ``sum_i p_i (r_i - 1 + e^{-r_i})``, r = lp - lq, per row of ``[T, k]``."""
    p, q = lp.exp(), lq.exp()
    return torch.where(torch.isneginf(lp), q, p * (lp - lq) - p + q).sum(-1)


@given(data=st.data())
def test_distillation_loss_matches_float64_within_derived_bounds(data):
    """Forward and reverse KL over the teacher's top-k (no tail bucket), values only.

    Bound: the student log-probs' bound times ``|dD/d log q_i|`` (``|q_i - p_i|`` forward,
    ``q_i |r_i|`` reverse) plus the divergence's own fp32 arithmetic per bucket,
    ``u ((3 LIBM + 4) M_i + |r_i| (p_i + q_i))`` with ``M_i = (p_i + q_i)(|r_i| + 1)`` (a few
    roundings and exp/expm1 calls on quantities bounded by M_i), then the sums over buckets and
    tokens (``gamma``).
    """
    draw = data.draw
    logits, vocab, gen = draw(logits_case(max_width=40))
    lead, width = logits.shape[:-1], logits.shape[-1]
    if not lead:
        lead = (1,)
        logits = logits.reshape(1, width)
    tokens = _numel(lead)
    k = draw(st.integers(1, vocab))
    teacher_logits = torch.randn(*lead, vocab, generator=gen, dtype=torch.float64) * 3
    t_lp, t_ids = reference_topk(teacher_logits, k)
    teacher = TopK(t_lp.float(), t_ids)
    loss_mask = (torch.rand(lead, generator=gen) < 0.8).float()
    divergence = draw(st.sampled_from(["forward_kl", "reverse_kl"]))
    temperature = draw(temperatures)
    chunk = draw(chunk_sizes(tokens))
    out = distillation_loss(logits, teacher, loss_mask, vocab_size=vocab, divergence=divergence,
                            temperature=temperature, chunk_size=chunk, validate=True)
    sel = loss_mask.reshape(-1) != 0
    z = _z(logits, vocab, temperature)
    b = stats_bounds(z, dz=temperature_dz(z, temperature), width=width)
    ids = t_ids.reshape(-1, k)
    lq = b.logp_ref.gather(-1, ids)[sel]
    d_lq = b.logp.gather(-1, ids)[sel]
    lp = teacher.logprobs.double().reshape(-1, k)[sel]
    if divergence == "forward_kl":
        per_token = _bregman(lp, lq)
        sens = (lq.exp() - lp.exp()).abs()
    else:
        per_token = _bregman(lq, lp)
        sens = lq.exp() * torch.where(torch.isfinite(lq), lq - lp, 0.0).abs()
    p, q = lp.exp(), lq.exp()
    r = torch.where(torch.isfinite(lq), lp - lq, 0.0).abs()
    big_m = (p + q) * (r + 1)
    arith = U32 * ((3 * 2.0 + 4) * big_m + r * (p + q))
    per_bound = (sens * d_lq + arith).sum(-1) + gamma(max(k - 1, 0)) * big_m.sum(-1)
    if not bool(torch.isfinite(per_token).all()):
        return  # a -inf student log-prob at a teacher id: +inf loss, nothing to bound
    assert_within(out.loss_sum, per_token.sum(), sum_bound(per_token, per_bound), "loss_sum")
    assert int(out.num_tokens) == int(sel.sum())


# ---------------------------------------------------------------------------------------------
# Bad inputs: ValueError or TypeError naming the argument


def _small(dtype=torch.float32, lead=(2, 3), width=8):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*lead, width, generator=gen).to(dtype)
    target = torch.randint(0, width, lead, generator=gen)
    return logits, target


def _call(op: str, **override):
    """Call ``op`` on small valid inputs with ``override`` replacing arguments."""
    logits, target = _small()
    hidden = torch.randn(2, 3, 4)
    weight = torch.randn(8, 4)
    indices = torch.randint(0, 8, (2, 3, 2))
    teacher = TopK(torch.full((2, 3, 2), -1.0), indices)
    mask = torch.ones(2, 3)
    if op == "vocab_parallel_stats":
        args = dict(dict(logits=logits, target=target), **override)
        return vocab_parallel_stats(args.pop("logits"), args.pop("target"), **args)
    if op == "vocab_parallel_logprobs":
        args = dict(dict(logits=logits, target=target), **override)
        return vocab_parallel_logprobs(args.pop("logits"), args.pop("target"), **args)
    if op == "vocab_parallel_entropy":
        args = dict(dict(logits=logits), **override)
        return vocab_parallel_entropy(args.pop("logits"), **args)
    if op == "vocab_parallel_cross_entropy":
        args = dict(dict(logits=logits, target=target, label_smoothing=0.0), **override)
        return vocab_parallel_cross_entropy(args.pop("logits"), args.pop("target"),
                                            args.pop("label_smoothing"), None, **args)
    if op == "vocab_parallel_topk":
        args = dict(dict(logits=logits, k=2), **override)
        return vocab_parallel_topk(args.pop("logits"), args.pop("k"), **args)
    if op == "vocab_parallel_topk_logprobs":
        args = dict(dict(logits=logits, indices=indices), **override)
        return vocab_parallel_topk_logprobs(args.pop("logits"), args.pop("indices"), **args)
    if op == "linear_vocab_parallel_stats":
        args = dict(dict(hidden=hidden, weight=weight, target=target), **override)
        return linear_vocab_parallel_stats(args.pop("hidden"), args.pop("weight"),
                                           args.pop("target"), **args)
    if op == "sft_loss":
        args = dict(dict(logits=logits, labels=target, loss_mask=mask), **override)
        return sft_loss(args.pop("logits"), args.pop("labels"), args.pop("loss_mask"), **args)
    if op == "distillation_loss":
        args = dict(dict(student=logits, teacher=teacher, loss_mask=mask), **override)
        return distillation_loss(args.pop("student"), args.pop("teacher"),
                                 args.pop("loss_mask"), **args)
    raise AssertionError(op)


STATS_OPS = ("vocab_parallel_stats", "vocab_parallel_logprobs", "vocab_parallel_entropy",
             "vocab_parallel_topk", "vocab_parallel_topk_logprobs", "linear_vocab_parallel_stats",
             "sft_loss", "distillation_loss")
WITH_TARGET = ("vocab_parallel_stats", "vocab_parallel_logprobs", "vocab_parallel_cross_entropy",
               "linear_vocab_parallel_stats")

not_a_number = st.one_of(st.none(), st.text(max_size=3), st.just([1.0]), st.just(object()))
non_integral = st.floats(allow_nan=True, allow_infinity=True).filter(
    lambda f: not (math.isfinite(f) and f == int(f)))
BAD_OPTIONS = {
    "temperature": st.one_of(st.floats(max_value=0.0), st.sampled_from([math.nan, math.inf]),
                             not_a_number),
    "label_smoothing": st.one_of(st.floats(max_value=0.0, exclude_max=True),
                                 st.floats(min_value=1.0),
                                 st.just(math.nan), not_a_number),
    "ignore_index": st.one_of(non_integral, not_a_number),
    "chunk_size": st.one_of(st.integers(max_value=0), non_integral, st.text(max_size=3)),
    "entropy": st.one_of(st.text(max_size=6).filter(lambda s: s not in ENTROPY_MODES),
                         st.none(), st.integers()),
    "vocab_size": st.one_of(st.integers(max_value=0), st.integers(min_value=9), non_integral,
                            st.text(max_size=3)),
}
# Which ops take which option (the others have no such keyword).
OPTION_OPS = {
    "temperature": ("vocab_parallel_stats", "vocab_parallel_logprobs", "vocab_parallel_entropy",
                    "vocab_parallel_topk", "vocab_parallel_topk_logprobs",
                    "linear_vocab_parallel_stats", "sft_loss", "distillation_loss"),
    "label_smoothing": ("vocab_parallel_stats", "vocab_parallel_cross_entropy",
                        "linear_vocab_parallel_stats", "sft_loss"),
    "ignore_index": ("vocab_parallel_stats", "vocab_parallel_logprobs",
                     "vocab_parallel_cross_entropy", "linear_vocab_parallel_stats"),
    "chunk_size": STATS_OPS + ("vocab_parallel_cross_entropy",),
    "entropy": ("vocab_parallel_stats", "linear_vocab_parallel_stats", "sft_loss"),
    "vocab_size": STATS_OPS + ("vocab_parallel_cross_entropy",),
}


def _expect_named_error(name: str, **call):
    pattern = rf"\b{name}\b"
    with pytest.raises((ValueError, TypeError), match=pattern):
        _call(**call)


@pytest.mark.parametrize(
    "op, option", [(op, option) for option, ops in OPTION_OPS.items() for op in ops])
@given(data=st.data())
def test_bad_option_raises_naming_it(op, option, data):
    value = data.draw(BAD_OPTIONS[option], label=option)
    _expect_named_error(option, op=op, **{option: value})


@pytest.mark.parametrize("op", ("vocab_parallel_topk",))
@given(k=st.one_of(st.integers(max_value=0), st.integers(min_value=9), non_integral,
                   not_a_number, st.just(True)))
def test_bad_k_raises_naming_it(op, k):
    _expect_named_error("k", op=op, k=k)


bad_logits_dtypes = st.sampled_from([torch.float64, torch.int64, torch.int32, torch.bool,
                                     torch.complex64, torch.uint8])


@pytest.mark.parametrize("op", ("vocab_parallel_stats", "vocab_parallel_entropy",
                                "vocab_parallel_cross_entropy", "vocab_parallel_topk",
                                "vocab_parallel_topk_logprobs"))
@given(dtype=bad_logits_dtypes, kind=st.sampled_from(["dtype", "scalar", "list"]))
def test_bad_logits_raise_naming_them(op, dtype, kind):
    logits = _small()[0]
    bad = {"dtype": torch.zeros(logits.shape).to(dtype), "scalar": torch.tensor(1.0),
           "list": logits.tolist()}[kind]
    _expect_named_error("logits", op=op, logits=bad)


@pytest.mark.parametrize("op", WITH_TARGET)
@given(data=st.data())
def test_bad_target_raises_naming_it(op, data):
    kind = data.draw(st.sampled_from(["dtype", "shape", "range", "list"]), label="kind")
    _, target = _small()
    if kind == "dtype":
        bad = target.to(data.draw(st.sampled_from([torch.float32, torch.bool, torch.float16])))
    elif kind == "shape":
        shape = data.draw(st.lists(st.integers(1, 4), max_size=3).filter(
            lambda s: tuple(s) != (2, 3)), label="shape")
        bad = torch.zeros(shape, dtype=torch.long)
    elif kind == "range":
        value = data.draw(st.one_of(st.integers(8, 2**40), st.integers(-2**40, -101),
                                    st.integers(-99, -1)), label="id")
        bad = target.clone()
        bad.view(-1)[data.draw(st.integers(0, 5), label="where")] = value
    else:
        bad = target.tolist()
    _expect_named_error("target", op=op, target=bad, validate=True)


@given(data=st.data())
def test_bad_topk_indices_and_mask_raise_naming_them(data):
    kind = data.draw(st.sampled_from(["range", "dtype", "shape", "mask"]), label="kind")
    indices = torch.randint(0, 8, (2, 3, 2))
    if kind == "range":
        indices.view(-1)[data.draw(st.integers(0, 11))] = data.draw(
            st.one_of(st.integers(8, 2**40), st.integers(-2**40, -1)))
        _expect_named_error("indices", op="vocab_parallel_topk_logprobs", indices=indices,
                            validate=True)
    elif kind == "dtype":
        _expect_named_error("indices", op="vocab_parallel_topk_logprobs",
                            indices=indices.to(data.draw(st.sampled_from(
                                [torch.float32, torch.bool, torch.float64]))))
    elif kind == "shape":
        shape = data.draw(st.sampled_from([(2, 3, 0), (3, 2, 2), (2, 3), (6, 2), ()]))
        _expect_named_error("indices", op="vocab_parallel_topk_logprobs",
                            indices=torch.zeros(shape, dtype=torch.long))
    else:
        shape = data.draw(st.sampled_from([(2,), (3, 2), (2, 3, 1), (6,)]))
        _expect_named_error("mask", op="vocab_parallel_topk_logprobs",
                            mask=torch.ones(shape))


@given(kind=st.sampled_from(["hidden_dtype", "weight_1d", "hidden_size", "mixed_dtype",
                             "target_shape"]))
def test_bad_linear_inputs_raise_naming_them(kind):
    hidden, weight, target = torch.randn(2, 3, 4), torch.randn(8, 4), _small()[1]
    case = {
        "hidden_dtype": ("hidden", dict(hidden=hidden.long())),
        "weight_1d": ("weight", dict(weight=weight[0])),
        "hidden_size": ("hidden|weight", dict(weight=torch.randn(8, 5))),
        "mixed_dtype": ("hidden|weight", dict(weight=weight.bfloat16())),
        "target_shape": ("target", dict(target=target[0])),
    }[kind]
    with pytest.raises((ValueError, TypeError), match=rf"\b({case[0]})\b"):
        _call("linear_vocab_parallel_stats", **case[1])


@given(kind=st.sampled_from(["labels_dtype", "mask_none", "mask_shape", "labels_range"]))
def test_bad_sft_inputs_raise_naming_them(kind):
    labels = _small()[1]
    name, override = {
        "labels_dtype": ("labels", dict(labels=labels.float())),
        "mask_none": ("loss_mask", dict(loss_mask=None)),
        "mask_shape": ("loss_mask", dict(loss_mask=torch.ones(3, 2))),
        "labels_range": ("labels|target", dict(labels=torch.full((2, 3), 8), validate=True)),
    }[kind]
    with pytest.raises((ValueError, TypeError), match=rf"\b({name})\b"):
        _call("sft_loss", **override)


@given(kind=st.sampled_from(["mask_none", "mask_shape", "teacher", "divergence", "beta",
                             "positive_logprob", "mass_above_one"]))
def test_bad_distillation_inputs_raise_naming_them(kind):
    indices = torch.tensor([0, 1]).expand(2, 3, 2)
    name, override = {
        "mask_none": ("loss_mask", dict(loss_mask=None)),
        "mask_shape": ("loss_mask", dict(loss_mask=torch.ones(3, 2))),
        "teacher": ("teacher", dict(teacher=torch.zeros(2, 3, 2))),
        "divergence": ("divergence", dict(divergence="kl")),
        "beta": ("beta", dict(divergence="jsd", beta=1.5)),
        # A log-probability above 0, or top-k probabilities summing above 1, is no teacher.
        "positive_logprob": ("teacher", dict(teacher=TopK(torch.full((2, 3, 2), 0.5), indices),
                                             validate=True)),
        "mass_above_one": ("teacher", dict(teacher=TopK(torch.full((2, 3, 2), -0.1), indices),
                                           validate=True)),
    }[kind]
    with pytest.raises((ValueError, TypeError), match=rf"\b{name}\b"):
        _call("distillation_loss", **override)


@pytest.mark.parametrize("op", ("vocab_parallel_stats", "sft_loss"))
@given(value=st.one_of(st.integers(8, 2**40), st.integers(-2**40, -101), st.integers(-99, -1)),
       where=st.integers(0, 5))
def test_out_of_range_ids_without_validate_are_never_a_plausible_number(op, value, where):
    """``validate=False`` (no host sync) cannot raise, so a scored out-of-range id must come out
    NaN (as the top-k path does), never a finite loss."""
    logits, target = _small()
    target.view(-1)[where] = value
    if op == "vocab_parallel_stats":
        lp = vocab_parallel_stats(logits, target, validate=False).logprobs
        assert not bool(torch.isfinite(lp.view(-1)[where])), f"logprob {lp.view(-1)[where]}"
    else:
        out = sft_loss(logits, target, torch.ones(2, 3), validate=False)
        assert not bool(torch.isfinite(out.loss_sum)), f"loss_sum {out.loss_sum}"


@pytest.mark.parametrize("eps", [1e-46, 1e-200])
def test_label_smoothing_below_fp32_resolution_with_a_masked_column_is_not_nan(eps):
    """Found by the ``dev`` profile: an eps that rounds to 0 in fp32, times the -inf mean log-prob
    of a row with a masked column, gave ``0 * -inf = NaN``; the float64 value is -inf."""
    logits = torch.tensor([[float("-inf"), 0.5, -1.0]])
    lp = vocab_parallel_stats(logits, torch.tensor([1]), label_smoothing=eps).logprobs
    assert not bool(torch.isnan(lp).any()), lp
