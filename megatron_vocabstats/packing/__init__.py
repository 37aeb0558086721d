"""Packed sequences (THD) and context parallelism, vectorised and free of host syncs.

A packed batch is one row ``[1, T]`` of N sequences back to back, each padded to a multiple of an
alignment, with labels shifted inside each sequence (:class:`PackedBatch`). Context parallelism
gives rank r chunks r and ``2 * cp - 1 - r`` of the ``2 * cp`` chunks of every padded sequence
(:func:`context_parallel_indices`). Only ``validate=True`` (the default, as in the ops) reads
values on the host; pass ``validate=False`` in hot code. More: ``docs/ops.md``, "Packed
sequences and context parallelism".
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
