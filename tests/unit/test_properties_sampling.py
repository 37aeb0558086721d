"""Property-based tests (hypothesis, the ``ci`` profile of ``conftest.py``) of the
sampler ops and of the rollout correction, against float64 references.

Sampler (``vocab_parallel_sampling_logprobs`` and its fused head): random shapes, dtypes,
logits up to 1e4 and the dtype maxima, temperatures down to 1e-3, the filters, ignored targets,
targets outside the kept set and, without ``validate``, outside the vocabulary: values and
gradients finite and equal to float64 within the bounds below; rows without gradient exactly 0.
The reference works on the op's own fp32 ``z = x / temperature`` (one rounding, as the op's
upcast), so the kept set is decided on the same values; rows whose float64 top-p or min-p
boundary lies within 1e-6 of a cut are not compared (the op sums fp32-rounded masses: the
module docstring of ``ops.sampling.from_logits`` says a token that close to ``top_p`` may fall either way).

Bounds (first order in u = 2^-24, as ``_reference.py``): the op's ``log q = (t - m) - log(mass)``
in float64 with ``mass = sum fl32(exp(fl32(z - m)))``: each term off by ``u |x_j| + 2u``
(``x = z - m`` and exp), so ``log(mass)`` by ``u (E_q|x| + 2)``, then one rounding to fp32:
``|d log q| <= u (E_q|x| + 2) + u |log q|`` (doubled below for the float64 steps' slack).
Gradient ``c (1[j = y] - q_j)``, ``c = w / tau`` in fp32 (2u): ``q_j`` off by the mass's error,
``u |z_j - lse|`` (``(z - lse) - lse_lo``), exp's 2u and one more rounding; then one cast to the
logits' dtype.

Rollout correction: random old / rollout log-probs with NaN, +-inf and -inf on both sides at
random counted and uncounted tokens: weights, flags and diagnostics equal a plain-Python float64
reference of the documented rules (a token without a log-ratio: weight 0, flagged, counted), and
``policy_loss`` stays finite in value and gradient; ``validate=True`` raises exactly when a
counted token has no log-ratio.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _reference import U32, UNDERFLOW, reference_sampling, unit_roundoff
from megatron_vocabstats import (
    RolloutCorrection,
    correction_weights,
    linear_vocab_parallel_sampling_logprobs,
    mismatch_diagnostics,
    policy_loss,
    vocab_parallel_sampling_logprobs,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IGNORE = -100


# ---------------------------------------------------------------------------------------------
# Sampler


@st.composite
def sampler_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    rows = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 40))
    width = vocab + draw(st.sampled_from([0, 0, 3]))
    top = torch.finfo(dtype).max
    scale = draw(st.sampled_from([1.0, 30.0, 1e4, top]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    if scale == top:  # the dtype maximum, and values just below it
        x = top * (1 - 0.01 * torch.rand(rows, width, generator=g, dtype=torch.float64))
    else:
        x = x * scale / 3
    if draw(st.booleans()):  # ties, as low-precision logits have
        x = x.round()
    logits = x.clamp(-top, top).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    kinds = draw(st.lists(st.sampled_from(["argmax", "random", "ignore", "range"]),
                          min_size=rows, max_size=rows))
    for r, kind in enumerate(kinds):
        if kind == "argmax":
            target[r] = logits[r, :vocab].float().argmax()
        elif kind == "ignore":
            target[r] = IGNORE
        elif kind == "range":
            target[r] = vocab + 1  # an id outside [0, V): NaN without validate
    filters = dict(
        temperature=draw(st.sampled_from([1e-3, 0.3, 1.0, 7.0])),
        top_k=draw(st.one_of(st.none(), st.integers(1, vocab + 3))),
        top_p=draw(st.sampled_from([None, 0.37, 0.83, 0.95, 1.0])),
        min_p=draw(st.sampled_from([None, 0.01, 0.2])),
    )
    return logits, target, vocab, filters


def _near_a_cut(z, vocab, top_k, top_p, min_p) -> torch.Tensor:
    """``[T]`` bool: rows whose float64 top-p cumulative mass or min-p ratio lies within 1e-6
    (relative) of the cut."""
    z = z[:, :vocab]
    _, keep = reference_sampling(z, torch.zeros(z.shape[0], dtype=torch.long), top_k=top_k,
                                 min_p=min_p)
    near = torch.zeros(z.shape[0], dtype=torch.bool)
    if min_p:
        near |= ((torch.exp(z - z.amax(-1, keepdim=True)) - min_p).abs() < 1e-6 * min_p).any(-1)
    if top_p is not None and top_p < 1:
        masked = z.masked_fill(~keep, float("-inf"))
        order = masked.sort(dim=-1, stable=True).indices
        cumulative = torch.softmax(masked, -1).gather(-1, order).cumsum(-1)
        near |= ((cumulative - (1 - top_p)).abs() < 1e-6).any(-1)
    return near


def _sampler_reference(logits, target, vocab, filters):
    """float64 ``(log q [T], d/dlogits of sum(w log q) [T, W], q [T, V], z32 [T, V], lse
    [T])`` on the op's fp32 z; 0 rows where ignored, outside or out of range."""
    tau = filters["temperature"]
    z = (logits.float() / tau).double()[:, :vocab]
    z = torch.where(torch.isfinite(z).all(-1, keepdim=True), z, 0.0)  # (only ignored rows)
    rest = {k: v for k, v in filters.items() if k != "temperature"}
    in_range = (target >= 0) & (target < vocab)
    lq, keep = reference_sampling(z, torch.where(in_range, target, 0), **rest)
    q = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
    lse = torch.logsumexp(z.masked_fill(~keep, float("-inf")), -1)
    lq = torch.where(in_range, lq, torch.where(target == IGNORE, 0.0, float("nan")))
    scored = in_range & torch.isfinite(lq)
    w = _weights(target)
    c = torch.where(scored, w / tau, 0.0).unsqueeze(1)
    onehot = torch.zeros_like(z).scatter_(1, torch.where(in_range, target, 0)[:, None], 1.0)
    grad = torch.zeros(logits.shape, dtype=torch.float64)
    grad[:, :vocab] = c * (onehot - q)
    return lq, grad, q, z, lse


def _weights(target):
    return torch.linspace(0.5, 1.5, target.numel(), dtype=torch.float64)


def _bounds(logits, lq, grad, q, z, lse, target, tau):
    """``(log q bound [T], gradient bound [T, W])`` of the module docstring."""
    u = U32
    m = z.amax(-1)
    x = (z - m[:, None]).abs()
    e_abs = (q * x).sum(-1)
    mass_err = u * (e_abs + 2)
    d_lq = 2 * (mass_err + u * torch.where(torch.isfinite(lq), lq, 0.0).abs()) + 1e-300
    c = (_weights(target) / tau).unsqueeze(1)
    rel_q = mass_err[:, None] + u * (z - lse[:, None]).abs() + 4 * u
    err = c * (q * rel_q) + 4 * u * c * q
    bound = torch.zeros(logits.shape, dtype=torch.float64)
    bound[:, :z.shape[1]] = err + 2 * u * c
    dtype = logits.dtype
    cast = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
    return d_lq, bound + cast * (grad.abs() + bound) + UNDERFLOW[dtype] * (1 + c.max())


def _check_sampler(out_lq, grad, logits, target, vocab, filters, fused_hidden=None):
    ref_lq, ref_grad, q, z, lse = _sampler_reference(logits, target, vocab, filters)
    near = _near_a_cut(z, vocab, filters["top_k"], filters["top_p"], filters["min_p"])
    rows = ~near
    d_lq, d_grad = _bounds(logits, ref_lq, ref_grad, q, z, lse, target, filters["temperature"])
    assert torch.equal(torch.isnan(out_lq), torch.isnan(ref_lq)), (out_lq, ref_lq)
    same = rows & ~torch.isnan(ref_lq)
    assert torch.equal(torch.isinf(out_lq[same]), torch.isinf(ref_lq[same])), (out_lq, ref_lq)
    fin = same & torch.isfinite(ref_lq)
    err = (out_lq[fin].double() - ref_lq[fin]).abs()
    assert bool((err <= d_lq[fin]).all()), (out_lq, ref_lq, d_lq)
    assert bool(torch.isfinite(grad).all()), grad
    if fused_hidden is None:
        unscored = ~torch.isfinite(out_lq) | (target == IGNORE)
        assert bool((grad[unscored] == 0).all()), grad
        bad = ((grad.double() - ref_grad).abs() > d_grad)[rows]
        assert not bool(bad.any()), (grad, ref_grad)
    else:  # dW of logits = hidden * weight^T (hidden [T, 1]): sum_t h_t g_t
        if bool(near.any()):
            return
        h = fused_hidden.double()
        expect = (h * ref_grad).sum(0)
        bound = (h.abs() * d_grad).sum(0) + ref_grad.shape[0] * U32 * (h * ref_grad).abs().sum(0)
        if logits.dtype != torch.float32:
            bound = bound + unit_roundoff(logits.dtype) * (expect.abs() + bound)
        assert bool(((grad.reshape(-1).double() - expect).abs() <= bound).all()), (grad, expect)


def _loss(lq, target):
    return (torch.where(torch.isfinite(lq), lq, 0.0) * _weights(target).float()).sum()


@given(case=sampler_case())
def test_sampler_matches_float64_with_finite_gradients(case):
    logits, target, vocab, filters = case
    z = logits.float() / filters["temperature"]
    leaf = logits.clone().requires_grad_()
    if bool((~torch.isfinite(z).all(-1) & (target != IGNORE)).any()):
        # logits / temperature overflows fp32 on a scored row (or its id is out of range)
        with pytest.raises(ValueError, match="temperature|target"):
            vocab_parallel_sampling_logprobs(leaf, target, vocab_size=vocab, **filters)
        return
    out = vocab_parallel_sampling_logprobs(leaf, target, vocab_size=vocab, validate=False,
                                           **filters)
    _loss(out.logprobs, target).backward()
    _check_sampler(out.logprobs, leaf.grad, logits, target, vocab, filters)


@given(case=sampler_case(), scales=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=5,
                                            max_size=5))
def test_fused_sampler_matches_float64_with_finite_gradients(case, scales):
    """The fused head on logits ``hidden * weight^T`` with hidden ``[T, 1]`` powers of two:
    the GEMM is exact, so the reference is the sampler's on those logits."""
    logits, target, vocab, filters = case
    row = logits[0]
    hidden = torch.tensor(scales[:logits.shape[0]], dtype=logits.dtype)[:, None]
    full = (hidden.double() * row.double()).to(logits.dtype)
    if not bool(torch.isfinite(full.float() / filters["temperature"]).all()):
        return  # (overflow: the unfused test covers the error)
    weight = row[:, None].clone().requires_grad_()
    out = linear_vocab_parallel_sampling_logprobs(hidden, weight, target, vocab_size=vocab,
                                                  validate=False, **filters)
    _loss(out.logprobs, target).backward()
    _check_sampler(out.logprobs, weight.grad, full, target, vocab, filters, fused_hidden=hidden)


# ---------------------------------------------------------------------------------------------
# Rollout correction

SPECIALS = [math.nan, math.inf, -math.inf]
LIMIT = 20.0


@st.composite
def rollout_case(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    old = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    rollout = old - torch.randn(rows, cols, generator=g, dtype=torch.float64) * draw(
        st.sampled_from([0.1, 1.0, 30.0]))
    mask = torch.rand(rows, cols, generator=g) < 0.75
    for t in (old, rollout):
        for _ in range(draw(st.integers(0, 3))):
            i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
            t[i, j] = draw(st.sampled_from(SPECIALS))
    if draw(st.booleans()):
        i, j = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
        old[i, j] = rollout[i, j] = -math.inf
    mode = draw(st.sampled_from(["tis", "mis", "icepop"]))
    level = "token" if mode == "icepop" else draw(st.sampled_from(["token", "sequence"]))
    cfg = RolloutCorrection(mode=mode, level=level)
    return old.to(dtype), rollout.to(dtype), mask, cfg


def _no_ratio(o, r) -> bool:
    return math.isnan(o - r) or o == math.inf or r == math.inf


def _reference_weights(old, rollout, mask, cfg):
    """Plain-Python weights and flags per the documented rules (float64)."""
    rows, cols = mask.shape
    o, r, m = old.double().tolist(), rollout.double().tolist(), mask.tolist()
    bad = [[m[i][j] and _no_ratio(o[i][j], r[i][j]) for j in range(cols)] for i in range(rows)]
    d = [[o[i][j] - r[i][j] if m[i][j] and not bad[i][j] else 0.0 for j in range(cols)]
         for i in range(rows)]
    weights = [[0.0] * cols for _ in range(rows)]
    flags = [[False] * cols for _ in range(rows)]
    for i in range(rows):
        row_sum = sum(d[i])
        row_bad = any(bad[i]) or math.isnan(row_sum)
        for j in range(cols):
            if not m[i][j]:
                continue
            x = row_sum if cfg.level == "sequence" else d[i][j]
            ratio = math.exp(min(max(x, -LIMIT), LIMIT))
            invalid = row_bad if cfg.level == "sequence" else bad[i][j]
            if cfg.mode == "tis":
                w, f = min(ratio, cfg.threshold), ratio > cfg.threshold
            else:
                inside = cfg.low <= ratio <= cfg.high
                w, f = (ratio if inside else 0.0), not inside
            weights[i][j], flags[i][j] = (0.0, True) if invalid else (w, f)
    return weights, flags, bad, d


@given(case=rollout_case())
def test_rollout_correction_matches_the_rules_without_nan(case):
    old, rollout, mask, cfg = case
    weights, flags = correction_weights(old, rollout, mask, cfg)
    ref_w, ref_f, bad, d = _reference_weights(old, rollout, mask, cfg)
    assert bool(torch.isfinite(weights).all()), weights
    tol = 8 * (U32 if old.dtype == torch.float32 else 2.0**-53)
    assert torch.allclose(weights.double(), torch.tensor(ref_w, dtype=torch.float64),
                          rtol=tol * 40, atol=0.0), (weights, ref_w)
    assert flags.tolist() == ref_f
    counted = int(mask.sum())
    invalid = sum(map(sum, bad))
    report = mismatch_diagnostics(old, rollout, mask, weights, flags, flag_name=cfg.flag_name)
    assert all(bool(torch.isfinite(v).all()) for v in report.values()), report
    assert report["rollout invalid logprobs"].tolist() == [invalid, counted]
    clamped = [min(max(x, -LIMIT), LIMIT) for row, mrow in zip(d, mask.tolist())
               for x, c in zip(row, mrow) if c]
    assert report["rollout |dlogprob|"][1] == counted - invalid
    assert math.isclose(report["rollout |dlogprob|"][0], sum(map(abs, clamped)),
                        rel_tol=1e-5, abs_tol=1e-5)
    if invalid:
        with pytest.raises(ValueError, match="no log-ratio"):
            correction_weights(old, rollout, mask, RolloutCorrection(
                mode=cfg.mode, level=cfg.level, validate=True))
    else:
        correction_weights(old, rollout, mask, RolloutCorrection(mode=cfg.mode, level=cfg.level,
                                                                 validate=True))


@given(case=rollout_case())
def test_policy_loss_with_correction_stays_finite(case):
    """The loss and its gradient stay finite whatever the old / rollout log-probs hold; a token
    without a log-ratio adds nothing through the surrogate (weight 0)."""
    old, rollout, mask, cfg = case
    lp = (old.nan_to_num(nan=-1.0, posinf=-1.0, neginf=-5.0) + 0.1).requires_grad_()
    adv = torch.linspace(-1, 1, old.numel(), dtype=old.dtype).view(old.shape)
    out = policy_loss(lp, old, adv, mask, rollout_logprobs=rollout, rollout_correction=cfg)
    out.loss_sum.backward()
    assert bool(torch.isfinite(out.loss_sum)) and bool(torch.isfinite(lp.grad).all())
    assert all(bool(torch.isfinite(v).all()) for v in out.report.values()), out.report
    _, _, bad, _ = _reference_weights(old, rollout, mask, cfg)
    bad = torch.tensor(bad)
    if cfg.level == "token":
        assert bool((lp.grad[bad] == 0).all()), lp.grad
