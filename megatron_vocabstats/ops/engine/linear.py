"""The fused LM head's side of the chunk engine: chunk logits ``hidden @ weight.T`` without ever
holding ``[T, W]``.

The validated options of one fused call (:class:`LinearStatsConfig`: ``options.StatsConfig`` plus
sequence parallelism, main_grad fusion, forward-gradient mode, which gradients), the fused ops'
chunk policy and reused buffers, the per-chunk GEMM (:data:`INVARIANT_ROWS` rows per GEMM in
batch-invariant mode; none for a backend that computes the logits itself, as Triton's ``tl.dot``
tiles do), and ``ColumnParallelLinear``'s collectives for the input and its gradient
(sequence-parallel gather / reduce-scatter, or all-reduce).
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

# CPU auto chunking: tokens per chunk from the bytes of one fp32 [chunk, W] buffer. Unlike the
# core op, whose chunks only stream logits, every chunk here re-reads the whole [W, H] weight for
# the logits, dX and dW products and adds a [W, H] fp32 product into the weight-gradient sums,
# which only amortises over a few hundred tokens. Measured (benchmarks/bench_fused_linear.py
# --sweep-chunk, V=151,936, tp=2, T=512, process CPU ms per forward+backward) at chunk
# 32/64/128/256/512: H=512 2304/1649/1603/1575/1748, H=1024 3703/3262/3096/2740/3027. 64 MiB
# (220 tokens at W=76,032) sits at the optimum for 167 MB of chunk buffers.
CPU_LINEAR_CHUNK_BYTES = 64 * 2**20
# GPU chunks of a backend that computes the logits itself (Triton: no fp32 chunk buffers), for the
# backward and the forward-gradient mode. Every chunk reads and writes the fp32 [W, H] dW sums
# (8 W H bytes) around a dW GEMM of 2 chunk W H FLOPs: at TILE_CHUNK_ROWS rows that traffic is
# 4 x 989e12 / (4096 x 3.35e12) = 0.29 of the GEMM's time at H100/H200 peaks (the torch path's
# 441 rows at V = 151,936: 2.7 times the GEMM). Its one buffer, [chunk, W] in the model dtype,
# stays within TILE_CHUNK_BYTES: the torch path's three buffers at 441 rows (670 MB); whole
# 128-row tiles (docs/gpu-model.md).
TILE_CHUNK_ROWS = 4096
TILE_CHUNK_BYTES = 640 * 2**20


def auto_linear_chunk_size(width: int, device: torch.device, *, tiles: bool = False,
                           itemsize: int = 2) -> int:
    """Tokens per chunk of ``linear_vocab_parallel_stats`` (and every fused op) when
    ``chunk_size=None``.

    CPU: ``CPU_LINEAR_CHUNK_BYTES // (4 * width)`` (220 tokens at W = 76,032; see the comment on
    the constant). Other devices: the core op's ``auto_chunk_size`` (256 MiB per fp32 buffer),
    or with ``tiles`` (a backend that computes the logits itself; ``itemsize``: bytes of the
    model dtype) :data:`TILE_CHUNK_ROWS` within :data:`TILE_CHUNK_BYTES` (2,176 rows at W =
    151,936 in bf16), a multiple of 128.
    """
    if device.type == "cpu":
        return max(1, CPU_LINEAR_CHUNK_BYTES // (4 * int(width)))  # (int: as auto_chunk_size)
    if tiles:
        rows = min(TILE_CHUNK_ROWS, TILE_CHUNK_BYTES // (itemsize * max(width, 1)))
        return max(128, rows // 128 * 128)
    return auto_chunk_size(width, device)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearStatsConfig:
    """Options of one ``linear_vocab_parallel_stats`` call (or another fused op's), validated.

    ``stats``: the core op's options (layout, chunk size, entropy mode, ...). ``grad_hidden`` /
    ``grad_weight``: which input gradients are produced. ``forward_grad``: gradients computed in
    forward for the upstream gradient ``c * grad_weights`` (see ``grad_weights``).
    ``partial_hidden_grad``:
    ``dX`` is left as this rank's share, not summed over the shards.
    """

    stats: StatsConfig
    sequence_parallel: bool
    accumulate_into_main_grad: bool
    forward_grad: bool
    grad_hidden: bool
    grad_weight: bool
    partial_hidden_grad: bool = False


# Batch-invariant mode: the logits are computed INVARIANT_ROWS rows per matmul, from a copy of the
# rows in a reused buffer (tail rows zero), so every GEMM has the same shape and alignment whatever
# the token count, the chunk size or the row's position.
INVARIANT_ROWS = 64


class ChunkBuffers:
    """The reused buffers of one pass over the chunks (all with ``chunk`` rows).

    ``logits``: model dtype ``[chunk, W]``, the chunk's logits and then its logits gradient;
    ``z``/``scratch``: fp32 ``[chunk, W]`` for the core math; ``z_blocks``/``scratch_blocks``: the
    same memory as ``[chunk, padded W]`` for :func:`~.._math.block_stats` (the same tensors unless
    ``batch_invariant`` and W is not a multiple of 128); ``h32``/``grad32``: fp32 ``[chunk, H]``
    / ``[chunk, W]``, for the upcast weight-gradient path (``grad32`` is ``z`` when there is one,
    else made on first use). ``tiles`` (a backend that computes the logits itself,
    ``Backend.tiles``): only ``logits``, which then holds the gradient alone (no ``z``/``scratch``,
    no batch-invariant GEMM rows). With
    ``batch_invariant`` the rows (the chunk, or fewer tokens) are rounded up to a multiple of
    :data:`INVARIANT_ROWS`. All come from the workspace cache (:mod:`..workspace`);
    :meth:`release` gives them back.
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
    """Yield a :class:`~.kernel.Chunk` ``(rows, z, scratch, index, owned, logits)`` per chunk
    of tokens.

    ``logits``: ``hidden2d[rows] @ weight.T`` in the model dtype, in ``bufs.logits`` (one matmul,
    fp32 accumulation inside, one rounding, as Megatron's output layer; :data:`INVARIANT_ROWS`
    rows per matmul in batch-invariant mode); ``z``: its fp32 upcast from ``load_chunk``
    (temperature applied, padding at the floor), in ``bufs.z_blocks`` if ``padded`` else
    ``bufs.z``; ``scratch``: ``bufs.scratch_blocks`` if ``padded`` else ``bufs.scratch``;
    ``index``/``owned``: the rows' targets in this shard (None without targets).
    """
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
    the logits itself (``Backend.tiles``): ``logits``, ``z`` and ``scratch`` None, ``hidden`` the
    chunk's rows of ``hidden2d``, ``weight`` the shard; ``index``/``owned`` as in
    :func:`linear_chunks`. No buffer, no GEMM."""
    num_tokens = hidden2d.shape[0]
    for start in range(0, num_tokens, max(rows_per_chunk, 1)):
        rows = slice(start, min(start + rows_per_chunk, num_tokens))
        index = owned = None
        if target1d is not None:
            index, owned = local_target_index(target1d[rows], valid[rows], cfg.layout)
        yield Chunk(rows, None, None, index, owned, None, hidden2d[rows], weight)


def fused_chunks(hidden2d, weight, target1d, valid, cfg: StatsConfig, bufs, *,
                 padded: bool = False, tiles: bool | None = None, tile_rows: int | None = None):
    """The chunks of one pass of the fused head: :func:`linear_chunks` (the engine's GEMM per
    chunk, in ``bufs``), or :func:`tile_chunks` of ``tile_rows`` rows (default
    ``cfg.chunk_size``; ``bufs`` unused, may be None) when ``tiles`` (default: whether
    ``cfg.kernel``'s backend computes the logits itself)."""
    if tiles is None:
        tiles = backend_of(cfg).tiles
    if tiles:
        return tile_chunks(hidden2d, weight, target1d, valid, cfg, tile_rows or cfg.chunk_size)
    return linear_chunks(hidden2d, weight, target1d, valid, cfg, bufs, padded=padded)


def full_hidden(hidden, cfg: LinearStatsConfig, tp_group) -> torch.Tensor:
    """``hidden``, or under sequence parallelism every rank's shard gathered along dim 0."""
    return _comm.gather_sequence(hidden, tp_group) if cfg.sequence_parallel else hidden


def reduce_hidden_grad(dx2d, total_shape, cfg: LinearStatsConfig, tp_group):
    """Sum the per-shard ``dX`` over the vocabulary shards, as ``ColumnParallelLinear``'s backward:
    one all-reduce, or under sequence parallelism one reduce-scatter to the local shard; with
    ``cfg.partial_hidden_grad`` none (the caller sums the shares)."""
    if cfg.partial_hidden_grad:
        return dx2d.view(total_shape)
    if cfg.sequence_parallel:
        return _comm.reduce_scatter_sequence(dx2d.view(total_shape), tp_group)
    return _comm.all_reduce_sum_(dx2d, tp_group).view(total_shape)
