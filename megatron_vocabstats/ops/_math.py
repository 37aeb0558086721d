"""Per-chunk vocabulary statistics, their merge across shards, and the logits gradient.

Pure tensor math: no collectives, no process groups, never writes to the caller's tensors (only
to the scratch buffers handed in). The formulas are those of ``docs/numerics.md``:

* per shard r and token: ``m_r = max_j z_j``, ``s_r = sum_j exp(z_j - m_r)``,
  ``u_r = sum_j exp(z_j - m_r) * (z_j - m_r)``, ``t_r = z_y`` if the target is local else 0, and
  with label smoothing ``a_r = sum_j z_j`` over the real columns;
* merged with ``m = max_r m_r``: ``S = sum_r s_r e^(m_r - m)``,
  ``U = sum_r e^(m_r - m) (u_r + (m_r - m) s_r)``, ``logZ = m + log S``,
  ``logprob = t - logZ``, ``H = log S - U / S`` (exact: ``logZ - E_p[z]``);
* gradient w.r.t. z with upstream ``g_lp``, ``g_H``:
  ``g_lp (q_j - p_j) - g_H p_j (log p_j + H)`` where q is the (smoothed) one-hot target.

``u_r`` is kept relative to the shard maximum, so large logits (fp16 65504) do not cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits are clamped to Z_FLOOR as they are upcast, so every shifted logit stays finite:
# exp(Z_FLOOR - m) is exactly 0 for any real row maximum m, and products such as
# p * log p give 0 rather than 0 * (-inf) = NaN. A shard whose maximum is Z_FLOOR has no live
# column for that row and reports m_r = -inf, s_r = u_r = 0.
Z_FLOOR = -1.0e30
# Below the log of the smallest positive fp32 (about -103.3): exp(LOGP_MIN) == 0.
LOGP_MIN = -1.0e4

# Row order of the packed per-shard statistics tensor [NUM_STATS, T].
STAT_MAX, STAT_SUMEXP, STAT_ENT, STAT_TARGET, STAT_ZSUM = range(5)
NUM_STATS = 5


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where this rank's logits columns sit in the global vocabulary.

    ``vocab_start``: global id of local column 0; ``width``: local (padded) shard width W;
    ``real_width``: local columns with global id < ``vocab_size`` (the rest are padding);
    ``vocab_size``: the real, unpadded global vocabulary size V.
    """

    vocab_start: int
    width: int
    real_width: int
    vocab_size: int


def load_chunk(logits: torch.Tensor, out: torch.Tensor, layout: ShardLayout, temperature: float):
    """Upcast a ``[n, W]`` logits chunk into the fp32 buffer ``out[:n]`` as ``z = logits / tau``.

    Values below ``Z_FLOOR`` (-inf included) become ``Z_FLOOR``; padding columns (global id >= V)
    are set to ``Z_FLOOR`` in the buffer, never in ``logits``.
    """
    z = out[: logits.shape[0]]
    z.copy_(logits)
    if temperature != 1.0:
        z.div_(temperature)
    z.clamp_(min=Z_FLOOR)
    if layout.real_width < layout.width:
        z[:, layout.real_width :] = Z_FLOOR
    return z


def local_target_index(target: torch.Tensor, valid: torch.Tensor, layout: ShardLayout):
    """Map global target ids to local columns: ``(index clamped to [0, W), owned mask)``."""
    local = target.long() - layout.vocab_start  # gather/scatter index with int64
    owned = valid & (local >= 0) & (local < layout.width)
    return local.clamp(0, layout.width - 1), owned


def chunk_stats(
    z: torch.Tensor,
    scratch: torch.Tensor,
    index: torch.Tensor | None,
    owned: torch.Tensor | None,
    out: torch.Tensor,
    *,
    layout: ShardLayout,
    entropy: bool,
    zsum: bool,
):
    """Write one chunk's shard statistics into ``out`` ([NUM_STATS, n] fp32).

    ``z``: [n, W] fp32 chunk from :func:`load_chunk` (overwritten); ``scratch``: an fp32 buffer with
    at least n rows of width W. ``index``/``owned``: from :func:`local_target_index`, or None when
    no target is scored.
    """
    n = z.shape[0]
    if index is not None:
        picked = z.gather(1, index.unsqueeze(1)).squeeze(1)
        out[STAT_TARGET] = torch.where(owned, picked, 0.0)
    if zsum:
        out[STAT_ZSUM] = z[:, : layout.real_width].sum(dim=-1)
    m = z.amax(dim=-1)
    live = m > Z_FLOOR
    out[STAT_MAX] = torch.where(live, m, float("-inf"))
    z.sub_(m.unsqueeze(1))
    e = torch.exp(z, out=scratch[:n])
    out[STAT_SUMEXP] = torch.where(live, e.sum(dim=-1), 0.0)
    if entropy:
        out[STAT_ENT] = torch.where(live, z.mul_(e).sum(dim=-1), 0.0)


@dataclass(frozen=True, slots=True)
class MergedStats:
    """Per-token results of :func:`merge_stats`, all fp32 ``[T]``."""

    logsumexp: torch.Tensor
    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None


def merge_stats(
    gathered: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    vocab_size: int,
    label_smoothing: float,
    entropy: bool,
    has_target: bool,
) -> MergedStats:
    """Merge ``[tp, NUM_STATS, T]`` shard statistics into per-token logsumexp, logprob, entropy.

    The reduction over shards runs in rank order on every rank, so all ranks get bitwise equal
    results. ``logprobs`` is ``sum_j q_j log p_j`` with ``q = (1-eps) onehot(y) + eps/V`` (plain
    ``log p_y`` without smoothing). Positions with ``valid`` False get logprob and entropy 0. A row
    with no live column anywhere gets logsumexp -inf and NaN logprob and entropy.
    """
    m_r = gathered[:, STAT_MAX]
    m = m_r.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    delta = m_r - m_safe  # -inf for shards with no live column: scale 0, and s_r = u_r = 0
    scale = torch.exp(delta)
    s_r = gathered[:, STAT_SUMEXP]
    sumexp = (s_r * scale).sum(dim=0)
    log_sumexp = torch.log(sumexp)
    lse = m_safe + log_sumexp

    ent = None
    if entropy:
        shifted = torch.where(s_r > 0, delta * s_r, 0.0)
        u = (scale * (gathered[:, STAT_ENT] + shifted)).sum(dim=0)
        ent = log_sumexp - u / sumexp
        if valid is not None:
            ent = torch.where(valid, ent, 0.0)

    logprobs = None
    if has_target:
        target_logit = gathered[:, STAT_TARGET].sum(dim=0)
        target_logit = torch.where(target_logit > Z_FLOOR, target_logit, float("-inf"))
        # (t - m) - log S, not t - (m + log S): no rounding at the scale of large logits.
        logprobs = (target_logit - m_safe) - log_sumexp
        if label_smoothing > 0.0:
            zsum = gathered[:, STAT_ZSUM].sum(dim=0)
            # A real column at -inf makes the smoothed loss infinite; say so instead of ~-1e30.
            zsum = torch.where(zsum > 0.5 * Z_FLOOR, zsum, float("-inf"))
            mean_logp = (zsum / vocab_size - m_safe) - log_sumexp
            logprobs = (1.0 - label_smoothing) * logprobs + label_smoothing * mean_logp
        logprobs = torch.where(valid, logprobs, 0.0)
    return MergedStats(logsumexp=lse, logprobs=logprobs, entropy=ent)


def chunk_grad(
    z: torch.Tensor,
    scratch: torch.Tensor,
    out: torch.Tensor,
    *,
    lse: torch.Tensor,
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
    the gradient, in the logits dtype. ``coef_lp = g_lp / tau`` and ``coef_h = g_H / tau`` per row,
    already 0 at ignored rows (whose gradient is then exactly 0), or None when that output gets no
    gradient. ``lse`` must be finite at ignored rows, and rows with ``valid`` False are zeroed
    at the end (NaN or +inf logits there included). One fp32 pass computes
    ``p * (-coef_h (log p + H) - coef_lp)``; the target and smoothing terms are added in fp32
    before the single cast to ``out``.
    """
    n = z.shape[0]
    logp = z.sub_(lse.unsqueeze(1))
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
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(coef_lp, coef_h)`` of :func:`chunk_grad` from upstream gradients shaped like the tokens.

    Flattened fp32 ``g / tau``, exactly 0 at rows where ``valid`` is False (their gradient is then
    exactly 0); None where that upstream gradient is None.
    """
    keep = valid.float() / temperature if valid is not None else 1.0 / temperature
    coef_lp = grad_logprobs.reshape(-1).float() * keep if grad_logprobs is not None else None
    coef_h = grad_entropy.reshape(-1).float() * keep if grad_entropy is not None else None
    return coef_lp, coef_h


def finite_lse(lse: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``lse`` with non-finite values at rows that are not ``valid`` replaced by 0.

    :func:`chunk_grad` needs a finite lse at ignored rows (e.g. fully masked ones) so that their
    zero gradient is not ``0 * NaN``.
    """
    if valid is None:
        return lse
    return torch.where(valid | torch.isfinite(lse), lse, 0.0)
