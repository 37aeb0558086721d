"""Parity of the drop-in with Megatron's own ``tensor_parallel.vocab_parallel_cross_entropy``.

Run by tests/unit/test_megatron_cross_entropy.py (marked ``megatron``) under the primary and the
compatibility megatron-core releases.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main  # noqa: E402

from megatron_vocabstats import vocab_parallel_cross_entropy  # noqa: E402

CASES = Cases()


def _megatron_tp(group):
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return parallel_state


def _shard_case(dtype):
    rank, tp = dist.get_rank(), dist.get_world_size()
    width = 37
    full = (torch.randn(9, 2, width * tp) * 3).to(dtype)  # Megatron layout [s, b, V/tp]
    target = torch.randint(0, width * tp, (9, 2))
    shard = full[..., rank * width:(rank + 1) * width]
    return full, shard, target


@CASES.register
def default_group_and_values_match_megatron(group):
    from megatron.core import tensor_parallel

    _megatron_tp(group)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        _, shard, target = _shard_case(dtype)
        ours_leaf = shard.clone().requires_grad_()
        theirs_leaf = shard.clone().requires_grad_()
        ours = vocab_parallel_cross_entropy(ours_leaf, target)  # tp_group=None: Megatron's group
        theirs = tensor_parallel.vocab_parallel_cross_entropy(theirs_leaf, target)
        assert ours.shape == theirs.shape == target.shape and ours.dtype == theirs.dtype
        err = (ours - theirs).abs().max().item()
        assert err <= tol * max(1.0, theirs.abs().max().item()), f"{dtype}: loss differs by {err}"
        weights = torch.rand(target.shape)
        (ours * weights).sum().backward()
        (theirs * weights).sum().backward()
        gerr = (ours_leaf.grad.float() - theirs_leaf.grad.float()).abs().max().item()
        # Megatron rounds the softmax to the logits dtype before subtracting 1; we do not.
        gtol = 1e-6 if dtype == torch.float32 else 2**-7
        assert gerr <= gtol, f"{dtype}: gradient differs by {gerr}"


if __name__ == "__main__":
    main(CASES)
