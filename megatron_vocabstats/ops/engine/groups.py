"""Megatron's default tensor-parallel group, for the one op that keeps Megatron's
``tp_group=None`` convention (the drop-in ``vocab_parallel_cross_entropy``).

Looked up in the third-party ``megatron.core.parallel_state`` module only when it has already
been imported (Megatron's parallel state can only be initialised if Megatron was imported), so
the ops never import Megatron, nor the ``megatron_vocabstats.megatron`` subpackage.

May import: ``sys`` and ``torch.distributed``; nothing of this package.
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def megatron_default_tp_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group if ``parallel_state`` is initialised, else None
    (the same lookup as ``megatron_vocabstats.megatron.compat.default_tp_group``)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
