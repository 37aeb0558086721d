"""Top-k of vocab-parallel logits and log-probs at given ids, for top-k distillation.

* :func:`vocab_parallel_topk` (teacher side): the global top-k log-probs and their global ids from
  each rank's local top-k candidates. One all-gather carries, per token, every rank's k candidate
  values and ids together with its logsumexp statistics, so the teacher costs one collective.
* :func:`vocab_parallel_topk_logprobs` (student side): ``log p(i)`` at given global ids, normalised
  over the full vocabulary. The k columns are picked in the logits' storage dtype and only the
  ``[T, k]`` result is upcast; one all-gather of ``[5 + k, T]`` fp32 in forward, none in backward.

Math (``docs/numerics.md``, "Top-k distillation"): per shard the statistics of ``_math.chunk_stats``
(max and sum of exp), merged as ``log Z = m + log S``; ``log p(i) = (z_i - m) - log S``. The
gradient of ``sum_k g_k log p(i_k)`` w.r.t. z is ``sum_k g_k 1[j = i_k] - p_j sum_k g_k``: the
core op's ``chunk_grad`` with ``coef = sum_k g_k`` and no target, plus a scatter-add of ``g_k`` at
the owned ids (duplicate ids add up).

Ties in the top-k are broken by the lowest global id: candidates are ranked by one int64 key per
column, the order-preserving integer image of the fp32 value in the high 32 bits and the complement
of the id in the low 32 bits, so ``torch.topk`` sees no ties at all. A NaN ranks above everything,
so a row holding one comes out all NaN (never a plausible top-k).

Under ``validate`` on tp > 1 the ranks also agree on ``k``, ``indices`` and ``mask`` (checksums)
before any result is used: a differing ``k`` would otherwise fail inside the gather, differing ids
or masks would give silently wrong sums.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _comm
from ._checks import (
    Field,
    InputTypeError,
    StatsConfig,
    _target_checksum,
    check_finite,
    checked_config,
    first_order_backward,
    host_checks_enabled,
)
from ._math import (
    NUM_STATS,
    Z_FLOOR,
    ShardLayout,
    chunk_grad,
    chunk_stats,
    finite_lse,
    log_normaliser,
)
from .vocab_parallel import _chunks

_LOW32 = 2**32
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


class TopK(NamedTuple):
    """Global top-k of each token: ``logprobs`` fp32 ``[..., k]`` (nats, normalised over the full
    vocabulary, sorted descending) and ``indices`` int64 ``[..., k]`` (global vocabulary ids)."""

    logprobs: torch.Tensor
    indices: torch.Tensor


@dataclass(frozen=True, slots=True, kw_only=True)
class TopKConfig:
    """Options of one top-k call: the core op's validated options, k, and whether the values are
    log-probs (``normalize``) or the logits themselves."""

    stats: StatsConfig
    k: int
    normalize: bool = True


class TopKLogits(NamedTuple):
    """Global top-k of each token by raw logit: ``logits`` fp32 ``[..., k]`` (the logits' values,
    exact; sorted descending) and ``indices`` int64 ``[..., k]`` (global vocabulary ids)."""

    logits: torch.Tensor
    indices: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Pure math (no collectives)


def rank_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering ``(value descending, id ascending)``: larger key = earlier in the top-k.

    ``values``: fp32; ``ids``: int64 in ``[0, 2**32)``, broadcastable to ``values``. Equal values
    (-0.0 and +0.0 included) differ only by id, so ``torch.topk`` on the keys is deterministic.
    Any NaN (either sign) ranks above +inf.
    """
    bits = torch.where(values == 0, 0.0, values)
    bits = torch.where(torch.isnan(bits), float("nan"), bits).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return ordered * _LOW32 + (_LOW32 - 1 - ids)


def chunk_candidates(z: torch.Tensor, layout: ShardLayout, k_local: int):
    """This shard's top ``k_local`` of a ``[n, W]`` fp32 chunk from ``load_chunk``:
    ``(values fp32 [n, k_local], global ids int64 [n, k_local])``. Padding columns (at the floor)
    rank after every real column of equal value, having higher ids. A shard narrower than
    ``k_local`` (unequal shards) fills the rest with floor values at ids ``>= vocab_size +
    vocab_start``, which rank after every column of every shard."""
    ids = torch.arange(layout.vocab_start, layout.vocab_start + layout.width, device=z.device)
    top = rank_keys(z, ids).topk(min(k_local, layout.width), dim=1).indices
    values, top_ids = z.gather(1, top), top + layout.vocab_start
    missing = k_local - top.shape[1]
    if missing > 0:
        fill = layout.vocab_size + layout.vocab_start + layout.width
        values = torch.cat([values, values.new_full((z.shape[0], missing), Z_FLOOR)], dim=1)
        extra = torch.arange(fill, fill + missing, device=z.device).expand(z.shape[0], missing)
        top_ids = torch.cat([top_ids, extra], dim=1)
    return values, top_ids


def logprobs_of(values: torch.Tensor, m: torch.Tensor, log_sumexp: torch.Tensor) -> torch.Tensor:
    """``(z - m) - log S`` for fp32 logits ``values`` ``[T, k]`` (-inf where z is at the floor,
    NaN where it is NaN); the same rounding as the core op's ``merge_stats``, so equal inputs give
    equal bits."""
    lp = (values - m.unsqueeze(1)) - log_sumexp.unsqueeze(1)
    return torch.where(values <= Z_FLOOR, float("-inf"), lp)


def merge_candidates(values: torch.Tensor, ids: torch.Tensor, k: int):
    """The global top-k of every rank's candidates ``[tp, k_local, T]``: ``(values, ids)``,
    each ``[T, k]``."""
    tp, k_local, tokens = values.shape
    values = values.permute(2, 0, 1).reshape(tokens, tp * k_local)
    ids = ids.permute(2, 0, 1).reshape(tokens, tp * k_local)
    top = rank_keys(values, ids).topk(k, dim=1).indices
    return values.gather(1, top), ids.gather(1, top)


def locate(indices2d: torch.Tensor, valid: torch.Tensor, layout: ShardLayout):
    """``(local column clamped to [0, W), owned, in_range)`` of global ids ``[T, k]``.

    ``in_range``: the id lies in ``[0, V)``; ``owned``: in range, on this shard, and the row valid.
    """
    ids = indices2d.long()
    local = ids - layout.vocab_start
    in_range = (ids >= 0) & (ids < layout.vocab_size)
    owned = valid.unsqueeze(1) & in_range & (local >= 0) & (local < layout.width)
    return local.clamp(0, layout.width - 1), owned, in_range


def picked_logits(chunk: torch.Tensor, local: torch.Tensor, owned: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """``z`` at the owned columns of a ``[n, W]`` chunk in its storage dtype, as ``[k, n]`` fp32.

    Gather first, then upcast the ``[n, k]`` result only; ``/ temperature`` and the floor exactly
    as ``load_chunk`` does, so the values equal the fp32 chunk's bit for bit. 0 where not owned.
    """
    z = chunk.gather(1, local).float()
    if temperature != 1.0:
        z = z / temperature
    return torch.where(owned, z.clamp(min=Z_FLOOR), 0.0).t()


def chunk_topk_grad(z, scratch, out, *, lse, coef, hits, local, valid, layout: ShardLayout):
    """Write the gradient of ``sum_k g_k log p(i_k)`` for one ``[n, W]`` chunk into ``out``.

    ``coef = sum_k g_k / tau`` per row and ``hits = g_k / tau`` at owned ids (0 elsewhere), both
    already 0 at invalid rows. ``chunk_grad`` leaves ``-coef * p`` in fp32 in ``scratch``, the
    hits are scatter-added there (duplicate ids accumulate), then one cast into ``out``.
    """
    n = z.shape[0]
    grad = scratch[:n]
    chunk_grad(z, scratch, grad, lse=lse, ent=None, coef_lp=coef, coef_h=None, index=None,
               owned=None, valid=valid, layout=layout, label_smoothing=0.0)
    grad.scatter_add_(1, local, hits)
    out.copy_(grad)


def backward_terms(grad, indices, valid, lse, cfg: StatsConfig):
    """What every chunk of a backward needs, from the upstream ``[..., k]`` gradient:
    ``(local [T, k], coef [T], hits [T, k], lse [T])`` for :func:`chunk_topk_grad`."""
    local, owned, in_range = locate(indices.reshape(-1, indices.shape[-1]), valid, cfg.layout)
    scored = valid.unsqueeze(1) & in_range
    g = torch.where(scored, grad.reshape(local.shape).float(), 0.0) * (1.0 / cfg.temperature)
    return local, g.sum(dim=1), torch.where(owned, g, 0.0), finite_lse(lse, valid)


# ---------------------------------------------------------------------------------------------
# Passes over the chunks: shared by these ops and the fused ones (ops/fused_topk.py)


def topk_pass(chunks, num_tokens: int, device, cfg: TopKConfig, tp_group) -> TopK:
    """Top-k over ``chunks``, an iterable of ``(rows, z, scratch)``: z the fp32 chunk of
    ``load_chunk`` (overwritten), scratch an fp32 buffer of at least its size.

    Packs per shard ``[NUM_STATS + 2 k_local, T]`` int32: the statistics and candidate values as
    fp32 bits, then the candidate ids; one all-gather; merged in rank order on every rank.
    Returns flat ``[T, k]`` results.
    """
    layout = cfg.stats.layout
    # Every rank sends as many candidates (one all-gather shape): k, or its width when all equal.
    k_local = min(cfg.k, layout.width) if layout.even else cfg.k
    packed = torch.zeros((NUM_STATS + 2 * k_local, num_tokens), dtype=torch.int32, device=device)
    stats = packed[:NUM_STATS].view(torch.float32)
    values = packed[NUM_STATS:NUM_STATS + k_local].view(torch.float32)
    for rows, z, scratch in chunks:
        vals, ids = chunk_candidates(z, layout, k_local)
        values[:, rows] = vals.t()
        packed[NUM_STATS + k_local:, rows] = ids.t().int()
        chunk_stats(z, scratch, None, None, stats[:, rows], layout=layout, entropy=False,
                    zsum=False)
    gathered = _comm.gather_stats(packed, tp_group)
    m, log_sumexp = log_normaliser(gathered[:, :NUM_STATS].view(torch.float32))
    if host_checks_enabled(cfg.stats.validate, device):
        check_finite(m + log_sumexp, None, temperature=cfg.stats.temperature)
    candidates = gathered[:, NUM_STATS:NUM_STATS + k_local].view(torch.float32)
    top_values, top_ids = merge_candidates(candidates, gathered[:, NUM_STATS + k_local:].long(),
                                           cfg.k)
    # A NaN logit anywhere in the row is its first candidate (rank_keys): the whole row is NaN.
    if cfg.normalize:
        values = logprobs_of(top_values, m, log_sumexp)
    else:
        values = torch.where(top_values <= Z_FLOOR, float("-inf"), top_values)
    return TopK(torch.where(torch.isnan(top_values[:, :1]), float("nan"), values), top_ids)


def picked_pass(chunks, indices2d, valid, cfg: StatsConfig, tp_group):
    """Log-probs at ``indices2d`` ``[T, k]`` over ``chunks`` (iterable of ``(rows, storage_chunk,
    z, scratch)``, as in :func:`topk_pass`); one all-gather of ``[NUM_STATS + k, T]`` fp32.

    Returns ``(logprobs [T, k], lse [T])``: 0 at rows not ``valid``, NaN at ids outside
    ``[0, V)`` (a loud result when ``validate`` is off and cannot reject them).
    """
    num_tokens, k = indices2d.shape
    local, owned, in_range = locate(indices2d, valid, cfg.layout)
    packed = torch.zeros((NUM_STATS + k, num_tokens), dtype=torch.float32, device=valid.device)
    for rows, chunk, z, scratch in chunks:
        packed[NUM_STATS:, rows] = picked_logits(chunk, local[rows], owned[rows], cfg.temperature)
        chunk_stats(z, scratch, None, None, packed[:NUM_STATS, rows], layout=cfg.layout,
                    entropy=False, zsum=False)
    gathered = _comm.gather_stats(packed, tp_group)
    m, log_sumexp = log_normaliser(gathered[:, :NUM_STATS])
    lse = m + log_sumexp
    if host_checks_enabled(cfg.validate, valid.device):
        check_finite(lse, valid, temperature=cfg.temperature)
    lp = logprobs_of(gathered[:, NUM_STATS:].sum(dim=0).t(), m, log_sumexp)
    lp = torch.where(in_range, lp, float("nan"))
    return torch.where(valid.unsqueeze(1), lp, 0.0), lse


# ---------------------------------------------------------------------------------------------
# Input checks


def index_problem(indices, mask, lead_shape, device, vocab_size: int | None,
                  host_checks: bool) -> ValueError | None:
    """The first problem with ``indices`` ``[*lead_shape, k]`` and ``mask`` ``lead_shape``, or None.

    With ``host_checks``, ids at unmasked rows must lie in ``[0, vocab_size)`` (reads the host).
    """
    if not isinstance(indices, torch.Tensor):
        return InputTypeError(f"indices must be an int64 tensor [..., k], got "
                              f"{type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        return ValueError(f"indices must hold integer token ids (int64), got {indices.dtype}")
    if indices.dim() < 1 or indices.shape[-1] < 1 or tuple(indices.shape[:-1]) != tuple(lead_shape):
        return ValueError(f"indices shape {tuple(indices.shape)} must be [..., k] with k >= 1 and "
                          f"leading shape {tuple(lead_shape)} (that of the logits)")
    if indices.device != device:
        return ValueError(f"indices is on {indices.device} but the logits on {device}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(lead_shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            return ValueError(f"mask must be a tensor shaped {tuple(lead_shape)}, got {got}")
        if mask.device != device:
            return ValueError(f"mask is on {mask.device} but the logits on {device}")
    if host_checks and isinstance(vocab_size, int) and indices.numel():
        rows = indices.reshape(-1, indices.shape[-1]).long()
        bad = (rows < 0) | (rows >= vocab_size)
        if mask is not None:
            bad &= mask.reshape(-1, 1) != 0
        if bool(bad.any()):
            value = int(rows[bad][0])
            return ValueError(f"indices holds id {value}, outside [0, vocab_size={vocab_size}) at "
                              "an unmasked position (teacher and student must share the "
                              "vocabulary)")
    return None


def k_problem(k, vocab_size: int) -> ValueError | None:
    """A ``ValueError`` for a ``k`` that is not an int in ``[1, vocab_size]``
    (:class:`InputTypeError` if not an int at all), else None."""
    if isinstance(k, bool) or not isinstance(k, int):
        return InputTypeError(f"k must be an int in [1, vocab_size={vocab_size}], got {k!r}")
    if not 1 <= k <= vocab_size:
        return ValueError(f"k must be an int in [1, vocab_size={vocab_size}], got {k!r}")
    return None


def real_vocab(width: int, tp_group, vocab_size) -> int | None:
    """``vocab_size``, or ``width * tp`` when None (None if it is not an int or the shard is
    empty: the core checks then name it)."""
    if width == 0:
        return None
    if vocab_size is None:
        return width * _comm.group_rank_size(tp_group)[1]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        return None
    return int(vocab_size)  # any integral number, as the core checks accept (numpy ints too)


def agreement(k, indices=None, mask=None) -> tuple:
    """``checked_config(agree=...)`` pairs: ``k`` (a callable or an int), and with ``indices`` a
    checksum of ``mask != 0`` and one of the ids at the unmasked rows (masked rows may hold
    anything). Each value is computed only in the agreement exchange (it reads the host)."""
    pairs = [("k", k if callable(k) else (lambda: k))]
    if indices is not None:
        def keep():
            return valid_rows(mask, indices.numel() // indices.shape[-1], indices.device)

        def ids():
            return torch.where(keep().view(*indices.shape[:-1], 1), indices.long(), -1)

        pairs += [(Field("mask", checksum=True), lambda: _target_checksum(keep())),
                  (Field("indices", checksum=True), lambda: _target_checksum(ids()))]
    return tuple(pairs)


def valid_rows(mask, num_tokens: int, device) -> torch.Tensor:
    """``mask != 0`` flattened to ``[T]`` bool (all True for None)."""
    if mask is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    return mask.reshape(-1) != 0


# ---------------------------------------------------------------------------------------------
# Teacher: top-k


def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> TopK:
    """Global top-k log-probs and ids of vocab-parallel logits, without gathering the vocabulary.

    Reference semantics (one process, full vocabulary,
    ``z = logits.float()[..., :V] / temperature``)::

        logp = torch.log_softmax(z, -1)
        order = sorted(range(V), key=lambda j: (-logp[j], j))[:k]   # per token: ties -> lowest id
        TopK(logp[order], order)

    Method: each rank takes the top ``min(k, W)`` of its shard chunk by chunk (fp32 chunk,
    temperature applied, padding columns at -inf and ranked after real columns), then one
    all-gather carries every rank's candidates (values and global ids) and logsumexp statistics
    (``docs/numerics.md``); every rank merges them in rank order to the same global top-k.

    Args:
        logits: this rank's vocabulary shard ``[..., W]`` (bf16, fp16 or fp32, W = padded V / tp),
            rank r holding global ids ``[r*W, (r+1)*W)`` (or from ``vocab_start``). Never
            modified; no gradient flows.
        k: how many ids per token, ``1 <= k <= vocab_size``. Must be equal on all ranks.
        tp_group: the vocabulary's tensor-parallel group; None = no tensor parallelism.
        vocab_size: the real (unpadded) vocabulary size V; ids ``>= V`` are never returned.
            Default ``W * tp``.
        vocab_start: this shard's first global id, for unequal shards (as
            ``vocab_parallel_stats``); every rank then sends k candidates.
        temperature: logits are divided by it before the softmax (> 0).
        chunk_size: tokens upcast to fp32 at a time (default as ``vocab_parallel_stats``); results
            do not depend on it.
        validate: the host-reading checks of ``vocab_parallel_stats`` (cross-rank agreement of
            shapes and options, finite logsumexp).

    Returns:
        :class:`TopK` ``(logprobs fp32 [..., k], indices int64 [..., k])``, sorted by descending
        log-prob, equal ids order by lowest id; identical on every rank. A logit of -inf gives a
        log-prob of -inf; a row holding a NaN logit is all NaN (``validate``: an error). Not
        differentiable (the teacher is a constant).

    Communication: one all-gather of ``[5 + 2 min(k, W), T]`` int32 in forward (plus, with
    ``validate`` on tp > 1, one of a few int64: the core checks and the agreement on ``k``).
    Memory: the core op's two fp32 ``[chunk, W]`` buffers plus a few chunk-sized int64 keys, and
    ``O(tp * k * T)`` for the candidates.

    Raises:
        ValueError: ``k`` not an int in ``[1, V]`` (``InputTypeError``, also a ``TypeError``,
            when not an int at all), and everything ``vocab_parallel_stats`` raises
            for the logits and options (NaN or +inf logits included, with ``validate``); under
            ``validate`` and tp > 1 on every rank, also for a ``k`` that differs across them.
    """
    return _topk(logits, k, tp_group, normalize=True, vocab_size=vocab_size,
                 vocab_start=vocab_start, temperature=temperature, chunk_size=chunk_size,
                 validate=validate)


def _topk(logits, k, tp_group, *, normalize: bool, vocab_size, **options) -> TopK:
    width = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() else 0
    vocab = real_vocab(width, tp_group, vocab_size)
    problem = k_problem(k, vocab) if vocab is not None else None
    stats_cfg = checked_config(logits, None, tp_group, local_error=problem, agree=agreement(k),
                               vocab_size=vocab_size, entropy="off", ignore_index=-100,
                               label_smoothing=0.0, **options)
    cfg = TopKConfig(stats=stats_cfg, k=k, normalize=normalize)
    logits2d = logits.detach().reshape(-1, stats_cfg.layout.width)
    with torch.no_grad():
        chunks = ((rows, z, scratch) for rows, z, scratch, *_ in
                  _chunks(logits2d, None, None, stats_cfg))
        top = topk_pass(chunks, logits2d.shape[0], logits.device, cfg, tp_group)
    shape = (*logits.shape[:-1], k)
    return TopK(top.logprobs.view(shape), top.indices.view(shape))


def vocab_parallel_topk_logits(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    validate: bool = True,
) -> TopKLogits:
    """Global top-k of the raw logits and their ids, without gathering the vocabulary.

    Reference semantics (one process, full vocabulary)::

        torch.topk(logits.float()[..., :V], k)   # ties: the lowest id first

    The same pass as :func:`vocab_parallel_topk` (same candidates, tie rule, arguments, errors and
    one all-gather) returning the logits instead of their log-probs: e.g. a sampler's top-k
    filter, or raw-logit distillation. Logits at or below -1e30 come out -inf; a row holding a
    NaN logit is all NaN (``validate``: an error). Not differentiable.

    Returns:
        :class:`TopKLogits` ``(logits fp32 [..., k], indices int64 [..., k])``, equal on every
        rank.
    """
    return TopKLogits(*_topk(logits, k, tp_group, normalize=False, vocab_size=vocab_size,
                             vocab_start=vocab_start, temperature=1.0, chunk_size=chunk_size,
                             validate=validate))


# ---------------------------------------------------------------------------------------------
# Student: log-probs at given ids


class _TopKLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, indices, valid, cfg: StatsConfig, tp_group):
        logits2d = logits.reshape(-1, cfg.layout.width)
        indices2d = indices.reshape(-1, indices.shape[-1])
        chunks = ((rows, logits2d[rows], z, scratch)
                  for rows, z, scratch, *_ in _chunks(logits2d, None, None, cfg))
        logprobs, lse = picked_pass(chunks, indices2d, valid, cfg, tp_group)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, indices, valid, lse)
        ctx.set_materialize_grads(False)
        return logprobs.view(indices.shape)

    @staticmethod
    @first_order_backward("vocab_parallel_topk_logprobs")
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        logits, indices, valid, lse = ctx.saved_tensors
        cfg: StatsConfig = ctx.cfg
        logits2d = logits.reshape(-1, cfg.layout.width)
        local, coef, hits, lse = backward_terms(grad, indices, valid, lse, cfg)
        grad_logits = torch.empty_like(logits2d)
        for rows, z, scratch, _, _ in _chunks(logits2d, None, None, cfg):
            chunk_topk_grad(z, scratch, grad_logits[rows], lse=lse[rows], coef=coef[rows],
                            hits=hits[rows], local=local[rows], valid=valid[rows],
                            layout=cfg.layout)
        return grad_logits.view(logits.shape), None, None, None, None


def vocab_parallel_topk_logprobs(
    logits: torch.Tensor,
    indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Log-probs at given global ids, normalised over the full vocabulary, from vocab-parallel
    logits.

    Reference semantics (one process, ``z = logits.float()[..., :V] / temperature``)::

        torch.log_softmax(z, -1).gather(-1, indices)       # 0 at rows where mask == 0

    computed without gathering the vocabulary and without an fp32 copy of the logits: the k
    columns are picked in the storage dtype and only the ``[T, k]`` result is upcast; the
    normaliser comes from the core op's per-shard statistics (``docs/numerics.md``). For k = 1 it
    is bit for bit ``vocab_parallel_logprobs``.

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); differentiable; never modified.
        indices: integer global ids ``[..., k]`` (leading shape that of ``logits``), e.g. the
            teacher's :func:`vocab_parallel_topk` ids. Duplicates allowed (their gradients add up).
        tp_group: the vocabulary's tensor-parallel group; None = no tensor parallelism.
        mask: optional, shaped like ``logits.shape[:-1]``; rows where it is 0 get log-prob 0 and
            exactly zero gradient whatever their ids or logits hold (padded positions with k
            copies of id 0, all -inf logits). None = every row.
        vocab_size, vocab_start, temperature, chunk_size, validate: as
            ``vocab_parallel_stats``; the gradient is divided by the temperature too.

    Returns:
        fp32 ``[..., k]`` log-probs (nats), identical on every rank; -inf where the logit is -inf;
        NaN at an unmasked id outside ``[0, V)`` when ``validate`` is off (with it: an error);
        such an id passes no gradient.

    Gradient: ``d/dz_j sum_k g_k log p(i_k) = sum_k g_k 1[j = i_k] - p_j sum_k g_k`` (divided by
    the temperature), recomputed chunk by chunk in fp32 and cast once to the logits dtype.

    Communication: one all-gather of ``[5 + k, T]`` fp32 in forward (plus, with ``validate`` on
    tp > 1, one of a few int64: the core checks and the agreement on ``k``, ``mask`` and the
    ids), none in backward. Memory: two fp32 ``[chunk, W]`` buffers, ``O(tp k T)`` fp32;
    backward allocates the logits gradient once, in the logits dtype.

    Raises:
        ValueError: ``indices`` not an integer tensor ``[..., k]`` with the logits' leading shape,
            a misshapen ``mask``, devices that differ, (with ``validate``) unmasked ids outside
            ``[0, V)``, and everything ``vocab_parallel_stats`` raises; under ``validate`` and
            tp > 1 on every rank, also for a ``k``, ``mask`` or ids at unmasked rows that differ
            across the ranks (compared by checksum; the message names the ranks that differ).
            ``indices`` not a tensor: ``InputTypeError`` (a ``TypeError`` and ``ValueError``).
        RuntimeError: on double backward (``create_graph=True``), which is not supported.
    """
    cfg, valid = picked_config(logits, indices, mask, tp_group, vocab_size=vocab_size,
                               vocab_start=vocab_start, chunk_size=chunk_size,
                               temperature=temperature, validate=validate)
    return _TopKLogprobs.apply(logits, indices, valid, cfg, tp_group)


def picked_config(logits, indices, mask, tp_group, *, vocab_size, validate, **options):
    """``(StatsConfig, valid rows [T])`` of an op reading the logits at ``indices``: the index
    and mask checks (:func:`index_problem`) raised through the core checks' exchange, with the
    agreement on ``k``, the mask and the ids."""
    problem = None
    if isinstance(logits, torch.Tensor) and logits.dim():  # else the core checks name logits
        try:
            problem = index_problem(indices, mask, logits.shape[:-1], logits.device,
                                    real_vocab(logits.shape[-1], tp_group, vocab_size),
                                    host_checks_enabled(validate is True, logits.device))
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the core exchange
            problem = exc
    cfg = checked_config(logits, None, tp_group, local_error=problem,
                         agree=agreement(lambda: indices.shape[-1], indices, mask),
                         vocab_size=vocab_size, entropy="off", ignore_index=-100,
                         label_smoothing=0.0, validate=validate, **options)
    return cfg, valid_rows(mask, logits.numel() // cfg.layout.width, logits.device)


# ---------------------------------------------------------------------------------------------
# Raw logits at given ids


class _GatherLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, indices, valid, cfg: StatsConfig, tp_group):
        logits2d = logits.reshape(-1, cfg.layout.width)
        local, owned, in_range = locate(indices.reshape(-1, indices.shape[-1]), valid, cfg.layout)
        # Each id is owned by one rank and -0.0 elsewhere (x + -0.0 == x for every x, -0.0 and
        # -inf included): the rank-order sum is exact.
        mine = torch.where(owned, logits2d.gather(1, local).float(), -0.0).t().contiguous()
        parts = _comm.gather_stats(mine, tp_group)
        picked = parts[0]
        for part in parts[1:]:  # (torch.sum would start from +0.0 and lose a -0.0)
            picked = picked + part
        picked = picked.t()
        picked = torch.where(in_range | ~valid.unsqueeze(1), picked, float("nan"))
        ctx.cfg = cfg
        ctx.save_for_backward(local, owned)
        ctx.logits_shape = logits.shape
        ctx.logits_dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return torch.where(valid.unsqueeze(1), picked, 0.0).view(indices.shape)

    @staticmethod
    @first_order_backward("vocab_parallel_gather_logits")
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None
        local, owned = ctx.saved_tensors
        g = torch.where(owned, grad.reshape(local.shape).float(), 0.0)
        grad_logits = torch.zeros((local.shape[0], ctx.cfg.layout.width), dtype=torch.float32,
                                  device=grad.device).scatter_add_(1, local, g)
        return grad_logits.to(ctx.logits_dtype).view(ctx.logits_shape), None, None, None, None


def vocab_parallel_gather_logits(
    logits: torch.Tensor,
    indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The logits at global ids from vocab-parallel shards: ``logits_full.gather(-1, indices)``.

    Reference semantics (one process, full vocabulary)::

        logits_full.float().gather(-1, indices)        # [..., k]

    Each rank picks the ids it owns (in the storage dtype, then upcast: exact), and one
    all-gather of ``[k, T]`` fp32 sums them in rank order (every id has one owner, so the sum is
    exact). Differentiable: the gradient goes to the owned columns (duplicate ids add up), with
    no collective in backward.

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); never modified.
        indices: integer global ids ``[..., k]`` with the logits' leading shape.
        tp_group, vocab_size, vocab_start, validate: as :func:`vocab_parallel_stats`.
        mask: optional, shaped like ``logits.shape[:-1]``: rows where it is 0 give 0 and zero
            gradient whatever their ids hold.

    Returns:
        fp32 ``[..., k]``, equal on every rank, bit for bit the logits' values (-inf and -0.0
        included); NaN at an unmasked id outside ``[0, V)`` when ``validate`` is off (with it:
        an error).

    Raises:
        ValueError: as :func:`vocab_parallel_topk_logprobs` (``indices``, ``mask``, ids out of
            range with ``validate``, and what ``vocab_parallel_stats`` raises for the logits);
            under ``validate`` and tp > 1 on every rank. RuntimeError on double backward.
    """
    cfg, valid = picked_config(logits, indices, mask, tp_group, vocab_size=vocab_size,
                               vocab_start=vocab_start, chunk_size=None, temperature=1.0,
                               validate=validate)
    return _GatherLogits.apply(logits, indices, valid, cfg, tp_group)
