"""The per-chunk seam of the chunk engine: what an op computes for one chunk of tokens.

The engine (:mod:`.chunks`, :mod:`.linear`, :mod:`.recompute`) owns the loops, the buffers, the
collectives and the weight-gradient GEMMs; an op plugs in two things per chunk, and nothing else:

* **statistics of this chunk** (:class:`ChunkStats`): ``stats(chunk, out)`` writes the rows'
  per-shard statistics into ``out`` (fp32, one column per row of the chunk), which the engine
  (or the op's pass) gathers across the shards in one collective;
* **gradient of this chunk** (:class:`ChunkGrad`): ``grad(chunk, out)`` writes the gradient of
  the loss w.r.t. the chunk's logits into ``out`` (``[n, W]`` in the logits' dtype), from which
  the engine makes the logits gradient (unfused ops, :func:`.chunks.logits_grad`) or ``dX``/``dW``
  (fused LM head, :func:`.recompute.recompute_backward`).

This is where a kernel backend plugs in: a kernel receives the :class:`Chunk` below and an output
tensor, and must stay within the error bounds of ``docs/numerics.md`` (not the same bits). Both
callables may overwrite ``chunk.z`` and ``chunk.scratch``. The backends (:mod:`.backends`, one
object per ``cfg.kernel``) make the core op's objects below into what runs; the Triton one
(``ops/kernels/triton_stats.py``) takes chunks with ``z`` and ``scratch`` None: it reads
``chunk.logits``, or, in the fused LM head, computes them tile by tile from ``chunk.hidden`` and
``chunk.weight`` (``chunk.logits`` None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from .._grad import chunk_grad
from .._layout import ShardLayout
from .._math import block_stats, chunk_stats


class Chunk(NamedTuple):
    """One chunk of tokens, as the engine hands it to an op.

    ``rows``: the chunk's token rows (a slice of the flattened ``[T]`` tokens, ``n`` rows).
    ``z``: fp32 ``[n, W]`` (``[n, padded W]`` for block statistics), the logits upcast by
    ``_math.load_chunk`` (temperature applied, padding columns at the floor); may be overwritten;
    None (with ``scratch``) for a backend that reads ``logits`` itself (the Triton kernels).
    ``scratch``: an fp32 buffer of at least ``z``'s size; may be overwritten.
    ``index``/``owned``: ``[n]`` int64 local column of each row's target in this shard and
    whether this shard owns it (``_math.local_target_index``); None without targets.
    ``logits``: the chunk's logits ``[n, W]`` in their storage dtype: a view of the op's logits
    (unfused) or the fused LM head's GEMM buffer, which the gradient may overwrite; None for a
    fused chunk whose logits a kernel computes itself (:func:`.linear.tile_chunks`).
    ``hidden``/``weight``: that fused chunk's hidden rows ``[n, H]`` and the weight shard
    ``[W, H]`` (model dtype); None otherwise.
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
    """Statistics of this chunk: write the rows' per-shard statistics into ``out``
    (fp32; ``[NUM_STATS, n]`` for the core statistics, ``[NUM_STATS, n, nb]`` per block).

    The implementations are frozen dataclasses with ``eq=False`` (hashed by identity): torch
    2.11's dynamo hashes a callable object that it built in the traced region before its fields
    are set."""

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None: ...


class ChunkGrad(Protocol):
    """Gradient of this chunk: write ``d loss / d logits`` of the chunk's rows into ``out``
    (``[n, W]``, the logits' dtype, rounded once; ``out`` may be ``chunk.logits``)."""

    def __call__(self, chunk: Chunk, out: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class ShardStats:
    """The core op's :class:`ChunkStats`: ``_math.chunk_stats`` (max, sum of exp, exp-weighted
    logits, target logit, smoothing sum; with ``argmax`` the id of the first maximum too) or,
    with ``blocks``, ``_math.block_stats`` per block of 128 columns."""

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
    """The core op's :class:`ChunkGrad`: ``_math.chunk_grad`` of ``sum(g_lp * logprobs + g_H *
    entropy)`` from per-token ``[T]`` fp32 vectors (``lse`` finite and ``lse_lo`` its rounding
    error, ``_math.split_lse``; ``ent`` the forward's entropy, ``coef_lp``/``coef_h`` from
    ``_math.grad_coefficients``; None where unused)."""

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
