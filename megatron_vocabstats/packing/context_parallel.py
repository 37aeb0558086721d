"""Context parallelism over packed or ``[b, s]`` batches: a rank's load-balanced (zigzag)
positions, sharding, and its differentiable inverse (one all-gather).
"""

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
    """Packed positions held by each of ``ranks`` ([K] int64): int64 ``[K, total // cp]``.

    Local position j of rank r lies in sequence i (found on ``cu_padded // cp``) at offset o; with
    half = (padded length of i) / (2 cp), it is chunk r of i for o < half, else chunk 2cp-1-r.
    """
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

    Each padded sequence is cut into ``2 * cp_size`` chunks; the rank keeps chunk ``cp_rank`` then
    chunk ``2 * cp_size - 1 - cp_rank`` of every sequence, sequence after sequence: transformer-
    engine's ``thd_get_partitioned_indices(cu_seqlens_padded, total_tokens, cp_size, cp_rank)``
    (as int64). ``cu_seqlens_padded=None`` is one sequence (Megatron's split of a ``[b, s]`` batch).

    Args:
        cu_seqlens_padded: ``[N + 1]`` integer cumulative padded lengths ending at T, every step a
            multiple of ``2 * cp_size``; or None.
        total_tokens: T, a multiple of ``2 * cp_size``.
        device: where to build the indices when ``cu_seqlens_padded`` is None (default CPU).
        validate: check ``cu_seqlens_padded``'s values (host read; skipped during CUDA graph
            capture).

    Returns int64 ``[total_tokens // cp_size]`` on the device of ``cu_seqlens_padded``.

    Raises ``ValueError`` for bad sizes or rank, T not a multiple of ``2 * cp_size``, and with
    ``validate`` a ``cu_seqlens_padded`` not starting at 0, decreasing, not ending at T, or with a
    step that is not a multiple of ``2 * cp_size``.
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
    cp_size=cp, cp_rank=rank))``, with ``T / cp`` tokens along ``dim``. No communication.

    Args:
        x: a tensor with T tokens along ``dim`` (THD ``[1, T]``, ``[b, s]``, hidden ``[T, 1, h]``
            with ``dim=0``), or a :class:`PackedBatch`: its tokens, labels, loss_mask and
            position_ids are sharded along dim 1 by its own ``cu_seqlens_padded``; the rest stays
            global, as Megatron passes it to transformer-engine under context parallelism.
        cp_group: the context-parallel group; None (or size 1) returns ``x`` itself.
        cu_seqlens_padded, validate: as in :func:`context_parallel_indices` (not with a
            PackedBatch); every rank raises alike.

    Raises ``ValueError`` for ``dim`` out of range, ``cu_seqlens_padded`` with a PackedBatch, and
    what :func:`context_parallel_indices` raises.
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
    """Per-token values of all context-parallel ranks, back in packed order: the inverse of
    :func:`shard_for_context_parallel`.

    ``gather_from_context_parallel(shard_for_context_parallel(v, g, ...), g, ...)`` equals ``v``
    bitwise on every rank: ``[..., T, ...]`` with ``T = cp * x.shape[dim]``. The backward hands
    each rank the upstream gradient at its own positions (no collective): the exact gradient when
    every cp rank computes the same function of the gathered tensor, since Megatron's gradient
    reduction over dp x cp then counts each token once. Communication: one all-gather of ``x``.

    Args:
        x: this rank's shard along ``dim``, any dtype; the same shape and dtype on every rank.
        cp_group: the context-parallel group; None (or size 1) returns ``x`` itself.
        cu_seqlens_padded: the global cumulative padded lengths used to shard, or None.
        validate: check ``cu_seqlens_padded`` and, with one all-gather of a few int64, that all
            ranks agree on shard size, dtype, other dimensions, ``cu_seqlens_padded`` and
            ``dim``, so that bad input raises on every rank instead of hanging. Skipped during
            CUDA graph capture. Must be equal on all ranks.

    Raises ``ValueError`` for ``dim`` out of range, an odd local token count, and with
    ``validate`` a bad ``cu_seqlens_padded`` (as :func:`context_parallel_indices`) or shards that
    differ across ranks, on all ranks.
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
