"""The sampler log-probs' threshold search and per-chunk math, shared by ``from_logits.py`` and
``from_hidden.py``: a radix search over order-preserving integer keys of the fp32 values (one
all-gather per step) for top-k, then top-p over what min-p and top-k keep, with vLLM's split of
the top-p tie. Method and communication: ``docs/rollout.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _comm
from .._checks import check_finite
from .._layout import target_in_range
from .._math import Z_FLOOR
from ..agreement import host_checks_enabled
from ..engine.kernel import Chunk
from ..options import StatsConfig

_KEY_MIN = -(2**31)
_PAD_KEY = _KEY_MIN - 1  # below every real column: padding is never counted
# Bits of the key decided per radix step (32 in all): 6 steps of one all-gather each; the
# [T, 64] float64 histograms stay small next to the logits.
_DIGITS = (6, 6, 6, 6, 6, 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerConfig:
    """The core op's validated options and the sampler's filters (None = off)."""

    stats: StatsConfig
    top_k: int | None
    top_p: float | None
    min_p: float | None


def sort_keys(z: torch.Tensor, real_width: int) -> torch.Tensor:
    """int64 keys of an fp32 ``[n, W]`` chunk ordered like the values, padding columns (from
    ``real_width`` on) below every real one. Turns -0.0 into +0.0 in ``z`` (in place: equal
    values, equal keys)."""
    bits = z.add_(0.0).view(torch.int32)
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()
    keys[:, real_width:] = _PAD_KEY
    return keys


def value_of(keys: torch.Tensor) -> torch.Tensor:
    """The fp32 value of each key (the inverse of :func:`sort_keys`; ``_KEY_MIN`` gives -inf):
    ``key >= t`` is ``z >= value_of(t)`` for every non-NaN z, a cheaper test."""
    bits = keys.int()
    values = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).view(torch.float32)
    return torch.where(keys <= _KEY_MIN, float("-inf"), values)


def _scaled(z, m, rows) -> torch.Tensor:
    """``exp(z - m)`` of a chunk: the unnormalised probabilities (fp32)."""
    return torch.exp(z - m[rows].unsqueeze(1))


def _kept(z, rows, thresholds, real_width: int, min_p=None, scaled=None, drop=None):
    """The kept real columns of one chunk: ``z >= threshold``, with ``min_p`` also ``scaled >=
    min_p``, less the ``drop[row]`` lowest-id columns equal to the threshold (the tie split)."""
    at_least = thresholds[rows].unsqueeze(1)
    keep = z >= at_least
    if real_width < z.shape[1]:
        keep[:, real_width:] = False
    if min_p:
        keep &= scaled >= min_p
    if drop is not None:
        tie = keep & (z == at_least)
        keep &= ~(tie & (tie.cumsum(dim=1) <= drop[rows].unsqueeze(1)))
    return keep


def _largest_key(passes, weight, target_of, num_tokens, device, tp_group) -> torch.Tensor:
    """``(t, S(key > t), target, short)`` (``[T]`` int64, float64, float64, bool): per row the
    largest key ``t`` with ``S(key >= t) >= target = target_of(row total)``, ``S`` the sum of
    ``weight(z, keys, rows)`` (fp32, >= 0) over the whole row (all shards); ``_KEY_MIN`` (keep
    all) where the row falls short. Radix steps of :data:`_DIGITS`, one all-gather each."""
    lo = torch.full((num_tokens,), _KEY_MIN, dtype=torch.int64, device=device)
    above = torch.zeros(num_tokens, dtype=torch.float64, device=device)
    short = target = None
    shift = 32
    for bits in _DIGITS:
        shift -= bits
        buckets = 1 << bits
        hist = torch.zeros((num_tokens, buckets), dtype=torch.float64, device=device)
        for rows, z, keys in passes():
            counted = weight(z, keys, rows)
            # (the keys are made anew for every pass: reuse them for the bucket index)
            bucket = keys.sub_(lo[rows].unsqueeze(1)).bitwise_right_shift_(shift)
            bucket.clamp_(-1, buckets).add_(1)  # 1..buckets inside, 0 and buckets + 1 not
            # float64 buckets: a scatter-add adds a bucket's columns one after the other, and in
            # fp32 the error of tens of thousands of equal terms (a bf16 tie) grows to 1e-4.
            part = torch.zeros((bucket.shape[0], buckets + 2), dtype=torch.float64,
                               device=device)
            hist[rows] += part.scatter_add_(1, bucket, counted.double())[:, 1:buckets + 1]
        hist = _comm.gather_stats(hist, tp_group).sum(dim=0)
        if target is None:
            target = target_of(hist.sum(dim=1))
            short = hist.sum(dim=1) < target
        # tail[b] = S(key >= lo + b << shift); choose the highest bucket that still reaches it.
        tail = torch.cat([hist.flip(1).cumsum(1).flip(1) + above.unsqueeze(1),
                          above.unsqueeze(1)], dim=1)
        chosen = ((tail[:, :buckets] >= target.unsqueeze(1)).sum(dim=1) - 1).clamp_(min=0)
        above = tail.gather(1, (chosen + 1).unsqueeze(1)).squeeze(1)
        lo = lo + (chosen << shift)
    return torch.where(short, _KEY_MIN, lo), above, target, short


class TopPBoundary(NamedTuple):
    """Where top-p cuts a row (``[T]`` each): ``above`` the kept mass strictly above the
    threshold and ``goal`` = top_p times the mass kept by min-p and top-k (float64, in units of
    ``exp(z - max)``); ``split`` where top-p sets the threshold (False: every column kept)."""

    above: torch.Tensor
    goal: torch.Tensor
    split: torch.Tensor


def _thresholds(passes, m, cfg: SamplerConfig, num_tokens, device, tp_group):
    """``([T] int64, TopPBoundary | None)``: the key a column must reach to be kept by top-k
    and top-p (min-p apart), and where top-p cuts (None without top-p)."""
    real = cfg.stats.layout.real_width
    everything = torch.full((num_tokens,), _KEY_MIN, dtype=torch.int64, device=device)
    by_k = everything
    if cfg.top_k is not None:
        no_threshold = value_of(everything)

        def count(z, keys, rows):  # the columns min-p keeps
            scaled = _scaled(z, m, rows) if cfg.min_p else None
            return _kept(z, rows, no_threshold, real, cfg.min_p, scaled).float()

        k = float(cfg.top_k)
        by_k = _largest_key(passes, count, lambda total: torch.full_like(total, k),
                            num_tokens, device, tp_group)[0]
    if cfg.top_p is None or cfg.top_p >= 1.0:
        return by_k, None

    by_k_value = value_of(by_k)

    def mass(z, keys, rows):  # renormalised over what min-p and top-k keep
        scaled = _scaled(z, m, rows)
        return torch.where(_kept(z, rows, by_k_value, real, cfg.min_p, scaled), scaled, 0.0)

    top_p = float(cfg.top_p)
    by_p, above, goal, short = _largest_key(passes, mass, lambda total: total * top_p,
                                            num_tokens, device, tp_group)
    # The mass strictly above by_k's key is its whole kept set: by_p >= by_k.
    return torch.maximum(by_p, by_k), TopPBoundary(above, goal, ~short)


def _kept_mass(chunks, m, thresholds, min_p, real_width, num_tokens, device,
               tp_group) -> torch.Tensor:
    mass = torch.zeros(num_tokens, dtype=torch.float64, device=device)
    for chunk in chunks():
        rows, z = chunk.rows, chunk.z
        scaled = _scaled(z, m, rows)
        mass[rows] = torch.where(_kept(z, rows, thresholds, real_width, min_p, scaled), scaled,
                                 0.0).sum(dim=1, dtype=torch.float64)
    return _comm.gather_stats(mass, tp_group).sum(dim=0)


def _split_tie(chunks, m, thresholds, boundary: TopPBoundary, cfg: SamplerConfig, target1d,
               num_tokens, device, tp_group):
    """vLLM's split of the top-p tie (``docs/rollout.md``): of the ``c`` columns equal to the
    threshold the ``n = ceil((goal - above) / p_tie)`` highest ids stay (``1 <= n <= c``,
    ``p_tie`` the mass of one). One ``[3, T]`` float64 all-gather, instead of the kept mass's.

    Returns ``(mass [T] float64, drop [T] int64, target_dropped [T] bool)``: the kept mass, how
    many of this shard's tied columns are dropped (lowest ids, lower ranks first), and where the
    target is one of them."""
    layout = cfg.stats.layout
    local = torch.zeros((3, num_tokens), dtype=torch.float64, device=device)
    for chunk in chunks():
        rows, z = chunk.rows, chunk.z
        scaled = _scaled(z, m, rows)
        keep = _kept(z, rows, thresholds, layout.real_width, cfg.min_p, scaled)
        tie = keep & (z == thresholds[rows].unsqueeze(1))
        local[0, rows] = torch.where(keep & ~tie, scaled, 0.0).sum(dim=1, dtype=torch.float64)
        local[1, rows] = tie.sum(dim=1, dtype=torch.float64)
        ids = torch.arange(layout.vocab_start, layout.vocab_start + z.shape[1], device=device)
        local[2, rows] = (tie & (ids <= target1d[rows].unsqueeze(1))).sum(dim=1,
                                                                           dtype=torch.float64)
    gathered = _comm.gather_stats(local, tp_group)
    ties = gathered[:, 1]  # [tp, T], shards in rank order = ascending ids
    total = ties.sum(dim=0)
    p_tie = torch.exp(thresholds - m).double()
    split = boundary.split & (p_tie > 0)
    kept = torch.ceil((boundary.goal - boundary.above) / torch.where(split, p_tie, 1.0))
    kept = torch.where(split, kept.clamp(min=1.0).minimum(total), total)
    dropped = total - kept
    rank, _ = _comm.group_rank_size(tp_group)
    drop = (dropped - ties[:rank].sum(dim=0)).clamp(min=0.0).minimum(ties[rank]).long()
    mass = gathered[:, 0].sum(dim=0) + kept * p_tie
    return mass, drop, gathered[:, 2].sum(dim=0) <= dropped


def sampled_pass(chunks, target1d, valid, cfg: SamplerConfig, num_tokens, device, tp_group):
    """Forward of the sampler log-probs over ``chunks()``, a fresh iterator of
    :class:`~.engine.kernel.Chunk` with targets per pass (z's -0.0 become +0.0).

    Returns ``(logprobs [T], outside [T], saved)``, ``saved = (m, lse, lse_lo, thresholds,
    scored, drop)`` for :func:`sampled_chunk_grad`: the kept set's logsumexp as the pair
    ``(m, log(mass))`` on every row, where the target is scored and kept, and the tie split
    (``drop``, None without top-p). ``log q`` is formed in float64, rounded to fp32 once."""
    sc = cfg.stats

    def passes():
        for chunk in chunks():
            yield chunk.rows, chunk.z, sort_keys(chunk.z, sc.layout.real_width)

    local = torch.full((2, num_tokens), float("-inf"), dtype=torch.float32, device=device)
    for chunk in chunks():
        rows, z, index, owned = chunk.rows, chunk.z, chunk.index, chunk.owned
        local[0, rows] = z.amax(dim=1)
        local[1, rows] = torch.where(owned, z.gather(1, index.unsqueeze(1)).squeeze(1), 0.0)
    gathered = _comm.gather_stats(local, tp_group)
    m = gathered[:, 0].amax(dim=0)
    m = torch.where(m <= Z_FLOOR, float("-inf"), m)  # no live column: as the core op
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    target_logit = gathered[:, 1].sum(dim=0)
    target_logit = torch.where(target_logit <= Z_FLOOR, float("-inf"), target_logit)
    thresholds, boundary = _thresholds(passes, m_safe, cfg, num_tokens, device, tp_group)
    thresholds = value_of(thresholds)  # kept: z >= thresholds (and min-p, and the tie split)
    drop = None
    if boundary is None:
        mass = _kept_mass(chunks, m_safe, thresholds, cfg.min_p, sc.layout.real_width,
                          num_tokens, device, tp_group)
    else:
        mass, drop, tie_dropped = _split_tie(chunks, m_safe, thresholds, boundary, cfg,
                                             target1d, num_tokens, device, tp_group)
    # Float64 from here: log q = (t - m) - log(mass), rounded to fp32 once. Rounding
    # lse = m + log(mass) to fp32 first would lose up to half its ulp (0.5 nats at 1e7).
    log_mass = torch.log(mass)
    lse = torch.where(torch.isnan(m), m, (m_safe.double() + log_mass).float())  # NaN stays NaN
    if host_checks_enabled(sc.validate, device):
        check_finite(lse, valid, temperature=sc.temperature)
    in_range = target_in_range(target1d, sc.layout.vocab_size)
    # A -inf (floor) logit has probability 0 under any filter: no sampler draws it.
    inside = (target_logit >= thresholds) & (target_logit > float("-inf"))
    if drop is not None:
        inside &= (target_logit > thresholds) | ~tie_dropped
    if cfg.min_p:
        inside &= torch.exp(target_logit - m_safe) >= cfg.min_p
    inside &= in_range
    shifted = ((target_logit.double() - m_safe.double()) - log_mass).float()
    logprobs = torch.where(inside, shifted, float("-inf"))
    # Out-of-range ids and rows without a finite normaliser give NaN, never a number.
    logprobs = torch.where(in_range & torch.isfinite(lse), logprobs, float("nan"))
    inside &= torch.isfinite(lse)
    logprobs = torch.where(valid, logprobs, 0.0)
    outside = valid & in_range & ~inside
    # The kept set's logsumexp for backward as the pair (m, log(mass)) on every row (log(mass)
    # >= 0: the kept set holds the maximum, so z - m <= 0 everywhere): log q = (z - m) - log
    # mass, one rounding where z is near m. Not m + log(mass) even in float64, whose ulp at
    # 3e38 swallows log(mass). A row without a finite mass gets (m_safe, 0).
    lse_lo = torch.where(torch.isfinite(log_mass), log_mass, 0.0).float()
    return logprobs, outside, (m_safe, m_safe, lse_lo, thresholds, inside & valid, drop)


def sampling_outputs(ctx, logprobs, outside, shape):
    """``(logprobs, outside)`` of a sampler Function's forward, viewed as ``shape``: ``outside``
    marked non-differentiable, output gradients not materialised (backward may see None)."""
    ctx.mark_non_differentiable(outside)
    ctx.set_materialize_grads(False)
    return logprobs.view(shape), outside.view(shape)


def grad_coefficient(grad, saved, temperature: float) -> torch.Tensor:
    """``[T]`` fp32 ``g / temperature`` where the target is scored and kept, else 0."""
    return torch.where(saved[4], grad.reshape(-1).float(), 0.0) / temperature


def sampled_chunk_grad(z, rows, index, owned, out, *, coef, saved, cfg: SamplerConfig) -> None:
    """Write the chunk's logits gradient ``coef (1[j = y] - q_j)`` (q on the kept set, held
    constant) into ``out``, cast once; ``q_j = exp((z_j - lse) - lse_lo)``, ``z - lse <= 0``.
    Rows not scored and kept get exactly 0 by selection (never ``0 * exp``: NaN or inf stay out)."""
    m, lse, lse_lo, thresholds, scored, drop = saved
    scaled = _scaled(z, m, rows) if cfg.min_p else None
    keep = _kept(z, rows, thresholds, cfg.stats.layout.real_width, cfg.min_p, scaled, drop)
    keep &= scored[rows].unsqueeze(1)
    logq = z.sub_(lse[rows].unsqueeze(1)).sub_(lse_lo[rows].unsqueeze(1))
    g = torch.where(keep, torch.exp(logq), 0.0).mul_(-coef[rows].unsqueeze(1))
    g.scatter_add_(1, index.unsqueeze(1), torch.where(owned, coef[rows], 0.0).unsqueeze(1))
    out.copy_(g)


@dataclass(frozen=True, slots=True, eq=False)
class SampledGrad:
    """The sampler log-probs' :class:`~.engine.kernel.ChunkGrad`: :func:`sampled_chunk_grad` with
    :func:`grad_coefficient`'s ``coef`` and :func:`sampled_pass`'s ``saved``."""

    coef: torch.Tensor
    saved: tuple
    cfg: SamplerConfig

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None:
        sampled_chunk_grad(chunk.z, chunk.rows, chunk.index, chunk.owned, out, coef=self.coef,
                           saved=self.saved, cfg=self.cfg)
