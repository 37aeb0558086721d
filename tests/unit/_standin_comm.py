"""Test support shared by the framework stand-ins (`_slime_standin`, `_nemo_rl_standin`)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumPassGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def summed(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce sum over ``group`` (``x`` itself for a group of one or None) whose gradient
    passes through unchanged: every rank computes the same loss from the sum, as the frameworks'
    hand-written backwards assume."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumPassGrad.apply(x, group)
