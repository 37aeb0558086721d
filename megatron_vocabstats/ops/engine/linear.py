"""The fused LM head's side of the chunk engine: chunk logits ``hidden @ weight.T`` without ever
holding ``[T, W]``. The fused call's validated options, its chunk size and reused buffers, the
per-chunk GEMM, and ``ColumnParallelLinear``'s collectives for the input and its gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _comm
from .._layout import local_target_index, padded_width
from .._math import load_chunk
from ..options import StatsConfig, auto_chunk_size
from ..workspace import WORKSPACE
from .backends import backend_of
from .kernel import Chunk

# CPU auto chunking: bytes of one fp32 [chunk, W] buffer. Every chunk re-reads the whole [W, H]
# weight, which amortises only over a few hundred tokens (docs/benchmarks.md, "The fused LM head").
CPU_LINEAR_CHUNK_BYTES = 64 * 2**20
# GPU chunks of a backend that computes the logits itself (Triton): large enough that each chunk's
# read-modify-write of the fp32 [W, H] dW sums hides under its dW GEMM (docs/gpu-model.md).
TILE_CHUNK_ROWS = 4096
TILE_CHUNK_BYTES = 640 * 2**20


def auto_linear_chunk_size(width: int, device: torch.device, *, tiles: bool = False,
                           itemsize: int = 2) -> int:
    """Tokens per chunk of every fused op when ``chunk_size=None``: on CPU one fp32 buffer of
    :data:`CPU_LINEAR_CHUNK_BYTES`; else the core op's ``auto_chunk_size``, or with ``tiles``
    :data:`TILE_CHUNK_ROWS` within :data:`TILE_CHUNK_BYTES` of the model dtype (``itemsize``),
    a multiple of 128."""
    if device.type == "cpu":
        return max(1, CPU_LINEAR_CHUNK_BYTES // (4 * int(width)))  # (int: as auto_chunk_size)
    if tiles:
        rows = min(TILE_CHUNK_ROWS, TILE_CHUNK_BYTES // (itemsize * max(width, 1)))
        return max(128, rows // 128 * 128)
    return auto_chunk_size(width, device)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearStatsConfig:
    """Validated options of one fused-op call: ``stats`` (the core op's), the fused head's own
    (``docs/options.md``), ``forward_grad`` (the ``grad_weights`` mode) and which input
    gradients (``grad_hidden``, ``grad_weight``) are produced."""

    stats: StatsConfig
    sequence_parallel: bool
    accumulate_into_main_grad: bool
    forward_grad: bool
    grad_hidden: bool
    grad_weight: bool
    partial_hidden_grad: bool = False


# Batch-invariant mode: rows per logits GEMM (zero-padded), so that every GEMM has one shape.
INVARIANT_ROWS = 64


class ChunkBuffers:
    """The reused workspace buffers of one pass over the chunks, given back by :meth:`release`.

    ``logits``: model dtype ``[chunk, W]``, the logits and then their gradient; ``z``/``scratch``:
    fp32 ``[chunk, W]``, also viewed ``[chunk, padded W]`` as ``z_blocks``/``scratch_blocks``;
    ``h32``/``grad32``: fp32 ``[chunk, H]`` / ``[chunk, W]`` made on first use (``grad32`` is
    ``z``). With ``tiles`` only ``logits``; with ``batch_invariant`` whole :data:`INVARIANT_ROWS`
    blocks of rows.
    """

    def __init__(self, hidden2d: torch.Tensor, width: int, chunk: int, *,
                 batch_invariant: bool = False, tiles: bool = False):
        rows = min(chunk, max(hidden2d.shape[0], 1))
        if batch_invariant and not tiles:
            # Whole INVARIANT_ROWS blocks of the rows a chunk can hold, never of the full
            # chunk_size: a few tokens must not pay for a [chunk, W] buffer. The GEMM views
            # (chunk_logits) have the same shape and strides whatever the buffer's row count.
            rows = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
        wide = padded_width(width, batch_invariant)
        device, self._hidden = hidden2d.device, hidden2d.shape[1]
        self._leases = [WORKSPACE.take((rows, width), hidden2d.dtype, device)]
        self.logits = self._leases[0].tensor
        self.z = self.scratch = self.z_blocks = self.scratch_blocks = None
        for name in () if tiles else ("z", "scratch"):
            lease = WORKSPACE.take((rows * wide,), torch.float32, device)
            self._leases.append(lease)
            setattr(self, name, lease.tensor[: rows * width].view(rows, width))
            setattr(self, name + "_blocks", lease.tensor.view(rows, wide))
        self._rows = rows
        self._h32 = self._hpad = None

    def _extra(self, dtype, columns: int | None = None) -> torch.Tensor:
        shape = (self._rows, self._hidden if columns is None else columns)
        lease = WORKSPACE.take(shape, dtype, self.logits.device)
        self._leases.append(lease)
        return lease.tensor

    def h32(self, n: int) -> torch.Tensor:
        if self._h32 is None:
            self._h32 = self._extra(torch.float32)
        return self._h32[:n]

    def grad32(self, n: int) -> torch.Tensor:
        if self.z is None:
            self.z = self._extra(torch.float32, self.logits.shape[1])
        return self.z[:n]

    def padded_rows(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ([n, H]) copied into a reused ``[chunk, H]`` buffer whose other rows are 0."""
        if self._hpad is None:
            self._hpad = self._extra(h.dtype)
        self._hpad[: h.shape[0]].copy_(h)
        self._hpad[h.shape[0]:].zero_()
        return self._hpad

    def release(self) -> None:
        """Give the buffers back to the workspace; they must not be used afterwards."""
        WORKSPACE.give(*self._leases)
        self._leases = []


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, bufs: ChunkBuffers,
                  batch_invariant: bool) -> torch.Tensor:
    """``h @ weight.T`` ([n, W], model dtype) in ``bufs.logits``; with ``batch_invariant`` as
    matmuls of exactly :data:`INVARIANT_ROWS` rows (see there)."""
    n = h.shape[0]
    if not batch_invariant:
        return torch.matmul(h, weight.t(), out=bufs.logits[:n])
    padded = bufs.padded_rows(h)
    for start in range(0, n, INVARIANT_ROWS):
        block = slice(start, start + INVARIANT_ROWS)
        torch.matmul(padded[block], weight.t(), out=bufs.logits[block])
    return bufs.logits[:n]


def linear_chunks(hidden2d, weight, target1d, valid, cfg: StatsConfig, bufs: ChunkBuffers, *,
                  padded: bool = False):
    """Yield a :class:`~.kernel.Chunk` per chunk of tokens: ``logits`` the chunk's
    ``hidden @ weight.T`` in the model dtype (one rounding, as Megatron's output layer), ``z`` its
    fp32 ``load_chunk`` (in the ``_blocks`` buffers if ``padded``), ``index``/``owned`` the
    targets in this shard (None without targets)."""
    num_tokens = hidden2d.shape[0]
    zbuf = bufs.z_blocks if padded else bufs.z
    scratch = bufs.scratch_blocks if padded else bufs.scratch
    for start in range(0, num_tokens, cfg.chunk_size):
        rows = slice(start, min(start + cfg.chunk_size, num_tokens))
        logits = chunk_logits(hidden2d[rows], weight, bufs, bool(cfg.batch_invariant))
        index = owned = None
        if target1d is not None:
            index, owned = local_target_index(target1d[rows], valid[rows], cfg.layout)
        yield Chunk(rows, load_chunk(logits, zbuf, cfg.layout, cfg.temperature), scratch, index,
                    owned, logits)


def tile_chunks(hidden2d, weight, target1d, valid, cfg: StatsConfig, rows_per_chunk: int):
    """Yield a :class:`~.kernel.Chunk` per ``rows_per_chunk`` tokens for a backend that computes
    the logits itself: ``hidden`` the chunk's rows, ``weight`` the shard; no buffer, no GEMM."""
    num_tokens = hidden2d.shape[0]
    for start in range(0, num_tokens, max(rows_per_chunk, 1)):
        rows = slice(start, min(start + rows_per_chunk, num_tokens))
        index = owned = None
        if target1d is not None:
            index, owned = local_target_index(target1d[rows], valid[rows], cfg.layout)
        yield Chunk(rows, None, None, index, owned, None, hidden2d[rows], weight)


def fused_chunks(hidden2d, weight, target1d, valid, cfg: StatsConfig, bufs, *,
                 padded: bool = False, tiles: bool | None = None, tile_rows: int | None = None):
    """:func:`linear_chunks`, or :func:`tile_chunks` of ``tile_rows`` rows (default
    ``cfg.chunk_size``; ``bufs`` may be None) when ``tiles`` (default: whether ``cfg.kernel``'s
    backend computes the logits itself)."""
    if tiles is None:
        tiles = backend_of(cfg).tiles
    if tiles:
        return tile_chunks(hidden2d, weight, target1d, valid, cfg, tile_rows or cfg.chunk_size)
    return linear_chunks(hidden2d, weight, target1d, valid, cfg, bufs, padded=padded)


def full_hidden(hidden, cfg: LinearStatsConfig, tp_group) -> torch.Tensor:
    """``hidden``, or under sequence parallelism every rank's shard gathered along dim 0."""
    return _comm.gather_sequence(hidden, tp_group) if cfg.sequence_parallel else hidden


def reduce_hidden_grad(dx2d, total_shape, cfg: LinearStatsConfig, tp_group):
    """Sum the per-shard ``dX`` over the shards as ``ColumnParallelLinear``'s backward does:
    all-reduce, or reduce-scatter under sequence parallelism; none with ``partial_hidden_grad``."""
    if cfg.partial_hidden_grad:
        return dx2d.view(total_shape)
    if cfg.sequence_parallel:
        return _comm.reduce_scatter_sequence(dx2d.view(total_shape), tp_group)
    return _comm.all_reduce_sum_(dx2d, tp_group).view(total_shape)
