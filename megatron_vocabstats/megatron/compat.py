"""Feature detection across megatron-core releases, in one place.

Every lookup is lazy: importing this module never imports Megatron, transformer-engine or apex.
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def default_tp_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group if ``parallel_state`` is initialised, else None.

    Only the Megatron drop-in :func:`megatron_vocabstats.vocab_parallel_cross_entropy` reads this
    global, to keep Megatron's ``tp_group=None`` convention; the ops themselves never do.
    """
    # Megatron's parallel state can only be initialised if Megatron was imported: don't import it.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
