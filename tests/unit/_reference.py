"""Float64, single-process, full-vocabulary references for the tests, and the error bounds the
tests compare against them with.

The bounds are first-order rounding-error bounds of the op's own fp32 arithmetic
(``docs/numerics.md``, "Test tolerances"): unit roundoff ``u`` per elementary operation,
Higham's ``gamma_n = n u / (1 - n u)`` for a sum of n terms in any order, ``LIBM_ULPS`` ulps for
``exp``/``log``, the condition of each quantity (``E_p|z - max z|``, ``max |z|`` through the
temperature and the logits' rounding) evaluated on the float64 reference, and one rounding of the
logits' dtype where a result is cast to it. Nothing in them is tuned to observed errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Unit roundoff (half an ulp of 1) per dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
U32 = UNIT_ROUNDOFF[torch.float32]
# Half the smallest subnormal: the absolute error of rounding a tiny value to the dtype.
UNDERFLOW = {
    torch.float32: 2.0**-150,
    torch.bfloat16: 2.0**-134,
    torch.float16: 2.0**-25,
}
# Accuracy of fp32 exp and log in units of u: torch's CPU kernels (SLEEF *_u10) and CUDA's
# expf/logf are within 1 ulp, i.e. a relative error of at most 2u.
LIBM_ULPS = 2.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, u: float = U32) -> float:
    """Higham's ``gamma_n``: relative error bound of a sum of ``n + 1`` same-signed terms (any
    order), or absolute error over ``sum |x_i|`` for mixed signs; 0 for ``n <= 0``."""
    if n <= 0:
        return 0.0
    assert n * u < 1
    return n * u / (1 - n * u)


def reference_stats(logits_full, target, *, vocab_size=None, temperature=1.0, ignore_index=-100,
                    label_smoothing=0.0):
    """``(logprobs, entropy, logsumexp)`` in float64 from the full ``[..., V_padded]`` logits.

    Differentiable w.r.t. ``logits_full`` (pass a float64 leaf to get reference gradients).
    Ignored positions give logprob 0 and entropy 0, as the op documents.
    """
    v = vocab_size or logits_full.shape[-1]
    z = logits_full.double()[..., :v] / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # p * where(...), not where(p > 0, p * logp, 0): the latter's backward is 0 * -inf = NaN.
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    lse = torch.logsumexp(z, dim=-1)
    if target is None:
        return None, ent, lse
    valid = target != ignore_index
    lp = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    if label_smoothing:
        lp = (1 - label_smoothing) * lp + label_smoothing * logp.mean(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero), lse


def reference_topk(logits_full, k, *, vocab_size=None, temperature=1.0):
    """``(logprobs [..., k], indices [..., k])`` in float64: the k largest log-probs over the real
    vocabulary, ties (equal input logits) broken by the lowest id."""
    v = vocab_size or logits_full.shape[-1]
    z = logits_full.double()[..., :v] / temperature
    logp = torch.log_softmax(z, dim=-1)
    # Ranked by z, not log p (z - lse can round distinct tiny z to one value); a stable sort keeps
    # equal values in id order.
    order = torch.sort(-z, dim=-1, stable=True).indices[..., :k]
    return logp.gather(-1, order), order


# ---------------------------------------------------------------------------------------------
# Error bounds


@dataclass(frozen=True)
class StatsBounds:
    """Per-row (``[T]``) and per-element (``[T, V]``) error bounds of one call, float64.

    ``logsumexp``, ``entropy``: bounds of the op's outputs; ``logp``: bound of the op's fp32
    ``log p_j`` at every real column (forward log-probs at any id, and the ``log p`` the backward
    recomputes); ``log_s``: of ``log sum_j exp(z_j - max z)``. The float64 reference quantities
    they were derived from ride along for :func:`stats_grad_bound`.
    """

    logsumexp: torch.Tensor
    entropy: torch.Tensor
    logp: torch.Tensor
    log_s: torch.Tensor
    dz: torch.Tensor
    z: torch.Tensor
    p: torch.Tensor
    logp_ref: torch.Tensor
    ent_ref: torch.Tensor
    lse_ref: torch.Tensor
    width: int


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def stats_bounds(z: torch.Tensor, *, dz: torch.Tensor | None = None, width: int | None = None,
                 parts: int = 1, exp2: bool = False) -> StatsBounds:
    """Error bounds of the op's logsumexp, entropy and log-probs of the tempered logits ``z``.

    Args:
        z: float64 ``[T, V]``, the exact tempered logits of the real columns (``x / tau`` of the
            values the op is given; -inf allowed, never a whole row).
        dz: float64 ``[T, V]``, the absolute error of the fp32 logits the op works with versus
            ``z`` (``u |z|`` from the temperature division, plus the rounding of the logits for
            the fused op); None for exact (tau = 1).
        width: number of columns the op sums over (the padded shard width); default V.
        parts: shards or batch-invariant blocks merged per row (1: none).
        exp2: exp computed as ``exp2(x * log2 e)`` (the Triton kernels): the product and the fp32
            constant each round, relative ``2 u |x|`` more per exp.

    Derivation (first order in u; x_j = z_j - max z <= 0, p the softmax, H the entropy,
    S = sum_j e^{x_j} >= 1, E_p the mean under p):
      rel(S)  <= u (E_p|x| + LIBM) + gamma_{W-1}        x_j rounding, exp, the sum
      d log S <= rel(S) + LIBM u log S                  and the log
      rel(U)  <= u (E_p[x^2] / E_p|x| + LIBM + 2) + gamma_{W-1}   U = sum_j e^{x_j} x_j (one sign)
      d H     <= d log S + E_p|x| (rel(U) + rel(S) + u) + u H      H = log S - U / S
      d lse   <= d log S + u |lse|                      lse = max z + log S
      d logp_j <= d lse + u |x_j| + u |log p_j|         (z_j - max z) - log S, or z_j - lse
    plus the propagated input error: sum_j p_j dz_j for lse, dz_j + sum_k p_k dz_k for log p_j,
    sum_j p_j |log p_j + H| dz_j for H. Merging ``parts`` partial sums (shards or blocks) adds
    gamma_{parts-1} + (LIBM + 4) u plus the rescaling exp(m_r - m) to rel(S) and rel(U).
    """
    u = U32
    z = z.double()
    num_cols = z.shape[-1]
    width = width or num_cols
    live = torch.isfinite(z)
    lse = torch.logsumexp(z, dim=-1)
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    x = _finite(z - z.amax(dim=-1, keepdim=True))
    ent = -(p * _finite(logp)).sum(-1)
    a1 = (p * x.abs()).sum(-1)
    a2 = (p * x * x).sum(-1)
    log_s = torch.log((x.exp() * live).sum(-1))
    a2_over_a1 = torch.where(a1 > 0, a2 / torch.where(a1 > 0, a1, 1.0), 0.0)
    rel_s = u * (a1 + LIBM_ULPS) + gamma(width - 1)
    rel_u = u * (a2_over_a1 + LIBM_ULPS + 2) + gamma(width - 1)
    if parts > 1:
        rel_s = rel_s + gamma(parts - 1) + (LIBM_ULPS + 4) * u + u * a1
        rel_u = rel_u + gamma(parts - 1) + (LIBM_ULPS + 4) * u + u * a2_over_a1
    if exp2:
        rel_s = rel_s + 2 * u * a1
        rel_u = rel_u + 2 * u * a2_over_a1
    d_log_s = rel_s + LIBM_ULPS * u * log_s
    d_h = d_log_s + a1 * (rel_u + rel_s + u) + u * ent.abs()
    d_lse = d_log_s + u * lse.abs()
    d_logp = d_lse.unsqueeze(-1) + u * x.abs() + u * _finite(logp).abs()
    if exp2:  # the gradient's p = exp2((z - lse) log2 e)
        d_logp = d_logp + 2 * u * _finite(logp).abs()
    if dz is not None:
        dz = torch.where(live, dz.double(), 0.0)
        p_dz = (p * dz).sum(-1)
        d_lse = d_lse + p_dz
        d_h = d_h + (p * (_finite(logp) + ent.unsqueeze(-1)).abs() * dz).sum(-1)
        d_logp = d_logp + dz + p_dz.unsqueeze(-1)
    else:
        dz = torch.zeros_like(z)
    return StatsBounds(logsumexp=d_lse, entropy=d_h, logp=d_logp, log_s=d_log_s, dz=dz, z=z, p=p,
                       logp_ref=logp, ent_ref=ent, lse_ref=lse, width=width)


def temperature_dz(z: torch.Tensor, temperature: float) -> torch.Tensor | None:
    """Input error of the op's fp32 ``x / tau`` (one rounding, relative u or, for a subnormal
    result, absolute 2^-150; exact for tau = 1)."""
    if temperature == 1.0:
        return None
    return U32 * _finite(z.double()).abs() + UNDERFLOW[torch.float32]


def smoothed_logprob_bound(b: StatsBounds, target: torch.Tensor, eps: float) -> torch.Tensor:
    """Bound of the op's ``(1 - eps) log p_y + eps mean_j log p_j`` (``[T]``; plain ``log p_y``
    for eps = 0). ``target``: ``[T]`` ids in ``[0, V)``.

    The smoothing mean is ``(sum_j z_j / V - max z) - log S``: its sum of V mixed-sign terms costs
    ``gamma_{V-1} sum_j |z_j| / V`` (the ``max |z|`` condition), then one rounding per operation;
    the input error propagates through ``q - p`` (``q`` the smoothed one-hot).
    """
    u = U32
    y = target.unsqueeze(-1)
    d_lp = b.logp.gather(-1, y).squeeze(-1)
    if not eps:
        return d_lp
    v = b.z.shape[-1]
    lp = b.logp_ref.gather(-1, y).squeeze(-1)
    zf = _finite(b.z)
    zsum = zf.sum(-1)
    m = zf.amax(-1)
    mean = b.logp_ref.mean(-1)
    d_mean = (gamma(v - 1) * zf.abs().sum(-1) / v + u * (zsum / v).abs() + u * (zsum / v - m).abs()
              + b.log_s + u * _finite(mean).abs())
    # Input error through q - p: d_lp holds (dz_y + sum_j p_j dz_j), weighted 1 - eps; the mean's
    # sensitivity 1/V - p_j adds eps (sum_j dz_j / V + sum_j p_j dz_j).
    d_in = eps * (b.dz.sum(-1) / v + (b.p * b.dz).sum(-1))
    result = (1 - eps) * lp + eps * mean
    return ((1 - eps) * d_lp + eps * d_mean + d_in
            + 2 * u * ((1 - eps) * _finite(lp).abs() + eps * _finite(mean).abs())
            + u * _finite(result).abs())


def _cast_bound(grad_ref: torch.Tensor, err32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Add the final rounding of an fp32 gradient to ``dtype`` (none for fp32)."""
    if dtype == torch.float32:
        return err32 + UNDERFLOW[torch.float32]
    return err32 + unit_roundoff(dtype) * (grad_ref.abs() + err32) + UNDERFLOW[dtype]


def stats_grad_bound(b: StatsBounds, grad_ref: torch.Tensor, *, c_lp: torch.Tensor | None,
                     c_h: torch.Tensor | None, target: torch.Tensor | None, eps: float,
                     scaled: bool, dtype: torch.dtype, d_entropy: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Elementwise bound ``[T, V]`` of the op's logits gradient
    ``c_lp (q_j - p_j) - c_h p_j (log p_j + H)`` (``c = upstream / tau``, 0 at ignored rows).

    ``scaled``: the coefficients were multiplied by ``1 / tau`` in fp32 (two roundings, tau != 1).
    ``d_entropy``: the entropy bound to use (default ``b.entropy``). The op computes
    ``p (-c_h log p - (c_h H + c_lp))`` in fp32, adds ``c_lp eps / V`` on real columns and
    ``c_lp (1 - eps)`` at the target, and casts once to ``dtype``; each step's rounding and the
    bounds of ``log p`` and ``H`` from :func:`stats_bounds` propagate to first order. Underflow of
    ``p`` in fp32 adds an absolute ``2^-149 (1 + |B|)``.
    """
    u = U32
    rho = 2 * u if scaled else 0.0
    p, logp = b.p, _finite(b.logp_ref)
    d_logp = b.logp
    rel_p = d_logp + LIBM_ULPS * u
    zeros = torch.zeros(p.shape[:-1], dtype=torch.float64)
    c_lp = zeros if c_lp is None else c_lp.double()
    if c_h is not None:
        c_h = c_h.double().unsqueeze(-1)
        d_h = (b.entropy if d_entropy is None else d_entropy).unsqueeze(-1)
        h = b.ent_ref.unsqueeze(-1)
        cl = c_lp.unsqueeze(-1)
        a = -c_h * logp
        d_a = c_h.abs() * (d_logp + (u + rho) * logp.abs())
        shift = c_h * h + cl
        d_shift = (c_h.abs() * (d_h + (u + rho) * h.abs()) + rho * cl.abs()
                   + u * shift.abs())
        big_b = a - shift
        d_b = d_a + d_shift + u * big_b.abs()
        err = p * d_b + big_b.abs() * p * (rel_p + u)
    else:
        big_b = -c_lp.unsqueeze(-1).expand_as(p)
        err = p * big_b.abs() * (rel_p + u + rho)
    err = err + 2 * UNDERFLOW[torch.float32] * (1 + big_b.abs())
    partial = p * big_b.abs()
    if target is not None:
        cl = c_lp.abs().unsqueeze(-1)
        if eps:
            uniform = cl * eps / p.shape[-1]
            err = err + uniform * (2 * u + rho)
            partial = partial + uniform
        hit = torch.zeros_like(p).scatter_(-1, target.unsqueeze(-1), cl * (1 - eps))
        err = err + hit * ((2 * u if eps else 0.0) + rho)
        partial = partial + hit
        err = err + 2 * u * partial
    return _cast_bound(grad_ref, err, dtype)


def picked_grad_bound(b: StatsBounds, grad_ref: torch.Tensor, *, g: torch.Tensor,
                      indices: torch.Tensor, scaled: bool, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound ``[T, V]`` of the gradient of ``sum_k g_k log p(i_k)``:
    ``sum_k g_k 1[j = i_k] - p_j sum_k g_k`` (all over tau; ``g`` the ``[T, k]`` upstream, 0 at
    masked rows).

    The op scales ``g`` by ``1 / tau`` (``rho = 2u``), sums the k coefficients (``gamma_{k-1}``),
    computes ``-c p`` (the :func:`stats_grad_bound` terms) and scatter-adds each ``g_k``
    (``gamma_{d}`` over the d terms meeting at one column), then casts once.
    """
    u = U32
    rho = 2 * u if scaled else 0.0
    g = g.double()
    k = g.shape[-1]
    c_abs = g.abs().sum(-1, keepdim=True)
    c = g.sum(-1, keepdim=True)
    p = b.p
    rel_p = b.logp + LIBM_ULPS * u
    err = p * (c.abs() * (rel_p + u) + c_abs * (rho + gamma(k - 1)))
    err = err + 2 * UNDERFLOW[torch.float32] * (1 + c.abs())
    hits = torch.zeros_like(p).scatter_add_(-1, indices, g.abs())
    count = torch.zeros_like(p).scatter_add_(-1, indices, torch.ones_like(g))
    err = err + rho * hits + (count * u / (1 - count * u)) * (p * c.abs() + hits)
    return _cast_bound(grad_ref, err, dtype)


def matmul_bound(a_abs: torch.Tensor, b_abs: torch.Tensor, n: int, out_dtype: torch.dtype,
                 out_ref: torch.Tensor) -> torch.Tensor:
    """Bound of a matmul with fp32 accumulation over ``n`` products, rounded to ``out_dtype``:
    ``gamma_n |A| |B| + u_out |AB|`` (``a_abs @ b_abs`` given as float64 magnitudes)."""
    err = gamma(n) * (a_abs @ b_abs)
    if out_dtype != torch.float32:
        err = err + unit_roundoff(out_dtype) * (out_ref.abs() + err) + UNDERFLOW[out_dtype]
    return err


def linear_logits_error(hidden: torch.Tensor, weight: torch.Tensor, vocab: int,
                        temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, dz)`` of the fused LM head: ``z`` the float64 ``[T, vocab]`` exact product
    ``hidden @ weight.T / temperature`` and ``dz`` the bound on the op's fp32 z, the input error
    of :func:`stats_bounds`: the GEMM (fp32 accumulation over H products, ``gamma_H |h| |w|``,
    whatever the order: cuBLAS or ``tl.dot`` tiles), rounded once to the model dtype, then the
    temperature division (one more u)."""
    dtype, hidden_size = hidden.dtype, hidden.shape[-1]
    h_abs, w_abs = hidden.double().abs().reshape(-1, hidden_size), weight.double().abs()
    logits = hidden.double().reshape(-1, hidden_size) @ weight.double().T
    acc = gamma(hidden_size) * (h_abs @ w_abs.T)[:, :vocab]
    u_d = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
    dz = (acc + u_d * (logits[:, :vocab].abs() + acc) + UNDERFLOW[dtype]) / temperature
    z = logits[:, :vocab] / temperature
    if temperature != 1.0:
        dz = dz + U32 * z.abs()
    return z, dz


def linear_grad_bounds(e_g: torch.Tensor, g_ref: torch.Tensor, hidden: torch.Tensor,
                       weight: torch.Tensor, dx_ref: torch.Tensor,
                       dw_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds of the fused head's ``dX = g W`` ``[T, H]`` and ``dW = g^T h`` ``[vocab, H]`` from
    the bound ``e_g`` of its logits gradient (``[T, vocab]``, as :func:`stats_grad_bound` gives
    it) and the float64 one ``g_ref``: the error carried through each GEMM plus the GEMM's own
    (:func:`matmul_bound`, in the model dtype)."""
    dtype, hidden_size = hidden.dtype, hidden.shape[-1]
    vocab, tokens = g_ref.shape[1], g_ref.shape[0]
    h_abs = hidden.double().abs().reshape(-1, hidden_size)
    w_real = weight.double().abs()[:vocab]
    dx = e_g @ w_real + matmul_bound(g_ref.abs(), w_real, weight.shape[0], dtype, dx_ref)
    dw = e_g.T @ h_abs + matmul_bound(g_ref.abs().T, h_abs, tokens, dtype, dw_ref)
    return dx, dw


def sum_bound(values: torch.Tensor, errors: torch.Tensor) -> float:
    """Bound of an fp32 sum of ``values`` (float64 reference) each known to ``errors``.

    Infinite values make the sum infinite, which :func:`assert_within` compares exactly; they
    are left out here."""
    values, errors = _finite(values.detach()), _finite(errors.detach())
    return float(errors.sum() + gamma(max(values.numel() - 1, 0)) * values.abs().sum())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str):
    """``|actual - expected| <= bound`` elementwise; equal infinities (and NaN nowhere) pass.

    The message gives the worst element's error and bound, so a failure says by how much.
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not torch.isnan(actual).any(), f"{what}: NaN in the result"
    same_inf = torch.isinf(expected) & (actual == expected)
    err = torch.where(same_inf, 0.0, (actual - expected).abs())
    over = ~(err <= bound) & ~same_inf
    if bool(over.any()):
        i = int(torch.nonzero(over.reshape(-1))[0, 0])
        ratio = (err / bound.clamp(min=1e-300)).reshape(-1)
        worst = int(ratio.argmax())
        raise AssertionError(
            f"{what}: {int(over.sum())} of {over.numel()} elements over the bound; first at "
            f"flat {i}: got {actual.reshape(-1)[i].item()!r}, expected "
            f"{expected.reshape(-1)[i].item()!r}, error {err.reshape(-1)[i].item():.3g} > bound "
            f"{bound.reshape(-1)[i].item():.3g}; worst error/bound "
            f"{ratio[worst].item():.3g} at flat {worst}")


__all__ = [
    "LIBM_ULPS", "U32", "UNDERFLOW", "UNIT_ROUNDOFF", "StatsBounds", "assert_within", "gamma",
    "matmul_bound", "picked_grad_bound", "reference_stats", "reference_topk",
    "smoothed_logprob_bound", "stats_bounds", "stats_grad_bound", "sum_bound",
    "temperature_dz", "unit_roundoff",
]


def reference_sampling(logits_full, target, *, vocab_size=None, temperature=1.0, top_k=None,
                       top_p=None, min_p=None):
    """``(log q(target), kept [..., V])`` in float64 under vLLM v1's sampler: temperature, min-p,
    top-k (ties at the k-th value kept), top-p as vLLM's ``apply_top_k_top_p`` does it (a stable
    ascending sort, tokens dropped while the cumulative probability is ``<= 1 - top_p``, the
    last one always kept: a tie on the boundary keeps its highest ids), q the softmax over the
    kept set."""
    v = vocab_size or logits_full.shape[-1]
    z = logits_full.double()[..., :v] / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p:
        keep &= torch.exp(z - z.max(-1, keepdim=True).values) >= min_p
    if top_k is not None and top_k < v:
        kth = z.masked_fill(~keep, float("-inf")).topk(top_k, -1).values[..., -1:]
        keep &= z >= kth
    if top_p is not None and top_p < 1:
        masked = z.masked_fill(~keep, float("-inf"))
        order = masked.sort(dim=-1, stable=True).indices
        cumulative = torch.softmax(masked, -1).gather(-1, order).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False
        keep &= ~torch.zeros_like(drop).scatter(-1, order, drop)
    lq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    return lq.gather(-1, target.unsqueeze(-1)).squeeze(-1), keep
