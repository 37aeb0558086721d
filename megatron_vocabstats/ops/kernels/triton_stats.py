"""Triton kernels of the unfused op behind the engine's per-chunk seam.

* :func:`shard_stats`: a chunk's shard statistics (the ``[NUM_STATS, n]`` of
  ``_math.chunk_stats``) in one read of the logits in their own dtype, one program per row,
  with online rescaling over blocks of columns (online softmax: Milakov & Gimelshein 2018,
  "Online normalizer calculation for softmax", extended to the entropy and smoothing sums);
* :func:`stats_grad`: the chunk's logits gradient (``_grad.chunk_grad``) in one pass, one
  program per (row, block of columns), written in the logits' dtype.

:class:`TritonShardStats` and :class:`TritonStatsGrad` wrap them as the seam's
:class:`~..engine.kernel.ChunkStats` / :class:`~..engine.kernel.ChunkGrad`: they read
``chunk.logits`` (never ``chunk.z``, which the Triton chunks do not upcast), ``chunk.index``
and ``chunk.owned``.

Same formulas as the torch path (``docs/numerics.md``), not the same bits: sums are taken per
block and rescaled (``s <- s e^(m_old - m) + sum_blk e^(z - m)``, ``u <- e^(m_old - m)(u +
(m_old - m) s) + sum_blk e^(z - m)(z - m)``, ``a <- a + c k (m_old - m) + sum_blk c (z - m)``
over the k real columns seen); exp is libdevice's ``expf`` on a GPU (the interpreter's numpy
exp under ``TRITON_INTERPRET=1``, the only branch the CPU tests run). Every term of ``u`` and
``a`` is <= 0, so large logits (fp16 65504) neither overflow nor cancel, as in the torch path.
Batch-invariant mode is not implemented here: ``kernels.resolve_kernel`` sends it to the torch
path (its fixed block tree).

Supported: logits ``[n, W]`` bf16/fp16/fp32 with any strides, W >= 1, any n (grid dimension 0);
fp32 statistics; int64 target index. Blocks are powers of two (``BLOCK_N`` <= 1024 columns,
``tl.arange``), every load and store masked, no ``tl.dot``: the constructs compile on CUDA GPUs
as they run in ``TRITON_INTERPRET=1``. Logits below ``Z_FLOOR`` (-inf too) count as the floor,
padding columns (local id >= ``real_width``) as the floor; a row with a NaN logit gets NaN
statistics; ``+inf`` gives NaN as in the torch path.

Imports ``triton`` at import time: only :mod:`..engine.chunks` imports this module, lazily, once
``kernels.resolve_kernel`` chose ``"triton"``. May import triton, torch, :mod:`.._layout`,
:mod:`.._math` (constants) and :mod:`..options`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._layout import ShardLayout
from .._math import (
    NUM_STATS,
    STAT_ENT,
    STAT_MAX,
    STAT_SUMEXP,
    STAT_TARGET,
    STAT_ZSUM,
    Z_FLOOR,
    zsum_scale,
)
from ..options import LOGP_MIN
from . import MAX_BLOCK_N, block_columns

# The constants the kernels read, as constexpr globals (a compiled kernel may read no other).
_FLOOR = tl.constexpr(Z_FLOOR)
_LOGP_MIN = tl.constexpr(LOGP_MIN)
_MAX, _SUMEXP, _ENT, _TARGET, _ZSUM = (tl.constexpr(k) for k in (
    STAT_MAX, STAT_SUMEXP, STAT_ENT, STAT_TARGET, STAT_ZSUM))


@triton.jit
def _load_z(row_ptr, cols, stride_col, n_cols, real_width, temperature,
            SCALE: tl.constexpr):
    """fp32 ``z`` of one block of a row as ``_math.load_chunk`` makes it: ``x / tau`` (IEEE
    division), below the floor (or padding, or past the row) -> ``_FLOOR``; NaN stays NaN."""
    x = tl.load(row_ptr + cols * stride_col, mask=cols < n_cols, other=0.0).to(tl.float32)
    if SCALE:
        x = tl.math.div_rn(x, temperature)
    x = tl.where(x < _FLOOR, _FLOOR, x)
    return tl.where(cols < real_width, x, _FLOOR)


@triton.jit
def _exp(x, LIBM: tl.constexpr):
    """``exp``: libdevice's ``expf`` (within 2 ulp, as torch's CUDA kernels) when ``LIBM``
    (compiled for a GPU), else ``tl.exp`` (the interpreter's numpy exp; on a GPU it would be
    ``ex2.approx`` of a rounded ``x log2 e``, whose error grows with ``|x|``)."""
    if LIBM:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounded to nearest even, by integer ops on the bits: the same bits as the GPU's
    ``cvt.rn.bf16.f32`` (NaN stays NaN, overflow gives inf), and in the interpreter, whose own
    fp32 -> bf16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _stats_kernel(logits_ptr, stride_row, stride_col, index_ptr, owned_ptr, out_ptr,
                  stride_stat, stride_tok, n_cols, real_width, temperature, zscale,
                  HAS_TARGET: tl.constexpr, ENTROPY: tl.constexpr, ZSUM: tl.constexpr,
                  SCALE: tl.constexpr, LIBM: tl.constexpr, BLOCK_N: tl.constexpr):
    """One row's shard statistics: ``out[k, row]`` for k in (max, sum-exp, entropy sum, target
    logit, smoothing sum), each relative to the row's shard maximum (the last one scaled by
    ``zscale``, -inf if a real column is at the floor); rows not asked for are left alone."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_N)
    m = tl.full((), _FLOOR, tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    a = tl.zeros((), tl.float32)
    # Per-lane accumulators, reduced once after the loop (fewer reductions per block).
    t_lanes = tl.zeros((BLOCK_N,), tl.float32)
    nan_lanes = tl.zeros((BLOCK_N,), tl.int32)
    floor_lanes = tl.zeros((BLOCK_N,), tl.int32)
    idx = tl.load(index_ptr + row) if HAS_TARGET else 0
    for start in range(0, n_cols, BLOCK_N):
        cols = start + offs
        z = _load_z(row_ptr, cols, stride_col, n_cols, real_width, temperature, SCALE)
        nan_lanes = tl.maximum(nan_lanes, (z != z).to(tl.int32))
        if HAS_TARGET:
            t_lanes += tl.where(cols == idx, z, 0.0)
        m_new = tl.maximum(m, tl.max(z, 0))
        d = m - m_new
        scale = _exp(d, LIBM)
        x = z - m_new
        e = _exp(x, LIBM)
        if ENTROPY:
            # A part whose scale underflows to 0 adds 0 (never 0 * inf from d * s).
            u = tl.where(scale == 0.0, 0.0, scale * (u + d * s)) + tl.sum(e * x, 0)
        s = s * scale + tl.sum(e, 0)
        if ZSUM:
            real = cols < real_width
            # start real columns came before this block (all of them, when start < real_width).
            seen = tl.minimum(start, real_width).to(tl.float32)
            a = a + (zscale * seen) * d + tl.sum(tl.where(real, x * zscale, 0.0), 0)
            floor_lanes = tl.maximum(floor_lanes, (real & (z <= _FLOOR)).to(tl.int32))
        m = m_new
    t = tl.sum(t_lanes, 0)
    nan = tl.max(nan_lanes, 0)
    floor = tl.max(floor_lanes, 0)
    live = m > _FLOOR
    bad = nan > 0
    col = out_ptr + row * stride_tok
    tl.store(col + _MAX * stride_stat,
             tl.where(bad, float("nan"), tl.where(live, m, float("-inf"))))
    tl.store(col + _SUMEXP * stride_stat, tl.where(bad, float("nan"), tl.where(live, s, 0.0)))
    if ENTROPY:
        tl.store(col + _ENT * stride_stat, tl.where(bad, float("nan"), tl.where(live, u, 0.0)))
    if HAS_TARGET:
        own = tl.load(owned_ptr + row) != 0
        tl.store(col + _TARGET * stride_stat, tl.where(own, t, 0.0))
    if ZSUM:
        a = tl.where(floor > 0, float("-inf"), a)
        tl.store(col + _ZSUM * stride_stat, tl.where(bad, float("nan"), a))


@triton.jit
def _grad_kernel(logits_ptr, stride_row, stride_col, out_ptr, stride_out_row, stride_out_col,
                 lse_ptr, ent_ptr, coef_lp_ptr, coef_h_ptr, index_ptr, owned_ptr, valid_ptr,
                 n_cols, real_width, temperature, uniform_w, hit_w,
                 HAS_LP: tl.constexpr, HAS_H: tl.constexpr, HAS_TARGET: tl.constexpr,
                 SMOOTH: tl.constexpr, HAS_VALID: tl.constexpr, SCALE: tl.constexpr,
                 OUT_BF16: tl.constexpr, LIBM: tl.constexpr, BLOCK_N: tl.constexpr):
    """One block of one row of ``p (-c_h (log p + H) - c_lp)`` (+ ``c_lp eps / V`` on real
    columns, + ``c_lp (1 - eps)`` at an owned target), 0 on rows not valid, cast once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    z = _load_z(logits_ptr + row * stride_row, cols, stride_col, n_cols, real_width,
                temperature, SCALE)
    logp = z - tl.load(lse_ptr + row)
    p = _exp(logp, LIBM)
    c_lp = tl.load(coef_lp_ptr + row) if HAS_LP else 0.0
    if HAS_H:
        c_h = tl.load(coef_h_ptr + row)
        logp = tl.where(logp < _LOGP_MIN, _LOGP_MIN, logp)
        shift = c_h * tl.load(ent_ptr + row)
        if HAS_LP:
            shift = shift + c_lp
        grad = p * (logp * (-c_h) - shift)
    else:
        grad = p * (-c_lp)
    if HAS_LP and HAS_TARGET:
        if SMOOTH:
            grad = tl.where(cols < real_width, grad + c_lp * uniform_w, grad)
        own = tl.load(owned_ptr + row) != 0
        hit = tl.where(own, c_lp * hit_w, 0.0)
        grad = tl.where(cols == tl.load(index_ptr + row), grad + hit, grad)
    if HAS_VALID:
        grad = tl.where(tl.load(valid_ptr + row) != 0, grad, 0.0)
    if OUT_BF16:
        grad = _to_bf16(grad)
    tl.store(out_ptr + row * stride_out_row + cols * stride_out_col,
             grad.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _block(block_n: int | None, width: int) -> int:
    if block_n is None:
        return block_columns(width)
    if not (isinstance(block_n, int) and 16 <= block_n <= MAX_BLOCK_N
            and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n must be a power of two in [16, {MAX_BLOCK_N}], got "
                         f"{block_n!r}")
    return block_n


def _flag(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.int8)


def shard_stats(logits: torch.Tensor, index, owned, out: torch.Tensor, *, layout: ShardLayout,
                temperature: float, entropy: bool, zsum: bool, block_n: int | None = None) -> None:
    """Write the shard statistics of ``logits`` ``[n, W]`` (bf16/fp16/fp32, this shard's
    columns, any strides) into ``out`` ``[NUM_STATS, n]`` fp32 (any strides), as
    ``_math.chunk_stats`` of ``load_chunk(logits)`` does (same rows written, same units).
    ``index``/``owned``: ``[n]`` int64 / bool from ``local_target_index`` or None.
    ``block_n``: columns per block (a power of two >= 16; default :func:`block_columns`)."""
    n, width = logits.shape
    if out.shape != (NUM_STATS, n) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 [{NUM_STATS}, {n}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    if n == 0:
        return
    has_target = index is not None
    zsum = zsum and layout.real_width > 0  # no real column: the zeroed row stays 0, as in torch
    dummy = out  # never read: the constexpr flags turn those loads off
    _stats_kernel[(n,)](
        logits, logits.stride(0), logits.stride(1),
        index if has_target else dummy, _flag(owned) if has_target else dummy,
        out, out.stride(0), out.stride(1), width, layout.real_width, float(temperature),
        zsum_scale(layout.vocab_size),
        HAS_TARGET=has_target, ENTROPY=entropy, ZSUM=zsum, SCALE=temperature != 1.0,
        LIBM=logits.is_cuda, BLOCK_N=_block(block_n, width))


def stats_grad(logits: torch.Tensor, out: torch.Tensor, *, lse, ent, coef_lp, coef_h, index,
               owned, valid, layout: ShardLayout, label_smoothing: float,
               temperature: float, block_n: int | None = None) -> None:
    """Write ``d loss / d logits`` of ``logits`` ``[n, W]`` into ``out`` (``[n, W]``, the
    logits' dtype, may be ``logits`` itself: each element is read before it is written by the
    same program), with the arguments of ``_grad.chunk_grad`` (``[n]`` fp32 vectors of this
    chunk's rows; ``coef_lp``/``coef_h`` already carry ``1 / temperature``); ``block_n`` as in
    :func:`shard_stats`."""
    n, width = logits.shape
    if out.shape != logits.shape:
        raise ValueError(f"out must be shaped like logits {tuple(logits.shape)}, got "
                         f"{tuple(out.shape)}")
    if n == 0:
        return
    has_lp, has_h = coef_lp is not None, coef_h is not None
    if not (has_lp or has_h):
        raise ValueError("stats_grad needs coef_lp or coef_h")
    has_target = has_lp and index is not None
    dummy = lse
    block = _block(block_n, width)
    _grad_kernel[(n, triton.cdiv(width, block))](
        logits, logits.stride(0), logits.stride(1), out, out.stride(0), out.stride(1),
        lse, ent if has_h else dummy, coef_lp if has_lp else dummy,
        coef_h if has_h else dummy, index if has_target else dummy,
        _flag(owned) if has_target else dummy,
        _flag(valid) if valid is not None else dummy,
        width, layout.real_width, float(temperature),
        label_smoothing / layout.vocab_size, 1.0 - label_smoothing,
        HAS_LP=has_lp, HAS_H=has_h, HAS_TARGET=has_target, SMOOTH=label_smoothing > 0.0,
        HAS_VALID=valid is not None, SCALE=temperature != 1.0,
        OUT_BF16=out.dtype == torch.bfloat16, LIBM=logits.is_cuda, BLOCK_N=block)


@dataclass(frozen=True, slots=True)
class TritonShardStats:
    """:class:`~..engine.kernel.ChunkStats` of :func:`shard_stats` (``ShardStats`` without
    ``blocks``/``batch_invariant``, plus the temperature, which the torch path applies in
    ``load_chunk``)."""

    layout: ShardLayout
    entropy: bool
    zsum: bool
    temperature: float

    def __call__(self, chunk, out: torch.Tensor) -> None:
        shard_stats(chunk.logits, chunk.index, chunk.owned, out, layout=self.layout,
                    temperature=self.temperature, entropy=self.entropy, zsum=self.zsum)


@dataclass(frozen=True, slots=True)
class TritonStatsGrad:
    """:class:`~..engine.kernel.ChunkGrad` of :func:`stats_grad`: the fields of
    ``engine.kernel.StatsGrad`` (``[T]`` vectors, sliced per chunk) plus the temperature."""

    grad: object  # an engine.kernel.StatsGrad
    temperature: float

    def __call__(self, chunk, out: torch.Tensor) -> None:
        g, rows = self.grad, chunk.rows

        def part(x):
            return None if x is None else x[rows]

        stats_grad(chunk.logits, out, lse=g.lse[rows], ent=part(g.ent),
                   coef_lp=part(g.coef_lp), coef_h=part(g.coef_h), index=chunk.index,
                   owned=chunk.owned, valid=part(g.valid), layout=g.layout,
                   label_smoothing=g.label_smoothing, temperature=self.temperature)
