"""The per-chunk seam of the chunk engine: what an op computes for one chunk of tokens.

The engine (:mod:`.chunks`, :mod:`.linear`, :mod:`.recompute`) owns the loops, buffers,
collectives and weight-gradient GEMMs; an op plugs in only its statistics of a chunk
(:class:`ChunkStats`, gathered across the shards by the engine or the op's pass) and its gradient
(:class:`ChunkGrad`, made into the logits gradient, :func:`.chunks.logits_grad`, or into
``dX``/``dW``, :func:`.recompute.recompute_backward`). Kernel backends (:mod:`.backends`) plug in
here too: given a :class:`Chunk` and an output tensor, a kernel must stay within the error bounds
of ``docs/numerics.md`` (not the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .._grad import chunk_grad
from .._layout import ShardLayout
from .._math import block_stats, chunk_stats


class Chunk(NamedTuple):
    """One chunk of ``n`` tokens, as the engine hands it to an op.

    ``rows``: a slice of the flattened ``[T]`` tokens. ``z``: fp32 ``[n, W]`` (``[n, padded W]``
    for block statistics) from ``_math.load_chunk``, and ``scratch`` fp32 of at least its size,
    both overwritable; both None for a backend that reads ``logits`` itself (Triton).
    ``index``/``owned``: ``[n]`` int64 local column of each row's target and whether this shard
    owns it (``_layout.local_target_index``); None without targets. ``logits``: ``[n, W]`` in the
    storage dtype, a view of the op's logits or the fused head's GEMM buffer (the gradient may
    overwrite it); None for a fused chunk whose logits a kernel computes from ``hidden`` ``[n, H]``
    and the weight shard ``weight`` ``[W, H]`` (model dtype; both None otherwise).
    """

    rows: slice
    z: torch.Tensor | None
    scratch: torch.Tensor | None
    index: torch.Tensor | None
    owned: torch.Tensor | None
    logits: torch.Tensor | None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None


class ChunkStats(Protocol):
    """Statistics of this chunk: write the rows' per-shard statistics into ``out`` (fp32;
    ``[NUM_STATS, n]``, or ``[NUM_STATS, n, nb]`` per block). Implementations are frozen
    dataclasses with ``eq=False`` (hashed by identity): torch 2.11's dynamo hashes a callable it
    built in the traced region before its fields are set."""

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None: ...


class ChunkGrad(Protocol):
    """Gradient of this chunk: write ``d loss / d logits`` of the chunk's rows into ``out``
    (``[n, W]``, the logits' dtype, rounded once; ``out`` may be ``chunk.logits``)."""

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class ShardStats:
    """The core op's :class:`ChunkStats`: ``_math.chunk_stats``, or with ``blocks``
    ``_math.block_stats``."""

    layout: ShardLayout
    entropy: bool
    zsum: bool
    batch_invariant: bool = False
    blocks: bool = False
    argmax: bool = False

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None:
        opts = dict(layout=self.layout, entropy=self.entropy, zsum=self.zsum, argmax=self.argmax)
        if self.blocks:
            block_stats(chunk.z, chunk.scratch, chunk.index, chunk.owned, out, **opts)
        else:
            chunk_stats(chunk.z, chunk.scratch, chunk.index, chunk.owned, out,
                        batch_invariant=self.batch_invariant, **opts)


@dataclass(frozen=True, slots=True, eq=False)
class StatsGrad:
    """The core op's :class:`ChunkGrad`: ``_grad.chunk_grad`` from per-token ``[T]`` vectors
    (``lse`` finite, ``ent`` the forward's entropy; None where unused)."""

    lse: torch.Tensor
    ent: torch.Tensor | None
    coef_lp: torch.Tensor | None
    coef_h: torch.Tensor | None
    valid: torch.Tensor | None
    layout: ShardLayout
    label_smoothing: float
    lse_lo: torch.Tensor | None = None

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None:
        rows = chunk.rows
        chunk_grad(
            chunk.z, chunk.scratch, out,
            lse=self.lse[rows],
            lse_lo=self.lse_lo[rows] if self.lse_lo is not None else None,
            ent=self.ent[rows] if self.ent is not None else None,
            coef_lp=self.coef_lp[rows] if self.coef_lp is not None else None,
            coef_h=self.coef_h[rows] if self.coef_h is not None else None,
            index=chunk.index, owned=chunk.owned,
            valid=self.valid[rows] if self.valid is not None else None,
            layout=self.layout,
            label_smoothing=self.label_smoothing,
        )
