"""The logits gradient of the statistics, one chunk at a time.

Pure tensor math like :mod:`._math`. With upstream ``g_lp``, ``g_H`` the gradient w.r.t. z is
``g_lp (q_j - p_j) - g_H p_j (log p_j + H)``, q the (smoothed) one-hot target, the logsumexp
kept as an fp32 pair (``docs/numerics.md``, "Gradients w.r.t. z").
"""

from __future__ import annotations

import torch

from ._layout import ShardLayout
from .options import LOGP_MIN


def chunk_grad(
    z: torch.Tensor,
    scratch: torch.Tensor,
    out: torch.Tensor,
    *,
    lse: torch.Tensor,
    lse_lo: torch.Tensor | None = None,
    ent: torch.Tensor | None,
    coef_lp: torch.Tensor | None,
    coef_h: torch.Tensor | None,
    index: torch.Tensor | None,
    owned: torch.Tensor | None,
    valid: torch.Tensor | None,
    layout: ShardLayout,
    label_smoothing: float,
) -> None:
    """Write the gradient of ``sum(g_lp * logprobs + g_H * entropy)`` for one chunk into ``out``.

    ``z``: [n, W] fp32 from :func:`load_chunk` (overwritten); ``out``: the chunk's gradient rows
    in the logits dtype, cast once from the fp32 ``p (-coef_h (log p + H) - coef_lp)`` plus the
    target and smoothing terms; ``log p = (z - lse) - lse_lo`` (the pair of :func:`split_lse`,
    ``lse_lo`` optional). ``coef_lp``/``coef_h``: :func:`grad_coefficients` (None: that output
    gets no gradient). ``lse`` must be finite at ignored rows (:func:`finite_lse`); rows with
    ``valid`` False are zeroed at the end (NaN or +inf logits there included)."""
    n = z.shape[0]
    logp = z.sub_(lse.unsqueeze(1))
    if lse_lo is not None:
        logp.sub_(lse_lo.unsqueeze(1))
    p = torch.exp(logp, out=scratch[:n])
    if coef_h is not None:
        # Where p == 0 (masked or padding columns, log p ~ Z_FLOOR) keep coef_h * log p finite,
        # or p * inf = NaN for large upstream gradients; no column with p > 0 is changed.
        logp.clamp_(min=LOGP_MIN)
        shift = coef_h * ent if coef_lp is None else coef_h * ent + coef_lp
        grad = p.mul_(logp.mul_(coef_h.neg().unsqueeze(1)).sub_(shift.unsqueeze(1)))
    else:
        grad = p.mul_(coef_lp.neg().unsqueeze(1))
    if coef_lp is not None and index is not None:
        if label_smoothing > 0.0:
            uniform = coef_lp * (label_smoothing / layout.vocab_size)
            grad[:, : layout.real_width].add_(uniform.unsqueeze(1))
        hit = torch.where(owned, coef_lp * (1.0 - label_smoothing), 0.0)
        grad.scatter_add_(1, index.unsqueeze(1), hit.unsqueeze(1))
    if valid is not None:
        grad.masked_fill_(~valid.unsqueeze(1), 0.0)
    out.copy_(grad)


def grad_coefficients(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    valid: torch.Tensor | None,
    temperature: float,
    in_range: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(coef_lp, coef_h)`` of :func:`chunk_grad`: the flattened upstream gradients as fp32
    ``g / tau``, exactly 0 where ``valid`` is False (``coef_lp`` also where ``in_range`` is False:
    a NaN logprob passes no gradient); None for a None upstream gradient."""
    keep = valid.float() / temperature if valid is not None else 1.0 / temperature
    keep_lp = keep if in_range is None else keep * in_range
    coef_lp = grad_logprobs.reshape(-1).float() * keep_lp if grad_logprobs is not None else None
    coef_h = grad_entropy.reshape(-1).float() * keep if grad_entropy is not None else None
    return coef_lp, coef_h


def split_lse(m: torch.Tensor, log_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, lse_lo)`` of fp32 ``[T]`` ``m`` and ``log_s``: ``lse`` bitwise ``m + log_s`` and
    its exact rounding error ``lse_lo`` (Knuth's TwoSum; 0 where not finite), so that
    ``log p = (z - lse) - lse_lo`` does not lose half an ulp of ``lse`` (``docs/numerics.md``)."""
    lse = m + log_s
    b = lse - m
    lo = (m - (lse - b)) + (log_s - b)
    return lse, torch.where(torch.isfinite(lo), lo, 0.0)


def finite_lse(lse: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``lse`` with 0 for non-finite values at rows not ``valid``: :func:`chunk_grad`'s zero
    gradient there must not be ``0 * NaN``."""
    if valid is None:
        return lse
    return torch.where(valid | torch.isfinite(lse), lse, 0.0)
