"""Collectives of the vocab-parallel ops, kept apart from their math.

``group=None`` always means "no tensor parallelism" (a single shard holding the whole
vocabulary), never "the global default group".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._argtypes import InputTypeError


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``, ``(0, 1)`` for None; ``TypeError`` (also a
    ``ValueError``) naming ``tp_group`` for anything else."""
    if group is None:
        return 0, 1
    if not isinstance(group, dist.ProcessGroup):
        raise InputTypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got "
                             f"{type(group).__name__}")
    return dist.get_rank(group), dist.get_world_size(group)


def backend_for(group: dist.ProcessGroup, device_type: str) -> str:
    """The lower-case backend of ``group``'s collectives on ``device_type`` tensors: of a
    per-device string such as ``"cpu:gloo,cuda:nccl"`` (also TorchComms') the one named for that
    type (``""`` if none), else the single backend. Never a substring test: that string is no
    gloo group for CUDA tensors."""
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return name
    pairs = (part.split(":", 1) for part in name.split(","))
    return {dev.strip(): backend.strip() for dev, backend in pairs}.get(device_type, "")


def exchange_device(group: dist.ProcessGroup) -> torch.device:
    """The device of a small collective over ``group`` that no tensor places (a rank whose
    ``logits`` is not a tensor still joins the check exchange): the current CUDA device if CUDA
    is available and the group's CUDA backend is not gloo (or none), else the CPU; every rank
    decides alike from the backend string."""
    cuda = backend_for(group, "cuda")
    if not torch.cuda.is_available() or cuda in ("", "gloo"):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_flat(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One all-gather of a contiguous tensor: returns ``[size, *tensor.shape]`` in rank order."""
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                      device=tensor.device)
    # torch >= 2.12 names it all_gather_single; both take the output concatenated along dim 0.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)
    return out.view(size, *tensor.shape)


def gather_stats(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All shards' packed statistics ``[tp, *local.shape]`` from one all-gather (none for tp=1),
    not an all-reduce: every rank merges them in the same rank order (bitwise equal results; one
    collective instead of a MAX then a SUM)."""
    if group is None or dist.get_world_size(group) == 1:
        return local.unsqueeze(0)
    return all_gather_flat(local, group)


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup, *, device) -> list[list[int]]:
    """Every rank's ``values`` (a few int64 numbers), in rank order, from one all-gather (the
    input checks: mismatched shards give a clear error instead of a hang or a wrong number)."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    return all_gather_flat(mine, group).tolist()


def gather_sequence(shard: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's sequence-parallel gather: every rank's ``[s, ...]`` shard concatenated in rank
    order (``[tp * s, ...]``), one all-gather; ``shard`` itself for tp=1. The shapes must match
    (check first: a mismatch fails or hangs in the collective)."""
    if group is None or dist.get_world_size(group) == 1:
        return shard
    gathered = all_gather_flat(shard, group)
    return gathered.view(gathered.shape[0] * gathered.shape[1], *shard.shape[1:])


def reduce_scatter_sequence(full: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Inverse of :func:`gather_sequence` for gradients: rows ``[rank * s, (rank + 1) * s)`` of
    the sum of ``full`` ``[tp * s, ...]`` over ``group``. One reduce-scatter, or on gloo without
    one :func:`reduce_scatter_by_all_reduce` (in place: the caller must own ``full``)."""
    if group is None or dist.get_world_size(group) == 1:
        return full
    size = dist.get_world_size(group)
    if full.shape[0] % size:
        raise ValueError(f"reduce_scatter_sequence: {full.shape[0]} rows do not split over "
                         f"{size} ranks")
    full = full.contiguous()
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    # torch >= 2.12 names it reduce_scatter_single; both take the input concatenated along dim 0.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    try:
        scatter(out, full, group=group)
    except RuntimeError:
        if backend_for(group, full.device.type) != "gloo":
            raise
        return reduce_scatter_by_all_reduce(full, group)
    return out


def reduce_scatter_by_all_reduce(full: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The CPU fallback of :func:`reduce_scatter_sequence`: all-reduce ``full`` in place, keep
    this rank's rows (a copy, so that ``full`` can be freed)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    dist.all_reduce(full, group=group)
    rows = full.shape[0] // size
    return full[rank * rows:(rank + 1) * rows].clone()


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (one all-reduce; nothing for tp=1); returns it."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor
