"""The top-k ops' math and passes over the engine's chunks (one all-gather each), shared by
``from_logits.py`` and ``from_hidden.py``: candidates ranked by one int64 key per column (value
descending, id ascending), log-probs at given ids, and the gradient of ``sum_k g_k log p(i_k)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _comm
from .._checks import check_finite
from .._grad import chunk_grad, finite_lse, split_lse
from .._layout import ShardLayout
from .._math import NUM_STATS, Z_FLOOR, log_normaliser
from ..agreement import host_checks_enabled
from ..engine.kernel import Chunk, ShardStats
from ..options import StatsConfig

_LOW32 = 2**32


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


# ---------------------------------------------------------------------------------------------
# Pure math (no collectives)


def rank_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering fp32 ``values`` descending, then int64 ``ids`` (in ``[0, 2**32)``,
    broadcastable) ascending: larger key = earlier in the top-k. Equal values (-0.0 and +0.0
    too) differ only by id, so ``torch.topk`` on the keys is deterministic; NaN ranks above +inf."""
    bits = torch.where(values == 0, 0.0, values)
    bits = torch.where(torch.isnan(bits), float("nan"), bits).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    return ordered * _LOW32 + (_LOW32 - 1 - ids)


def chunk_candidates(z: torch.Tensor, layout: ShardLayout, k_local: int):
    """This shard's top ``k_local`` ``(values fp32, global ids int64)``, ``[n, k_local]`` each, of
    a ``[n, W]`` chunk from ``load_chunk`` (padding, at the floor, after equal real columns: higher
    ids). A shard narrower than ``k_local`` fills up with floor values at ids past every shard's."""
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
    """``(z - m) - log S`` of fp32 ``values`` ``[T, k]`` (-inf at the floor, NaN at NaN): the core
    op's ``merge_stats`` rounding, so equal inputs give equal bits."""
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
    """``(local column clamped to [0, W), owned, in_range)`` of global ids ``[T, k]``: ``in_range``
    the id in ``[0, V)``, ``owned`` also on this shard and the row valid."""
    ids = indices2d.long()
    local = ids - layout.vocab_start
    in_range = (ids >= 0) & (ids < layout.vocab_size)
    owned = valid.unsqueeze(1) & in_range & (local >= 0) & (local < layout.width)
    return local.clamp(0, layout.width - 1), owned, in_range


def picked_logits(chunk: torch.Tensor, local: torch.Tensor, owned: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """``z`` at the owned columns of a ``[n, W]`` chunk in its storage dtype as ``[k, n]`` fp32
    (0 where not owned): gathered, then upcast, divided and floored as ``load_chunk`` does (same
    bits)."""
    z = chunk.gather(1, local).float()
    if temperature != 1.0:
        z = z / temperature
    return torch.where(owned, z.clamp(min=Z_FLOOR), 0.0).t()


def chunk_topk_grad(z, scratch, out, *, lse, coef, hits, local, valid, layout: ShardLayout,
                    lse_lo=None):
    """Write the gradient ``hits - coef p`` of ``sum_k g_k log p(i_k)`` for one ``[n, W]`` chunk
    into ``out``, cast once from fp32 (duplicate ids accumulate): ``coef = sum_k g_k / tau`` per
    row, ``hits = g_k / tau`` at owned ids (0 elsewhere), both 0 at invalid rows; ``lse``/``lse_lo``
    as in ``_grad.chunk_grad``."""
    n = z.shape[0]
    grad = scratch[:n]
    chunk_grad(z, scratch, grad, lse=lse, lse_lo=lse_lo, ent=None, coef_lp=coef, coef_h=None,
               index=None, owned=None, valid=valid, layout=layout, label_smoothing=0.0)
    grad.scatter_add_(1, local, hits)
    out.copy_(grad)


def backward_terms(grad, indices, valid, lse, lse_lo, cfg: StatsConfig):
    """What every chunk of a backward needs, from the upstream ``[..., k]`` gradient:
    ``(local [T, k], coef [T], hits [T, k], lse [T], lse_lo [T])`` for
    :func:`chunk_topk_grad`."""
    local, owned, in_range = locate(indices.reshape(-1, indices.shape[-1]), valid, cfg.layout)
    scored = valid.unsqueeze(1) & in_range
    g = torch.where(scored, grad.reshape(local.shape).float(), 0.0) * (1.0 / cfg.temperature)
    return local, g.sum(dim=1), torch.where(owned, g, 0.0), finite_lse(lse, valid), lse_lo


@dataclass(frozen=True, slots=True, eq=False)
class TopKGrad:
    """The top-k log-probs' :class:`~.engine.kernel.ChunkGrad`: :func:`chunk_topk_grad` from the
    per-token terms of :func:`backward_terms` and the rows' ``valid``."""

    local: torch.Tensor
    coef: torch.Tensor
    hits: torch.Tensor
    lse: torch.Tensor
    lse_lo: torch.Tensor
    valid: torch.Tensor
    layout: ShardLayout

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None:
        rows = chunk.rows
        chunk_topk_grad(chunk.z, chunk.scratch, out, lse=self.lse[rows],
                        lse_lo=self.lse_lo[rows], coef=self.coef[rows], hits=self.hits[rows],
                        local=self.local[rows], valid=self.valid[rows], layout=self.layout)


# ---------------------------------------------------------------------------------------------
# Passes over the chunks: shared by the ops on logits and the fused ones (ops/topk/from_hidden.py)


def topk_pass(chunks, num_tokens: int, device, cfg: TopKConfig, tp_group) -> TopK:
    """Flat ``[T, k]`` top-k over ``chunks`` (:class:`~.engine.kernel.Chunk` without targets; z
    overwritten). One all-gather of ``[NUM_STATS + 2 k_local, T]`` int32 per shard (statistics
    and candidate values as fp32 bits, candidate ids), merged in rank order on every rank."""
    layout = cfg.stats.layout
    # Every rank sends as many candidates (one all-gather shape): k, or its width when all equal.
    k_local = min(cfg.k, layout.width) if layout.even else cfg.k
    packed = torch.zeros((NUM_STATS + 2 * k_local, num_tokens), dtype=torch.int32, device=device)
    stats = packed[:NUM_STATS].view(torch.float32)
    values = packed[NUM_STATS:NUM_STATS + k_local].view(torch.float32)
    stats_of = ShardStats(layout, entropy=False, zsum=False)
    for chunk in chunks:
        rows = chunk.rows
        vals, ids = chunk_candidates(chunk.z, layout, k_local)
        values[:, rows] = vals.t()
        packed[NUM_STATS + k_local:, rows] = ids.t().int()
        stats_of(chunk, stats[:, rows])
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
    """``(logprobs [T, k], lse [T], lse_lo [T])`` at ``indices2d`` ``[T, k]`` over ``chunks`` (as
    in :func:`topk_pass`; ``chunk.logits`` read too): 0 at rows not ``valid``, NaN at ids outside
    ``[0, V)`` (let through with ``validate`` off); the logsumexp as ``_grad.split_lse``'s pair.
    One all-gather of ``[NUM_STATS + k, T]`` fp32."""
    num_tokens, k = indices2d.shape
    local, owned, in_range = locate(indices2d, valid, cfg.layout)
    packed = torch.zeros((NUM_STATS + k, num_tokens), dtype=torch.float32, device=valid.device)
    stats_of = ShardStats(cfg.layout, entropy=False, zsum=False)
    for chunk in chunks:
        rows = chunk.rows
        packed[NUM_STATS:, rows] = picked_logits(chunk.logits, local[rows], owned[rows],
                                                 cfg.temperature)
        stats_of(chunk, packed[:NUM_STATS, rows])
    gathered = _comm.gather_stats(packed, tp_group)
    m, log_sumexp = log_normaliser(gathered[:, :NUM_STATS])
    lse, lse_lo = split_lse(m, log_sumexp)
    if host_checks_enabled(cfg.validate, valid.device):
        check_finite(lse, valid, temperature=cfg.temperature)
    lp = logprobs_of(gathered[:, NUM_STATS:].sum(dim=0).t(), m, log_sumexp)
    lp = torch.where(in_range, lp, float("nan"))
    return torch.where(valid.unsqueeze(1), lp, 0.0), lse, lse_lo
