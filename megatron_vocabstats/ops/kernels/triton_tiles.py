"""The Triton building blocks shared by the kernels of the unfused op (:mod:`.triton_stats`) and of
the fused LM head (:mod:`.triton_linear`): one tile of logits in, statistics or gradient out.

Every helper works on a tile ``[R, BLOCK_N]`` of rows x columns (R = 1 for the unfused kernels'
one row per program, ``BLOCK_M`` for the fused kernels) and on per-row vectors ``[R]``:

* :func:`load_logits` (a tile of stored logits, upcast) and :func:`matmul_logits` (the tile
  ``hidden @ weight.T`` by ``tl.dot``, rounded once to the model dtype as the LM head's GEMM
  output is), then :func:`scaled_z`: ``z = logits / tau`` with the floor and the padding columns
  as ``_math.load_chunk`` makes them;
* :func:`online_update` / :func:`store_stats`: the online shard statistics of a row over its
  blocks of columns, and their store in the ``[NUM_STATS, n(, nb)]`` layout of ``_math``;
* :func:`target_rows`: each row's target column in the shard (both kernels);
* :func:`grad_rows` / :func:`grad_tile`: the per-row coefficients of ``_grad.chunk_grad`` and the
  gradient of one tile;
* :func:`exp_` (libdevice's ``expf`` on a GPU) and :func:`round_bf16` (fp32 -> bf16, nearest
  even, the same bits on a GPU and in the interpreter).

Online rescaling (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
extended to the entropy and smoothing sums): ``s <- s e^(m_old - m) + sum_blk e^(z - m)``,
``u <- e^(m_old - m)(u + (m_old - m) s) + sum_blk e^(z - m)(z - m)``, ``a <- a + c k (m_old - m)
+ sum_blk c (z - m)`` over the k real columns seen before the block. Every term of ``u`` and
``a`` is <= 0, so large logits (fp16 65504) neither overflow nor cancel, as in the torch path.

Only constructs that compile on CUDA GPUs as they run under ``TRITON_INTERPRET=1``:
power-of-two blocks (``tl.arange``), masked loads and stores, ``tl.dot`` with every dimension
>= 16, constexpr flags for every optional part. Imports ``triton`` at import time (only the
Triton kernel modules import this one). May import triton, :mod:`.._math` (constants) and
:mod:`..options`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._math import STAT_ENT, STAT_MAX, STAT_SUMEXP, STAT_TARGET, STAT_ZSUM, Z_FLOOR
from ..options import LOGP_MIN

# The constants the kernels read, as constexpr globals (a compiled kernel may read no other).
FLOOR = tl.constexpr(Z_FLOOR)
_LOGP_MIN = tl.constexpr(LOGP_MIN)
_MAX, _SUMEXP, _ENT, _TARGET, _ZSUM = (tl.constexpr(k) for k in (
    STAT_MAX, STAT_SUMEXP, STAT_ENT, STAT_TARGET, STAT_ZSUM))
# ROUND values of matmul_logits: the model dtype the GEMM output is rounded to.
ROUND_FP32, ROUND_BF16, ROUND_FP16 = 0, 1, 2


@triton.jit
def exp_(x, GPU: tl.constexpr):
    """``exp``: libdevice's ``expf`` (within 2 ulp, as torch's CUDA kernels) when ``GPU``
    (compiled for a GPU), else ``tl.exp`` (the interpreter's numpy exp; on a GPU it would be
    ``ex2.approx`` of a rounded ``x log2 e``, whose error grows with ``|x|``)."""
    if GPU:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def round_bf16(x):
    """fp32 -> bf16 rounded to nearest even, by integer ops on the bits: the same bits as the GPU's
    ``cvt.rn.bf16.f32`` (overflow gives inf), and in the interpreter, whose own fp32 -> bf16 cast
    truncates. Every NaN becomes the quiet NaN ``0x7FC0`` (adding the rounding bias to a NaN
    with low payload bits, as the GPU's arithmetic makes them, would carry into the exponent)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = tl.where(x != x, 0x7FC00000, bits)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_logits(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """The stored logits ``[R, BLOCK_N]`` at (``rows``, ``cols``) upcast to fp32 (0 outside)."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_row + cols[None, :].to(tl.int64) * stride_col
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def matmul_logits(h_ptr, stride_hm, stride_hk, w_ptr, stride_wn, stride_wk, rows, cols, n_rows,
                  n_cols, hidden, ROUND: tl.constexpr, BLOCK_K: tl.constexpr,
                  GPU: tl.constexpr):
    """The logits tile ``h[rows] @ w[cols].T`` ``[BLOCK_M, BLOCK_N]`` fp32: ``tl.dot`` over
    ``hidden`` in ``BLOCK_K`` steps (fp32 accumulation; IEEE fp32 products, never TF32, for fp32
    models), rounded once to the model dtype (``ROUND``) as the output layer's GEMM is; 0 outside
    the rows and columns. The K order is fixed by ``BLOCK_K`` alone (batch-invariant).
    Outside a GPU (the interpreter, whose ``tl.dot`` misreads bf16 operands) bf16/fp16 operands
    are upcast first: their products are exact in fp32 either way."""
    ks = tl.arange(0, BLOCK_K).to(tl.int64)  # offsets in int64: any strides
    row_in = (rows < n_rows)[:, None]
    col_in = (cols < n_cols)[None, :]
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_hm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32)
    for k in range(0, hidden, BLOCK_K):
        kk = k + ks
        a = tl.load(h_rows + kk[None, :] * stride_hk, mask=row_in & (kk < hidden)[None, :],
                    other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=col_in & (kk < hidden)[:, None],
                    other=0.0)
        if ROUND == 0 or not GPU:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if ROUND == 1:
        acc = round_bf16(acc).to(tl.float32)
    elif ROUND == 2:
        acc = acc.to(tl.float16).to(tl.float32)
    return acc


@triton.jit
def scaled_z(x, cols, real_width, temperature, SCALE: tl.constexpr):
    """``z`` of an fp32 logits tile as ``_math.load_chunk`` makes it: ``x / tau`` (IEEE
    division), below the floor (or padding, or past the row) -> ``FLOOR``; NaN stays NaN."""
    if SCALE:
        x = tl.math.div_rn(x, temperature)
    x = tl.where(x < FLOOR, FLOOR, x)
    return tl.where((cols < real_width)[None, :], x, FLOOR)


@triton.jit
def online_update(z, cols, seen, m, s, u, a, t, bad, floor, idx, real_width, zscale,
                  HAS_TARGET: tl.constexpr, ENTROPY: tl.constexpr, ZSUM: tl.constexpr,
                  GPU: tl.constexpr):
    """Fold the tile ``z`` ``[R, BLOCK_N]`` (columns ``cols``) into each row's running maximum
    ``m``, sum ``s`` of ``e^(z - m)``, entropy sum ``u`` of ``e^(z - m)(z - m)``, smoothing sum
    ``a`` of ``zscale (z - m)`` over the real columns (``seen`` of them came before), target
    logit ``t`` (at local column ``idx``), NaN flag ``bad`` and floor flag ``floor``."""
    bad = tl.maximum(bad, tl.max((z != z).to(tl.int32), 1))
    if HAS_TARGET:
        t += tl.sum(tl.where(cols[None, :] == idx[:, None], z, 0.0), 1)
    m_new = tl.maximum(m, tl.max(z, 1))
    d = m - m_new
    scale = exp_(d, GPU)
    x = z - m_new[:, None]
    e = exp_(x, GPU)
    if ENTROPY:
        # A part whose scale underflows to 0 adds 0 (never 0 * inf from d * s).
        u = tl.where(scale == 0.0, 0.0, scale * (u + d * s)) + tl.sum(e * x, 1)
    s = s * scale + tl.sum(e, 1)
    if ZSUM:
        real = (cols < real_width)[None, :]
        a = a + (zscale * seen) * d + tl.sum(tl.where(real, x * zscale, 0.0), 1)
        floor = tl.maximum(floor, tl.max((real & (z <= FLOOR)).to(tl.int32), 1))
    return m_new, s, u, a, t, bad, floor


@triton.jit
def store_stats(ptrs, mask, stride_stat, m, s, u, a, t, bad, floor, own, has_real,
                HAS_TARGET: tl.constexpr, ENTROPY: tl.constexpr, ZSUM: tl.constexpr):
    """Store one part's statistics at ``ptrs`` (``[R]`` pointers to the max row, the other rows
    ``stride_stat`` apart): max (-inf where no column is live), sums (0 there), target logit
    where this shard owns the target (0 elsewhere), smoothing sum (-inf when a real column is at
    the floor, 0 where the part has no real column, ``has_real``); NaN where a logit is NaN."""
    live = m > FLOOR
    nan = bad > 0
    tl.store(ptrs + _MAX * stride_stat,
             tl.where(nan, float("nan"), tl.where(live, m, float("-inf"))), mask=mask)
    tl.store(ptrs + _SUMEXP * stride_stat, tl.where(nan, float("nan"), tl.where(live, s, 0.0)),
             mask=mask)
    if ENTROPY:
        tl.store(ptrs + _ENT * stride_stat, tl.where(nan, float("nan"), tl.where(live, u, 0.0)),
                 mask=mask)
    if HAS_TARGET:
        tl.store(ptrs + _TARGET * stride_stat, tl.where(own, t, 0.0), mask=mask)
    if ZSUM:
        a = tl.where(floor > 0, float("-inf"), a)
        tl.store(ptrs + _ZSUM * stride_stat,
                 tl.where(nan, float("nan"), tl.where(has_real, a, 0.0)), mask=mask)


@triton.jit
def target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET: tl.constexpr):
    """``(idx, own)`` of ``rows`` (``[R]``): each row's local target column and whether this
    shard owns it; ``(0, False)`` without targets."""
    if HAS_TARGET:
        idx = tl.load(index_ptr + rows, mask=mask, other=-1)
        own = tl.load(owned_ptr + rows, mask=mask, other=0) != 0
    else:
        idx = rows.to(tl.int64) * 0
        own = mask & (rows < 0)
    return idx, own


@triton.jit
def grad_rows(rows, mask, lse_ptr, lse_lo_ptr, ent_ptr, coef_lp_ptr, coef_h_ptr, index_ptr,
              owned_ptr, valid_ptr, HAS_LP: tl.constexpr, HAS_H: tl.constexpr,
              HAS_TARGET: tl.constexpr, HAS_VALID: tl.constexpr):
    """The per-row inputs of :func:`grad_tile` for ``rows`` (``[R]``): ``(lse, lse_lo, ent, c_lp,
    c_h, idx, own, valid)``, 0 / False where a flag turns one off (``lse_lo``: the rounding error
    of the fp32 ``lse``, ``_grad.split_lse``)."""
    lse = tl.load(lse_ptr + rows, mask=mask, other=0.0)
    lse_lo = tl.load(lse_lo_ptr + rows, mask=mask, other=0.0)
    zero = tl.zeros_like(lse)
    ent = tl.load(ent_ptr + rows, mask=mask, other=0.0) if HAS_H else zero
    c_lp = tl.load(coef_lp_ptr + rows, mask=mask, other=0.0) if HAS_LP else zero
    c_h = tl.load(coef_h_ptr + rows, mask=mask, other=0.0) if HAS_H else zero
    idx, own = target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET)
    valid = tl.load(valid_ptr + rows, mask=mask, other=0) != 0 if HAS_VALID else lse == lse
    return lse, lse_lo, ent, c_lp, c_h, idx, own, valid


@triton.jit
def grad_tile(z, cols, lse, lse_lo, ent, c_lp, c_h, idx, own, valid, real_width, uniform_w, hit_w,
              HAS_LP: tl.constexpr, HAS_H: tl.constexpr, HAS_TARGET: tl.constexpr,
              SMOOTH: tl.constexpr, HAS_VALID: tl.constexpr, GPU: tl.constexpr):
    """``p (-c_h (log p + H) - c_lp)`` of the tile ``z`` (+ ``c_lp eps / V`` on real columns,
    + ``c_lp (1 - eps)`` at an owned target), 0 on rows not valid; fp32 ``[R, BLOCK_N]``."""
    logp = (z - lse[:, None]) - lse_lo[:, None]
    p = exp_(logp, GPU)
    if HAS_H:
        logp = tl.where(logp < _LOGP_MIN, _LOGP_MIN, logp)
        shift = c_h * ent
        if HAS_LP:
            shift = shift + c_lp
        grad = p * (logp * (-c_h[:, None]) - shift[:, None])
    else:
        grad = p * (-c_lp[:, None])
    if HAS_LP and HAS_TARGET:
        if SMOOTH:
            grad = tl.where((cols < real_width)[None, :], grad + (c_lp * uniform_w)[:, None],
                            grad)
        hit = tl.where(own, c_lp * hit_w, 0.0)
        grad = tl.where(cols[None, :] == idx[:, None], grad + hit[:, None], grad)
    if HAS_VALID:
        grad = tl.where(valid[:, None], grad, 0.0)
    return grad
