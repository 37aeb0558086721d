"""Context parallelism over packed or ``[b, s]`` batches: the zigzag split and its inverse."""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist

from ..ops._comm import all_gather_flat, group_rank_size
from ..ops.agreement import Field, agree_across_ranks, host_checks_enabled
from ..ops.options import check_bool, check_number
from .checks import _check_cumulative, _count, _cumulative, _positive_int, _seq_dim
from .layout import PackedBatch


def _cp_positions(cu_padded: torch.Tensor, total: int, cp: int, ranks: torch.Tensor):
    """``[K, total // cp]`` packed positions of ``ranks`` ``[K]``: local j in sequence i at offset o
    is in chunk r of i for o < half = (padded length of i) / 2cp, else in chunk 2cp-1-r."""
    local = cu_padded // cp
    j = torch.arange(total // cp, device=cu_padded.device)
    seq = torch.searchsorted(local[1:], j, right=True).clamp_(max=local.numel() - 2)
    start = local[seq]
    half = (local[seq + 1] - start) // 2
    offset = j - start
    second = offset >= half
    chunk = torch.where(second, 2 * cp - 1 - ranks.unsqueeze(1), ranks.unsqueeze(1))
    return start * cp + chunk * half + offset - torch.where(second, half, 0)


def _cp_layout(cu_seqlens_padded, total: int, cp: int, device, *, validate: bool,
               what: str) -> torch.Tensor:
    """Checked int64 cumulative padded lengths (``[0, total]`` when None) for a cp split."""
    multiple = 2 * cp if cp > 1 else 1
    why = f" (= 2 * cp_size for cp_size={cp}; pad with pack_sequences(alignment=...))"
    if total % multiple:
        raise ValueError(f"{what} has {total} tokens in all, not a multiple of {multiple}{why}")
    if cu_seqlens_padded is None:
        return torch.arange(2, device=device) * total  # a kernel, not a host-to-device copy
    cu = _cumulative(cu_seqlens_padded, "cu_seqlens_padded", device)
    if host_checks_enabled(validate, device):
        _check_cumulative(cu, "cu_seqlens_padded", total=total, multiple=multiple, why=why)
    return cu


def context_parallel_indices(cu_seqlens_padded: torch.Tensor | None, total_tokens: int, *,
                             cp_size: int, cp_rank: int, device=None,
                             validate: bool = True) -> torch.Tensor:
    """Packed positions that context-parallel rank ``cp_rank`` of ``cp_size`` keeps, in its order.

    Chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of the ``2 * cp_size`` of every padded
    sequence: transformer-engine's ``thd_get_partitioned_indices(cu_seqlens_padded, total_tokens,
    cp_size, cp_rank)``, int64 ``[total_tokens // cp_size]`` on ``cu_seqlens_padded``'s device
    (else ``device``, default CPU). ``cu_seqlens_padded``: ``[N + 1]`` integer cumulative padded
    lengths ending at ``total_tokens``, or None: one sequence (Megatron's split of ``[b, s]``).

    Raises ``ValueError`` for bad sizes or rank, ``total_tokens`` not a multiple of ``2 *
    cp_size``, and with ``validate`` bad cumulative lengths (:mod:`~megatron_vocabstats.packing`).
    """
    validate = check_bool("validate", validate)
    cp = _positive_int(cp_size, "cp_size")
    cp_rank = check_number("cp_rank", cp_rank, integer=True, low=0, high=cp, high_open=True)
    total_tokens = _count(total_tokens, "total_tokens", low=0)
    if cu_seqlens_padded is not None:
        device = cu_seqlens_padded.device if isinstance(cu_seqlens_padded, torch.Tensor) else None
    return _rank_positions(cu_seqlens_padded, total_tokens, cp, cp_rank,
                           torch.device(device or "cpu"), validate=validate, what="total_tokens")


def _rank_positions(cu_seqlens_padded, total, cp, rank, device, *, validate, what):
    cu = _cp_layout(cu_seqlens_padded, total, cp, device, validate=validate, what=what)
    ranks = torch.full((1,), rank, dtype=torch.int64, device=device)
    return _cp_positions(cu, total, cp, ranks)[0]


def shard_for_context_parallel(
    x: torch.Tensor | PackedBatch,
    cp_group: dist.ProcessGroup | None,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    dim: int = 1,
    validate: bool = True,
) -> torch.Tensor | PackedBatch:
    """This context-parallel rank's load-balanced share of ``x`` along the sequence dimension.

    Equals ``x.index_select(dim, context_parallel_indices(cu_seqlens_padded, x.shape[dim],
    cp_size=cp, cp_rank=rank))``; no communication; ``cp_group`` None (or size 1) returns ``x``.
    A :class:`PackedBatch` has its tokens, labels, loss_mask and position_ids sharded along dim 1
    by its own ``cu_seqlens_padded``; the rest stays global, as Megatron passes it to
    transformer-engine.

    Raises ``ValueError``, alike on every rank, for ``dim`` out of range, ``cu_seqlens_padded``
    with a PackedBatch, and what :func:`context_parallel_indices` raises.
    """
    validate = check_bool("validate", validate)
    rank, cp = group_rank_size(cp_group)
    if isinstance(x, PackedBatch):
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded: a PackedBatch carries its own")
        if cp == 1:
            return x
        index = _rank_positions(x.cu_seqlens_padded, x.tokens.shape[1], cp, rank, x.tokens.device,
                                validate=validate, what="x.tokens")
        return dataclasses.replace(
            x, **{name: getattr(x, name).index_select(1, index)
                  for name in ("tokens", "labels", "loss_mask", "position_ids")})
    dim = _seq_dim(x, dim)
    if cp == 1:
        return x
    index = _rank_positions(cu_seqlens_padded, x.shape[dim], cp, rank, x.device,
                            validate=validate, what=f"x (dim {dim})")
    return x.index_select(dim, index)


class _GatherFromContextParallel(torch.autograd.Function):
    """All-gather the cp shards into packed order; backward: this rank's slice, no collective."""

    @staticmethod
    def forward(ctx, x, inverse, own, dim, group):
        ctx.dim = dim
        ctx.save_for_backward(own)
        local = x.movedim(dim, 0)
        gathered = all_gather_flat(local, group)
        full = gathered.reshape(-1, *local.shape[1:]).index_select(0, inverse)
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        (own,) = ctx.saved_tensors
        return grad.index_select(ctx.dim, own), None, None, None, None


def _signature(*parts) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


_GATHER_AGREEMENT = ("local token count", Field("dtype", checksum=True),
                     Field("other dimensions", checksum=True),
                     Field("cu_seqlens_padded", checksum=True), "dim")


def gather_from_context_parallel(
    x: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    dim: int = 1,
    validate: bool = True,
) -> torch.Tensor:
    """The inverse of :func:`shard_for_context_parallel`: all ranks' shards in packed order.

    ``gather_from_context_parallel(shard_for_context_parallel(v, g, ...), g, ...)`` equals ``v``
    bitwise on every rank, with ``cp * x.shape[dim]`` tokens; one all-gather of ``x`` (same shape
    and dtype on every rank). The backward hands each rank the gradient at its own positions, no
    collective: exact when every cp rank computes the same function of the result (Megatron's
    gradient reduction over dp x cp then counts each token once). ``validate`` (equal on all
    ranks) adds one all-gather of a few int64 so that shards that disagree raise on every rank.

    Raises ``ValueError`` for ``dim`` out of range, an odd local token count, and with
    ``validate``, on all ranks, a bad ``cu_seqlens_padded`` (as :func:`context_parallel_indices`)
    or shards that differ across ranks (size, dtype, other dimensions, layout, ``dim``).
    """
    validate = check_bool("validate", validate)
    rank, cp = group_rank_size(cp_group)
    if cp == 1:
        _seq_dim(x, dim)
        return x
    device = x.device if isinstance(x, torch.Tensor) else None
    exchange = host_checks_enabled(validate, device or torch.device("cpu"))
    error, cu, row = None, None, [-1] * len(_GATHER_AGREEMENT)
    try:
        dim = _seq_dim(x, dim)
        total = x.shape[dim] * cp
        cu = _cp_layout(cu_seqlens_padded, total, cp, device, validate=validate,
                        what=f"x (dim {dim}, times cp_size={cp})")
        if exchange:
            others = x.shape[:dim] + x.shape[dim + 1:]
            row = [x.shape[dim], _signature(x.dtype), _signature(tuple(others)),
                   _signature(cu.tolist()), dim]
    except Exception as exc:
        if not exchange:
            raise
        error = exc
    if exchange:
        agree_across_ranks(error, row, _GATHER_AGREEMENT, cp_group, device=device,
                           group_name="cp_group",
                           hint="every rank must pass its own shard of the same packed layout")
    positions = _cp_positions(cu, total, cp, torch.arange(cp, device=device)).reshape(-1)
    inverse = torch.zeros_like(positions).scatter_(
        0, positions, torch.arange(total, device=device))
    return _GatherFromContextParallel.apply(x, inverse, positions[rank * (total // cp):
                                                                  (rank + 1) * (total // cp)],
                                            dim, cp_group)
