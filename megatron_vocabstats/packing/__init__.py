"""Packed sequences (THD) and context parallelism, vectorised and free of host syncs.

A packed batch is one row ``[1, T]`` holding N sequences back to back, each padded to a multiple
of an alignment; ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (padded lengths) are the
``[N + 1]`` int32 cumulative sums that Megatron's ``PackedSeqParams(qkv_format="thd")`` and
transformer-engine read. Padding added to reach a requested total is part of the last padded
sequence, so ``cu_seqlens_padded[-1] == T`` always holds.

Labels shift inside each sequence: ``labels[p] = tokens[p + 1]`` when p + 1 is a real token of
the same sequence, else ``ignore_index`` (the last real token of each sequence and all padding).

Context parallelism (cp ranks) cuts every padded sequence into ``2 * cp`` equal chunks; rank r
keeps chunks r and ``2 * cp - 1 - r`` of each, in that order ("load-balanced" or zigzag order of
Megatron / transformer-engine ``thd_get_partitioned_indices``), so every rank gets an equal share
of the causal-attention work. A ``[b, s]`` batch is the case of one sequence of length s per row.

Everything is computed with tensor ops (``searchsorted`` over the cumulative lengths, masks as
``arange < lengths``): no Python loop over sequences or rows, no ``.item()``/``.tolist()``, no
data-dependent shape. The one exception is ``validate=True`` (the default, as in the ops): its
value checks read a few numbers on the host. Pass ``validate=False`` in hot or graph-captured code
(the checks are skipped anyway while a CUDA graph is being captured). Every function refuses a
``validate`` (and any other bool option) that is not a bool, naming it (``ops.options.check_bool``:
a ``TypeError`` that is also a ``ValueError``).
"""

from ..ops.options import IGNORE_INDEX
from .context_parallel import (
    context_parallel_indices,
    gather_from_context_parallel,
    shard_for_context_parallel,
)
from .layout import PackedBatch, sequence_alignment, shift_packed_labels
from .pack import make_packed_seq_params, pack_sequences
from .unpack import unpack_sequences

__all__ = [
    "IGNORE_INDEX",
    "PackedBatch",
    "context_parallel_indices",
    "gather_from_context_parallel",
    "make_packed_seq_params",
    "pack_sequences",
    "sequence_alignment",
    "shard_for_context_parallel",
    "shift_packed_labels",
    "unpack_sequences",
]
