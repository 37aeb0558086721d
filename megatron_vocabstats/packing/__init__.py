"""Packed sequences (THD) and context parallelism, vectorised and free of host syncs.

Only ``validate=True`` (the default, as in the ops) reads values on the host, and never during
CUDA graph capture; pass ``validate=False`` in hot code. It checks that cumulative lengths start
at 0, never decrease, end at the packed length, give no sequence more real than padded tokens,
and, under context parallelism, only padded lengths that are multiples of ``2 * cp_size``; without
it such input gives wrong results. Layout and context-parallel split: ``docs/ops.md``, "Packed
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
