"""The logits gradient of the statistics, one chunk at a time.

Pure tensor math like :mod:`._math`: no collectives, never writes to the caller's tensors (only
to the scratch buffers handed in). With upstream ``g_lp``, ``g_H`` the gradient w.r.t. z is
``g_lp (q_j - p_j) - g_H p_j (log p_j + H)`` where q is the (smoothed) one-hot target, the
logsumexp kept as an fp32 pair (``docs/numerics.md``, "Gradients w.r.t. z").
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

    ``z``: [n, W] fp32 chunk from :func:`load_chunk` (overwritten); ``out``: the chunk's rows of
    the gradient, in the logits dtype. ``lse`` (and ``lse_lo``, optional): the row's logsumexp
    as the fp32 pair of :func:`split_lse`, so that ``log p = (z - lse) - lse_lo`` keeps the
    digits that rounding ``lse`` alone to fp32 loses at large logits (``z - lse`` is exact for
    the columns near the maximum). ``coef_lp = g_lp / tau`` and ``coef_h = g_H / tau`` per row,
    already 0 at ignored rows (whose gradient is then exactly 0), or None when that output gets no
    gradient. ``lse`` must be finite at ignored rows, and rows with ``valid`` False are zeroed
    at the end (NaN or +inf logits there included). One fp32 pass computes
    ``p * (-coef_h (log p + H) - coef_lp)``; the target and smoothing terms are added in fp32
    before the single cast to ``out``.
    """
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
    """``(coef_lp, coef_h)`` of :func:`chunk_grad` from upstream gradients shaped like the tokens.

    Flattened fp32 ``g / tau``, exactly 0 at rows where ``valid`` is False (their gradient is then
    exactly 0); None where that upstream gradient is None. ``coef_lp`` is also 0 where
    ``in_range`` (:func:`target_in_range`) is False: a NaN logprob passes no gradient.
    """
    keep = valid.float() / temperature if valid is not None else 1.0 / temperature
    keep_lp = keep if in_range is None else keep * in_range
    coef_lp = grad_logprobs.reshape(-1).float() * keep_lp if grad_logprobs is not None else None
    coef_h = grad_entropy.reshape(-1).float() * keep if grad_entropy is not None else None
    return coef_lp, coef_h


def split_lse(m: torch.Tensor, log_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, lse_lo)``: the logsumexp ``m + log_s`` (fp32 ``[T]`` each) as its fp32 rounding
    ``lse`` and the rounding error ``lse_lo = (m + log_s) - lse``, exact (Knuth's TwoSum; 0
    where ``lse`` is not finite). ``lse`` is bitwise ``m + log_s``; the pair carries the
    logsumexp to twice the precision for the gradient's ``log p = (z - lse) - lse_lo``, which
    would otherwise be off by up to half an ulp of ``lse``: 0.5 nats at logits of 1e7, 0.002
    at fp16's 65504."""
    lse = m + log_s
    b = lse - m
    lo = (m - (lse - b)) + (log_s - b)
    return lse, torch.where(torch.isfinite(lo), lo, 0.0)


def finite_lse(lse: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``lse`` with non-finite values at rows that are not ``valid`` replaced by 0.

    :func:`chunk_grad` needs a finite lse at ignored rows (e.g. fully masked ones) so that their
    zero gradient is not ``0 * NaN``.
    """
    if valid is None:
        return lse
    return torch.where(valid | torch.isfinite(lse), lse, 0.0)
