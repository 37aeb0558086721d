"""In every op, rows that get no gradient get exactly 0 without ``exp`` of an unbounded
value (no ``inf * 0 = NaN``), and log-probs and gradients are formed from values kept at full
precision (the logsumexp is never rounded to fp32 before ``z - logsumexp``). One process; the
float64 references are dense log-softmaxes (``_reference.py``).

Bounds: a log-prob at logits of 1e7 carries the fp32 rounding of ``z - max`` (exact here: the
values are integers) and of ``log S`` (a few u), so ``8 u`` of its magnitude bounds the fp32
result; a gradient element ``c (1[j = y] - p_j)`` carries ``exp``'s 2u and the rounding of
``log p_j`` (exact ``z - lse``, then ``lse_lo``: a few u), and one cast to the logits' dtype.
Rounding the logsumexp to fp32 first would cost 0.44 at 1e7 (its ulp there is 1).
"""

from __future__ import annotations

import pytest
import torch

from _reference import U32, reference_sampling, unit_roundoff
from megatron_vocabstats import (
    linear_vocab_parallel_cross_entropy,
    linear_vocab_parallel_sampling_logprobs,
    linear_vocab_parallel_stats,
    linear_vocab_parallel_topk_logprobs,
    vocab_parallel_cross_entropy,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_stats,
    vocab_parallel_topk_logprobs,
)

IGNORE = -100


def _topk_lp(x, t, **kw):
    return vocab_parallel_topk_logprobs(x, t.clamp(min=0).unsqueeze(-1), mask=t != IGNORE,
                                        **kw).squeeze(-1)


def _linear_topk_lp(h, w, t, **kw):
    return linear_vocab_parallel_topk_logprobs(h, w, t.clamp(min=0).unsqueeze(-1),
                                               mask=t != IGNORE, **kw).squeeze(-1)


# Every op that returns a log-prob of a target: (logits op, fused op), each ``(x, t, **kw)``.
OPS = {
    "stats": (lambda x, t, **kw: vocab_parallel_stats(x, t, entropy="off", **kw).logprobs,
              lambda h, w, t, **kw: linear_vocab_parallel_stats(h, w, t, entropy="off",
                                                                **kw).logprobs),
    "cross_entropy": (lambda x, t, **kw: -vocab_parallel_cross_entropy(x, t, **kw),
                      lambda h, w, t, **kw: -linear_vocab_parallel_cross_entropy(h, w, t, **kw)),
    "forward_grad": (None, lambda h, w, t, **kw: -linear_vocab_parallel_cross_entropy(
        h, w, t, loss_weights=_scored_weights(t, w.shape[0]), **kw)),
    "topk_logprobs": (_topk_lp, _linear_topk_lp),
    "sampling": (lambda x, t, **kw: vocab_parallel_sampling_logprobs(x, t, **kw).logprobs,
                 lambda h, w, t, **kw: linear_vocab_parallel_sampling_logprobs(h, w, t,
                                                                               **kw).logprobs),
}
WEIGHTS = (0.5, 1.5)


def _weights(t):
    return torch.linspace(*WEIGHTS, t.numel(), dtype=torch.float64).view(t.shape)


def _scored_weights(t, vocab):
    """The loss weights of the forward-gradient mode: the test's weights at ids in [0, V)."""
    return torch.where((t >= 0) & (t < vocab), _weights(t), 0.0).float()


def _reference(x, t, temperature=1.0, **filters):
    """float64 ``log p(t)`` (``log q(t)`` with sampler filters; 0 where ignored, NaN at an id
    outside [0, V), -inf outside the kept set) of the op's fp32 ``z = x / temperature`` and
    the gradient w.r.t. x of ``sum(w * logp)`` over the rows where it is finite (the others:
    exactly 0)."""
    z = (x.float() / temperature).double().requires_grad_()
    valid = (t >= 0) & (t < z.shape[-1])
    lp, _ = reference_sampling(z, torch.where(valid, t, 0), **filters)
    scored = valid & torch.isfinite(lp)
    (torch.where(scored, lp, 0.0) * _weights(t)).sum().backward()
    lp = torch.where(valid, lp, torch.where(t == IGNORE, 0.0, float("nan")))
    return lp.detach(), z.grad / temperature


def _check(op, fused, dtype, z, t, **kw):
    """The op (on logits, or fused with hidden = 1 and weight = z.T) against :func:`_reference`:
    log-probs within 8u of their magnitude, gradients within 8u of the weight plus one cast."""
    filters = {k: kw.pop(k) for k in ("top_k", "top_p", "min_p") if k in kw}
    x = z.to(dtype)
    ref_lp, ref_grad = _reference(x, t, kw.get("temperature", 1.0), **filters)
    if fused:  # logits = hidden @ weight.T = x exactly: hidden [T, 1] of ones, weight [V, 1]
        rows = x.shape[0]
        h = torch.ones(rows, 1, dtype=dtype, requires_grad=True)
        w = x[0].reshape(-1, 1).clone().requires_grad_()
        assert bool((x == x[0]).all()), "the fused case needs equal rows"
        lp = OPS[op][1](h, w, t, **filters, **kw)
        leaf = w
    else:
        leaf = x.clone().requires_grad_()
        lp = OPS[op][0](leaf, t, **filters, **kw)
    (torch.where(torch.isfinite(lp), lp, 0.0) * _weights(t)).sum().backward()
    grad = leaf.grad
    if fused:
        ref_grad = ref_grad.sum(0).reshape(-1, 1)  # dW = g.T @ hidden: the rows' sum
    fin = torch.isfinite(ref_lp)
    assert torch.equal(torch.isnan(lp), torch.isnan(ref_lp)), (op, lp, ref_lp)
    assert torch.equal(torch.isinf(lp), torch.isinf(ref_lp)), (op, lp, ref_lp)
    err = (lp[fin].double() - ref_lp[fin]).abs()
    assert bool((err <= 8 * U32 * ref_lp[fin].abs().clamp(min=1)).all()), (op, lp, ref_lp)
    assert bool(torch.isfinite(grad).all()), (op, grad)
    bound = 8 * U32 * WEIGHTS[1] * x.shape[0] + unit_roundoff(dtype) * ref_grad.abs()
    assert bool(((grad.double() - ref_grad).abs() <= bound).all()), (op, grad, ref_grad)
    return lp, grad


def _large_rows(rows=3):
    return torch.tensor([[1e7, 1e7 - 1, 1e7 - 2, 1e7 - 3]] * rows)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_large_logits_keep_their_digits(op, fused):
    """Logits near 1e7: log p(1) = -1.4402, p = (0.644, 0.237, 0.087, 0.032) (was: -1.0 and
    p = exp(z - 1e7) for the sampler; the same gradient for every op)."""
    if OPS[op][fused] is None:
        pytest.skip("no such op")
    t = torch.tensor([1, 0, 3])
    _check(op, fused, torch.float32, _large_rows(), t)


@pytest.mark.parametrize("op", sorted(OPS))
def test_fp16_maxima_keep_their_digits(op):
    """Eight fp16 65504 logits (top_p=0.9 keeps all eight: log q = -log 8; was -2.078125 for the
    sampler), gradient 1/8 per column within fp16 rounding (the ulp of the fp32 logsumexp at
    65504 is 0.004: a 0.2% error in p that fp16 shows)."""
    if OPS[op][0] is None:
        pytest.skip("no such op")
    z = torch.full((2, 8), 65504.0)
    kw = dict(top_p=0.9) if op == "sampling" else {}
    lp, _ = _check(op, False, torch.float16, z, torch.tensor([0, 5]), **kw)
    assert torch.equal(lp, torch.full((2,), -torch.log(torch.tensor(8.0)).item())), lp


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_rows_without_gradient_get_exact_zeros(op, fused):
    """Rows that must get no gradient (an ignored target; an id outside [0, V) with
    validate=False; for the sampler a target outside the kept set) next to logits far above
    88.7 (``exp`` overflows fp32 there): every gradient finite, those rows exactly 0, the others
    equal to float64. Was ``[[nan, -0, -0]]`` for the sampler; through the fused sampler the NaN
    reached dX and dW."""
    if OPS[op][fused] is None:
        pytest.skip("no such op")
    z = torch.tensor([[100.0, 0.0, 1.0, 3.0]] * 4)
    t = torch.tensor([IGNORE, 0, 9, 3])  # 9: outside [0, V) (validate off)
    kw = dict(top_k=2) if op == "sampling" else {}  # target 3 is kept, 0 is: fine; see below
    _check(op, fused, torch.float32, z, t, validate=False, **kw)
    if op == "sampling":
        t = torch.tensor([IGNORE, 1, 2, 0])  # 1 and 2 are outside the top-2 {0, 3}
        lp, _ = _check(op, fused, torch.float32, z, t, validate=False, top_k=2)
        assert bool(torch.isneginf(lp[1:3]).all()), lp


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_sampler_at_a_small_temperature_has_finite_gradients(fused):
    """Ordinary logits at temperature 1e-3 (z up to ~3000): ignored rows and targets outside a
    top-k of 2 get 0, the rest the float64 gradient (was NaN; fused: NaN in dX and a row of
    dW)."""
    g = torch.Generator().manual_seed(0)
    row = torch.randn(1, 9, generator=g) * 3
    z = row.expand(5, 9).clone()
    order = row[0].argsort(descending=True)
    t = torch.stack([order[0], order[5], torch.tensor(IGNORE), order[1], order[8]])
    lp, grad = _check("sampling", fused, torch.float32, z, t, temperature=1e-3, top_k=2)
    assert bool(torch.isneginf(lp[[1, 4]]).all()), lp
    if fused:
        h = torch.ones(5, 1, requires_grad=True)
        w = z[0].reshape(-1, 1).clone().requires_grad_()
        out = linear_vocab_parallel_sampling_logprobs(h, w, t, temperature=1e-3, top_k=2)
        out.logprobs.masked_fill(~torch.isfinite(out.logprobs), 0).sum().backward()
        assert bool(torch.isfinite(h.grad).all()) and bool(torch.isfinite(w.grad).all())
        assert bool((h.grad[[1, 2, 4]] == 0).all()), h.grad
