"""Lazy lookups of ``megatron.core`` names the losses, packing and ops need (tensor-parallel group
and size, padded vocabulary size, ``PackedSeqParams``), without importing Megatron.
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def packed_seq_params_class():
    """Megatron's ``PackedSeqParams`` dataclass, or None where megatron-core is not importable."""
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return None
    return PackedSeqParams


def tp_group_of(module) -> dist.ProcessGroup | None:
    """The tensor-parallel group of a Megatron module: ``module.tp_group`` (0.16+),
    ``pg_collection.tp`` (0.15+), ``model_comm_pgs.tp`` (0.14), else :func:`default_tp_group`."""
    group = getattr(module, "tp_group", None)
    if group is not None:
        return group
    for holder in ("pg_collection", "model_comm_pgs"):
        group = getattr(getattr(module, holder, None), "tp", None)
        if group is not None:
            return group
    return default_tp_group()


def megatron_tp_size() -> int | None:
    """Megatron's tensor-parallel size if ``parallel_state`` is initialised, 0 if imported but not
    initialised, None if never imported (for the ops' missing-``tp_group`` check)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_world_size()


def megatron_padded_vocab_size() -> int | None:
    """``args.padded_vocab_size`` of a Megatron-LM training run where set, else None."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    size = getattr(getattr(global_vars, "_GLOBAL_ARGS", None), "padded_vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def default_tp_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group if ``parallel_state`` is initialised (never imported
    here), else None; for Megatron-facing code only, never read by the ops."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
