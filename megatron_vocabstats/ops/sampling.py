"""Log-probs under an inference sampler's distribution (temperature, min-p, top-k, top-p) from
vocab-parallel logits, without gathering the vocabulary.

RL trainers compare their log-probs with the rollout engine's, which samples from a truncated,
renormalised distribution q. :func:`vocab_parallel_sampling_logprobs` gives ``log q(target)``
with q built as vLLM's v1 sampler builds it (``vllm/v1/sample/sampler.py``: temperature, then the
argmax-invariant logits processors, min-p among them, then ``apply_top_k_top_p``):

1. ``z = logits / temperature`` over the real vocabulary;
2. min-p keeps ``p_j >= min_p * max_i p_i``, i.e. ``exp(z_j - max z) >= min_p``;
3. top-k keeps ``z_j >= `` the k-th largest kept value (ties at that value are all kept, as
   vLLM's ``logits < kth_value`` mask does);
4. top-p as vLLM's ``apply_top_k_top_p``: sort ascending (a stable sort, so equal values in id
   order), drop tokens while the cumulative probability, renormalised over the set kept by 2
   and 3, is ``<= 1 - top_p``, always keep the last one. Where values are distinct a token
   stays when the mass strictly more likely than it is below ``top_p``; of a tie on the
   boundary the highest ids stay, as many as the cumulative sum needs;
5. ``q = softmax(z)`` over the kept set.

Min-p and top-k are thresholds on z, so they commute; top-p comes last and renormalises over
what they keep. SGLang applies top-k, then top-p, then min-p (on the top-p-renormalised
probabilities), which gives another set when min-p and top-p are both active.

Method: the kept set of a row is ``z >= threshold``; each threshold is found by a radix search
over the order-preserving int32 image of the fp32 values (6 steps deciding 6, 6, 6, 6, 6 and 2
bits; exact): per step every rank histograms its columns of the row into the buckets of the
current key interval (a count for top-k, the mass ``exp(z - m)`` for top-p), one all-gather sums
the shards in rank order, and every rank picks the same bucket. The tie on the top-p boundary
is split from per-shard tie counts (the shards hold ascending ids in rank order, so the lowest
ranks give up their tied columns first). Communication for tp > 1: one all-gather of ``[2, T]``
(maxima and target logits), 6 of at most ``[T, 64]`` float64 per active top-k/top-p, one of
``[T]`` float64 (the kept mass; ``[3, T]`` with top-p, adding the tie counts); none in backward. Counts are exact; the
masses are summed in fp32 within a chunk row and in float64 over chunks and shards, so a token
whose strictly-more-likely mass lies within about 1e-6 relative of ``top_p`` may fall either way
(vLLM's own fp32 cumulative sum has the same resolution), and only there may tp sizes differ.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _comm
from ._checks import (
    InputTypeError,
    StatsConfig,
    bits_float,
    check_finite,
    checked_config,
    first_order_backward,
    float_bits,
    host_checks_enabled,
)
from ._math import Z_FLOOR, target_in_range
from .vocab_parallel import _chunks, flatten_target

_KEY_MIN = -(2**31)
_PAD_KEY = _KEY_MIN - 1  # below every real column: padding is never counted
# Bits of the key decided per radix step (32 in all): 6 steps of one all-gather each; the
# [T, 64] float64 histograms stay small next to the logits.
_DIGITS = (6, 6, 6, 6, 6, 2)


class SamplingLogprobs(NamedTuple):
    """``logprobs``: fp32 ``log q(target)`` shaped like ``target`` (nats; -inf where the target
    is outside the kept set, 0 at ``ignore_index``); ``outside``: bool, True where a scored
    target is outside the kept set."""

    logprobs: torch.Tensor
    outside: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerConfig:
    """The core op's validated options and the sampler's filters (None = off)."""

    stats: StatsConfig
    top_k: int | None
    top_p: float | None
    min_p: float | None


def sampler_problem(top_k, top_p, min_p) -> Exception | None:
    """The first bad filter argument as an exception naming it, or None."""
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            return InputTypeError(f"top_k must be an int >= 1 or None, got {top_k!r}")
        if top_k < 1:
            return ValueError(f"top_k must be >= 1 (None turns it off), got {top_k!r}")
    for name, value, ok, rule in (("top_p", top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
                                  ("min_p", min_p, lambda v: 0.0 <= v < 1.0, "in [0, 1)")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return InputTypeError(f"{name} must be a real number {rule} or None, got {value!r}")
        if not ok(float(value)):
            return ValueError(f"{name} must lie {rule} (None turns it off), got {value!r}")
    return None


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
    """The kept columns of one chunk: at or above the row's threshold value, and with
    ``min_p`` also ``scaled >= min_p`` (``scaled``: :func:`_scaled` of the chunk); padding
    columns never. ``drop`` (``[T]`` int64, optional): per row, how many of this shard's
    columns equal to the threshold are dropped, the lowest ids first (the top-p tie split)."""
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
    """Per row the largest key ``t`` with ``S(key >= t) >= target``, where ``S`` sums
    ``weight(z, keys, rows)`` (fp32, >= 0) over every column of the row (all shards);
    ``_KEY_MIN`` (keep every column) where even the whole row falls short. ``target_of(total)``
    gives the targets from the row totals. Radix search (:data:`_DIGITS`), one all-gather per
    step; a chunk's buckets are summed in fp32, the chunks and shards in float64.

    Returns ``(t, S(key > t), target, short)``: ``[T]`` int64, float64, float64, bool."""
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
            part = torch.zeros((bucket.shape[0], buckets + 2), dtype=torch.float32,
                               device=device)
            hist[rows] += part.scatter_add_(1, bucket, counted)[:, 1:buckets + 1]
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
    for rows, z, _index, _owned in chunks():
        scaled = _scaled(z, m, rows)
        mass[rows] = torch.where(_kept(z, rows, thresholds, real_width, min_p, scaled), scaled,
                                 0.0).sum(dim=1, dtype=torch.float64)
    return _comm.gather_stats(mass, tp_group).sum(dim=0)


def _split_tie(chunks, m, thresholds, boundary: TopPBoundary, cfg: SamplerConfig, target1d,
               num_tokens, device, tp_group):
    """vLLM's split of the tie on the top-p boundary, and the kept mass.

    vLLM sorts ascending (a stable sort: equal values in id order) and drops tokens while the
    cumulative probability is ``<= 1 - top_p``; of the ``c`` columns equal to the threshold it
    keeps the ``n = ceil((goal - above) / p_tie)`` highest ids (``1 <= n <= c``; ``p_tie`` the
    mass of one of them). One all-gather of ``[3, T]`` float64 per rank (the mass strictly
    above, the tie count, the tied columns with id <= target) replaces the kept-mass gather.

    Returns ``(mass [T] float64, drop [T] int64, target_dropped [T] bool)``: the kept mass, how
    many of this shard's tied columns are dropped (the lowest ids, lower ranks' first), and
    where the target is a dropped tied column.
    """
    layout = cfg.stats.layout
    local = torch.zeros((3, num_tokens), dtype=torch.float64, device=device)
    for rows, z, _index, _owned in chunks():
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
    """Forward of the sampler log-probs over ``chunks``, a callable returning a fresh iterator of
    ``(rows, z, index, owned)`` per chunk (z: the fp32 chunk of ``load_chunk``, whose -0.0 the
    search's keys turn into +0.0; index/owned: the rows' targets in this shard), called once
    per pass.

    Returns ``(logprobs [T], outside [T], saved)`` with ``saved = (m, lse, thresholds, inside,
    drop)`` for :func:`sampled_chunk_grad` (``drop``: the top-p tie split, None without top-p).
    """
    sc = cfg.stats

    def passes():
        for rows, z, _index, _owned in chunks():
            yield rows, z, sort_keys(z, sc.layout.real_width)

    local = torch.full((2, num_tokens), float("-inf"), dtype=torch.float32, device=device)
    for rows, z, index, owned in chunks():
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
    lse = (m_safe.double() + torch.log(mass)).float()
    lse = torch.where(torch.isnan(m), m, lse)  # NaN logits stay NaN
    if host_checks_enabled(sc.validate, device):
        check_finite(lse, valid, temperature=sc.temperature)
    in_range = target_in_range(target1d, sc.layout.vocab_size)
    inside = target_logit >= thresholds
    if drop is not None:
        inside &= (target_logit > thresholds) | ~tie_dropped
    if cfg.min_p:
        inside &= torch.exp(target_logit - m_safe) >= cfg.min_p
    inside &= in_range
    logprobs = torch.where(inside, target_logit - lse, float("-inf"))
    # Out-of-range ids and rows without a finite normaliser give NaN, never a number.
    logprobs = torch.where(in_range & torch.isfinite(lse), logprobs, float("nan"))
    inside &= torch.isfinite(lse)
    logprobs = torch.where(valid, logprobs, 0.0)
    outside = valid & in_range & ~inside
    return logprobs, outside, (m_safe, torch.where(inside, lse, 0.0), thresholds, inside & valid,
                               drop)


def grad_coefficient(grad, saved, temperature: float) -> torch.Tensor:
    """``[T]`` fp32 ``g / temperature`` where the target is scored and kept, else 0."""
    return torch.where(saved[3], grad.reshape(-1).float(), 0.0) / temperature


def sampled_chunk_grad(z, rows, index, owned, out, *, coef, saved, cfg: SamplerConfig) -> None:
    """Write the chunk's logits gradient ``coef (1[j = y] - q_j)`` (q on the kept set, held
    constant) into ``out`` (one cast)."""
    m, lse, thresholds, _, drop = saved
    scaled = _scaled(z, m, rows) if cfg.min_p else None
    keep = _kept(z, rows, thresholds, cfg.stats.layout.real_width, cfg.min_p, scaled, drop)
    g = torch.where(keep, torch.exp(z - lse[rows].unsqueeze(1)), 0.0).mul_(
        -coef[rows].unsqueeze(1))
    g.scatter_add_(1, index.unsqueeze(1), torch.where(owned, coef[rows], 0.0).unsqueeze(1))
    out.copy_(g)


def _logits_chunks(logits2d, target1d, valid, sc: StatsConfig):
    def chunks():
        for rows, z, _scratch, index, owned in _chunks(logits2d, target1d, valid, sc):
            yield rows, z, index, owned
    return chunks


class _SamplingLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, cfg: SamplerConfig, tp_group):
        sc = cfg.stats
        logits2d = logits.reshape(-1, sc.layout.width)
        target1d, valid = flatten_target(target, sc.ignore_index)
        logprobs, outside, saved = sampled_pass(_logits_chunks(logits2d, target1d, valid, sc),
                                                target1d, valid, cfg, logits2d.shape[0],
                                                logits.device, tp_group)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, target, *saved)
        ctx.mark_non_differentiable(outside)
        ctx.set_materialize_grads(False)
        return logprobs.view(target.shape), outside.view(target.shape)

    @staticmethod
    @first_order_backward("vocab_parallel_sampling_logprobs")
    def backward(ctx, grad, _grad_outside):
        if grad is None:
            return None, None, None, None
        logits, target, *saved = ctx.saved_tensors
        cfg: SamplerConfig = ctx.cfg
        sc = cfg.stats
        logits2d = logits.reshape(-1, sc.layout.width)
        target1d, valid = flatten_target(target, sc.ignore_index)
        coef = grad_coefficient(grad, saved, sc.temperature)
        grad_logits = torch.empty_like(logits2d)
        for rows, z, index, owned in _logits_chunks(logits2d, target1d, valid, sc)():
            sampled_chunk_grad(z, rows, index, owned, grad_logits[rows], coef=coef, saved=saved,
                               cfg=cfg)
        return grad_logits.view(logits.shape), None, None, None


def sampler_config(logits, target, tp_group, *, top_k, top_p, min_p, local_error=None,
                   check=checked_config, **options) -> tuple[SamplerConfig, object]:
    """Validate one call (the core checks through ``check``, the filters, their agreement
    across ranks): ``(SamplerConfig, what check returned)``."""
    problem = local_error or sampler_problem(top_k, top_p, min_p)
    if target is None and problem is None:
        problem = ValueError("target is required: the sampled token ids to score")
    stats = check(
        logits, target, tp_group, local_error=problem,
        agree=(("top_k", lambda: -1 if top_k is None else int(top_k)),
               ("top_p", lambda: float_bits(-1.0 if top_p is None else float(top_p)),
                bits_float),
               ("min_p", lambda: float_bits(-1.0 if min_p is None else float(min_p)),
                bits_float)),
        entropy="off", label_smoothing=0.0, **options)
    return SamplerConfig(stats=getattr(stats, "stats", stats),
                         top_k=None if top_k is None else int(top_k),
                         top_p=None if top_p is None else float(top_p),
                         min_p=None if min_p is None else float(min_p)), stats


def vocab_parallel_sampling_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    validate: bool = True,
) -> SamplingLogprobs:
    """``log q(target)`` under the inference sampler's truncated, renormalised distribution q.

    Reference semantics (one process, full vocabulary, vLLM's v1 sampler; see the module
    docstring for the order and the tie rules)::

        z = logits.float()[..., :V] / temperature
        keep = torch.exp(z - z.max(-1, keepdim=True).values) >= min_p          # min-p
        z = z.masked_fill(~keep, -inf)
        keep &= z >= z.topk(top_k, -1).values[..., -1:]                         # top-k
        z_k = z.masked_fill(~keep, -inf)
        order = z_k.sort(-1, stable=True).indices                               # top-p
        drop = torch.softmax(z_k, -1).gather(-1, order).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        keep &= ~drop.new_zeros(drop.shape).scatter(-1, order, drop)
        logprobs = torch.log_softmax(z.masked_fill(~keep, -inf), -1).gather(-1, target[..., None])

    without gathering the vocabulary (radix threshold search; see the module docstring).

    Args:
        logits: this rank's vocabulary shard ``[..., W]`` (bf16, fp16 or fp32); differentiable,
            never modified.
        target: int64 global ids shaped like ``logits.shape[:-1]`` (the sampled tokens).
        tp_group, vocab_size, vocab_start, ignore_index, chunk_size, validate: as
            :func:`~megatron_vocabstats.vocab_parallel_stats`.
        temperature: > 0 (vLLM's greedy temperature 0 has no distribution to score).
        top_k: keep the k most likely tokens (ties at the k-th value kept); None = off. vLLM's
            ``top_k=-1`` is None here; a k of V or more keeps everything.
        top_p: in (0, 1]; None or 1 = off. A tie on the boundary keeps its highest ids.
        min_p: in [0, 1); None or 0 = off.

    Returns:
        :class:`SamplingLogprobs` ``(logprobs, outside)``: fp32 log q(target) (-inf where the
        target is outside the kept set, 0 at ``ignore_index``, NaN at an id outside ``[0, V)``
        when ``validate`` is off) and the bool mask of scored targets outside the kept set.
        Equal on every rank. Differentiable w.r.t. the logits with the kept set held constant:
        ``d/dz_j = (1[j = y] - q_j) / temperature``; zero gradient where the target is outside
        the kept set or ignored.

    Communication: see the module docstring (at most 14 small collectives for tp > 1, plus the
    check all-gather with ``validate``); none in backward. Memory: the core op's two fp32
    ``[chunk, W]`` buffers plus chunk-sized int64 keys and float64 masses.

    Raises:
        ValueError: naming the argument: ``top_k <= 0``, ``top_p`` outside (0, 1], ``min_p``
            outside [0, 1), ``temperature`` not > 0, and everything
            :func:`~megatron_vocabstats.vocab_parallel_stats` raises (under ``validate`` and
            tp > 1 on every rank, also for filters that differ across the ranks).
        TypeError: a filter of the wrong Python type (``InputTypeError``, also a ``ValueError``).
        RuntimeError: on double backward.
    """
    cfg, _ = sampler_config(logits, target, tp_group, top_k=top_k, top_p=top_p, min_p=min_p,
                            vocab_size=vocab_size, vocab_start=vocab_start, chunk_size=chunk_size,
                            temperature=temperature, ignore_index=ignore_index, validate=validate)
    return SamplingLogprobs(*_SamplingLogprobs.apply(logits, target, cfg, tp_group))

