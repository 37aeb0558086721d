"""Collectives of the vocab-parallel ops, kept apart from their math.

``group=None`` always means "no tensor parallelism" (a single shard holding the whole
vocabulary), never "the global default group".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ``(0, 1)`` for ``None``."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather_flat(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One all-gather of a contiguous tensor: returns ``[size, *tensor.shape]`` in rank order."""
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    # torch >= 2.12 names it all_gather_single; both take the output concatenated along dim 0.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)
    return out.view(size, *tensor.shape)


def gather_stats(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All shards' packed statistics ``[tp, *local.shape]`` from one all-gather (none for tp=1).

    Gathering the few ``[k, T]`` statistics instead of all-reducing them lets every rank merge
    them in the same fixed rank order: one collective instead of a MAX then a SUM, and results
    that are bitwise equal on every rank.
    """
    if group is None or dist.get_world_size(group) == 1:
        return local.unsqueeze(0)
    return _all_gather_flat(local, group)


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup, *, device) -> list[list[int]]:
    """Every rank's ``values`` (a few int64 numbers), in rank order, from one all-gather.

    Used by the input checks: comparing a handful of sizes costs one tiny collective and turns the
    hang or silently wrong number that mismatched shards would cause into a clear error.
    """
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    return _all_gather_flat(mine, group).tolist()
