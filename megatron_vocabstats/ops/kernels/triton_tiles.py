"""The Triton building blocks of the kernels (:mod:`.triton_kernels`): a tile of logits in,
statistics or gradient out.

A tile is loaded (or computed as ``hidden @ weight.T`` by ``tl.dot``, rounded once to the model
dtype), scaled and floored as ``_math.load_chunk`` makes it, and folded into running statistics
by online rescaling (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax",
extended to the entropy and smoothing sums; ``docs/numerics.md``, "Triton kernels"), or turned
into the gradient of ``_grad.chunk_grad``. A NaN logit makes the maxima and sums NaN, as in torch.

Only constructs that compile on CUDA GPUs as they run under ``TRITON_INTERPRET=1``: power-of-two
blocks, masked loads and stores, ``tl.dot`` with every dimension >= 16, constexpr flags for every
optional part, scalar branches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._math import STAT_ENT, STAT_MAX, STAT_SUMEXP, STAT_TARGET, STAT_ZSUM, Z_FLOOR
from ..options import LOGP_MIN

# The constants the kernels read, as constexpr globals (a compiled kernel may read no other).
FLOOR = tl.constexpr(Z_FLOOR)
LOG2E = tl.constexpr(1.4426950408889634)
_LOGP_MIN = tl.constexpr(LOGP_MIN)
_MAX, _SUMEXP, _ENT, _TARGET, _ZSUM = (tl.constexpr(k) for k in (
    STAT_MAX, STAT_SUMEXP, STAT_ENT, STAT_TARGET, STAT_ZSUM))
# ROUND values: the model dtype a GEMM output is rounded to.
ROUND_FP32, ROUND_BF16, ROUND_FP16 = 0, 1, 2


@triton.jit
def exp_(x):
    """``e^x`` as ``2^(x log2 e)``: ``2 u |x|`` more relative error than exp2's 2 ulp
    (``docs/numerics.md``)."""
    return tl.exp2(x * LOG2E)


@triton.jit
def round_bf16(x):
    """fp32 -> bf16 to nearest even by integer ops on the bits: the GPU's ``cvt.rn.bf16.f32``
    bits (overflow gives inf), also in the interpreter, whose own cast truncates. Every NaN
    becomes ``0x7FC0`` (the rounding bias would carry a low-payload NaN into the exponent)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = tl.where(x != x, 0x7FC00000, bits)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to(x, ROUND: tl.constexpr, GPU: tl.constexpr):
    """fp32 ``x`` rounded (nearest even) to the model dtype ``ROUND`` and kept in it (fp32 for
    ``ROUND_FP32``): the GPU's conversion, :func:`round_bf16` in the interpreter."""
    if ROUND == 1:
        if GPU:
            y = x.to(tl.bfloat16)
        else:
            y = round_bf16(x)
    elif ROUND == 2:
        y = x.to(tl.float16)
    else:
        y = x
    return y


@triton.jit
def load_logits(ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """The stored logits ``[R, BLOCK_N]`` at (``rows``, ``cols``) upcast to fp32 (0 outside)."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None].to(tl.int64) * stride_row + cols[None, :].to(tl.int64) * stride_col
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def matmul_logits(h_ptr, stride_hm, stride_hk, w_ptr, stride_wn, stride_wk, rows, cols, n_rows,
                  n_cols, hidden, ROUND: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr, GPU: tl.constexpr):
    """The fp32 logits tile ``h[rows] @ w[cols].T`` ``[BLOCK_M, BLOCK_N]`` (0 outside), which the
    caller rounds to the model dtype ``ROUND``: ``tl.dot`` in ``BLOCK_K`` steps (a fixed K order;
    fp32 accumulation; IEEE fp32 products for fp32 models, never TF32); ``EVEN_K``: no K mask.
    Off a GPU bf16/fp16 operands are upcast first (the interpreter's ``tl.dot`` misreads bf16;
    the products are exact in fp32 either way)."""
    ks = tl.arange(0, BLOCK_K).to(tl.int64)  # offsets in int64: any strides
    row_in = (rows < n_rows)[:, None]
    col_in = (cols < n_cols)[None, :]
    h_rows = h_ptr + rows[:, None].to(tl.int64) * stride_hm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32)
    for k in range(0, hidden, BLOCK_K):
        kk = k + ks
        if EVEN_K:
            a = tl.load(h_rows + kk[None, :] * stride_hk, mask=row_in, other=0.0)
            b = tl.load(w_cols + kk[:, None] * stride_wk, mask=col_in, other=0.0)
        else:
            a = tl.load(h_rows + kk[None, :] * stride_hk, mask=row_in & (kk < hidden)[None, :],
                        other=0.0)
            b = tl.load(w_cols + kk[:, None] * stride_wk, mask=col_in & (kk < hidden)[:, None],
                        other=0.0)
        if ROUND == 0 or not GPU:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def max_nan(a, b):
    """``max(a, b)``, NaN if either is (torch's ``maximum``): explicit, as ``tl.maximum``'s
    default differs between compiled code and interpreters (``docs/kernels.md``)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def scaled_z(x, temperature, SCALE: tl.constexpr):
    """``z`` of fp32 logits as ``_math.load_chunk`` makes it: ``x / tau`` (IEEE division),
    below the floor (-inf too) -> ``FLOOR``; NaN stays NaN. Padding columns are the caller's."""
    if SCALE:
        x = tl.math.div_rn(x, temperature)
    return max_nan(x, FLOOR)


@triton.jit
def amax_nan(x, AXIS: tl.constexpr):
    """``x``'s maximum along ``AXIS`` with :func:`max_nan` (not ``tl.max``, which may skip NaN)."""
    return tl.reduce(x, AXIS, max_nan)


@triton.jit
def tile_order(pid, row_tiles, col_tiles, GROUP: tl.constexpr):
    """``(row tile, column tile)`` of program ``pid``: ``GROUP`` consecutive row tiles take each
    column tile in turn, so resident programs share weight and hidden tiles in the L2. Integer
    arithmetic only: the host (the GPU model) calls ``tile_order.fn`` with ints alike."""
    per_group = GROUP * col_tiles
    first = (pid // per_group) * GROUP
    size = row_tiles - first
    if size > GROUP:
        size = GROUP
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def online_update(z, live, seen, m, s, u, a, floor, zscale, ENTROPY: tl.constexpr,
                  ZSUM: tl.constexpr):
    """Fold ``z`` ``[R, C]`` into each row's running max ``m``, sum ``s`` of ``e^(z - m)``,
    entropy sum ``u`` of ``e^(z - m)(z - m)``, smoothing sum ``a`` of ``zscale (z - m)`` over the
    real columns (``seen`` of them before) and ``floor`` flag. A row: a tile's, or a lane of one
    row (``GROUP`` columns in one thread). ``live``: the real columns (broadcast), None for all."""
    m_new = max_nan(m, amax_nan(z, 1))
    d = m - m_new
    scale = exp_(d)
    x = z - m_new[:, None]
    e = exp_(x)
    if ENTROPY:
        # A part whose scale underflows to 0 adds 0 (never 0 * inf from d * s).
        u = tl.where(scale == 0.0, 0.0, scale * (u + d * s)) + tl.sum(e * x, 1)
    s = s * scale + tl.sum(e, 1)
    if ZSUM:  # each term scaled before the sum, as the torch path does: no overflow at 3e38
        if live is None:
            a = a + (zscale * seen) * d + tl.sum(x * zscale, 1)
            floor = tl.maximum(floor, tl.max((z <= FLOOR).to(tl.int32), 1))
        else:
            a = a + (zscale * seen) * d + tl.sum(tl.where(live, x * zscale, 0.0), 1)
            floor = tl.maximum(floor, tl.max((live & (z <= FLOOR)).to(tl.int32), 1))
    return m_new, s, u, a, floor


@triton.jit
def tile_update(z, cols, seen, m, s, u, a, t, floor, idx, start, real_width, zscale,
                HAS_TARGET: tl.constexpr, ENTROPY: tl.constexpr, ZSUM: tl.constexpr):
    """:func:`online_update` of the tile ``z`` ``[R, BLOCK_N]`` (columns ``cols`` from
    ``start``), and each row's target logit ``t`` (at local column ``idx``, int32)."""
    if HAS_TARGET:
        inside = (idx >= start) & (idx < start + z.shape[1])
        if tl.max(inside.to(tl.int32), 0) > 0:  # some row's target is in this tile
            t += tl.sum(tl.where(cols[None, :] == idx[:, None], z, 0.0), 1)
    m, s, u, a, floor = online_update(z, (cols < real_width)[None, :], seen, m, s, u, a, floor,
                                      zscale, ENTROPY, ZSUM)
    return m, s, u, a, t, floor


@triton.jit
def merge_lanes(m, s, u, a, floor, counts, zscale, ENTROPY: tl.constexpr, ZSUM: tl.constexpr):
    """A row's statistics from its lanes' (``[LANES]`` each; ``counts`` each lane's real columns,
    fp32): the merge of ``_math`` over parts (``docs/numerics.md``), the smoothing sums rebased
    on the row's maximum (``a + c n d``)."""
    mx = amax_nan(m, 0)
    d = m - mx
    scale = exp_(d)
    s_row = tl.sum(s * scale, 0)
    u_row = 0.0
    if ENTROPY:
        u_row = tl.sum(tl.where(scale == 0.0, 0.0, scale * (u + d * s)), 0)
    a_row = 0.0
    floor_row = 0
    if ZSUM:
        a_row = tl.sum(a + (zscale * counts) * d, 0)
        floor_row = tl.max(floor, 0)
    return mx, s_row, u_row, a_row, floor_row


@triton.jit
def store_stats(ptrs, mask, stride_stat, m, s, u, a, t, floor, own, has_real,
                HAS_TARGET: tl.constexpr, ENTROPY: tl.constexpr, ZSUM: tl.constexpr):
    """Store one part's statistics at ``ptrs`` (``[R]`` pointers to the max row, the others
    ``stride_stat`` apart) as ``_math.chunk_stats`` does; 0 smoothing sum without ``has_real``.
    A NaN sum (a NaN logit) is live, so it reaches the merged results."""
    live = (m > FLOOR) | (s != s)
    tl.store(ptrs + _MAX * stride_stat, tl.where(live, m, float("-inf")), mask=mask)
    tl.store(ptrs + _SUMEXP * stride_stat, tl.where(live, s, 0.0), mask=mask)
    if ENTROPY:
        tl.store(ptrs + _ENT * stride_stat, tl.where(live, u, 0.0), mask=mask)
    if HAS_TARGET:
        tl.store(ptrs + _TARGET * stride_stat, tl.where(own, t, 0.0), mask=mask)
    if ZSUM:
        a = tl.where(floor > 0, float("-inf"), a)
        tl.store(ptrs + _ZSUM * stride_stat, tl.where(has_real, a, 0.0), mask=mask)


@triton.jit
def target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET: tl.constexpr):
    """``(idx, own)`` of ``rows``: each row's local target column (int32: a column of the shard)
    and whether this shard owns it; ``(0, False)`` without targets."""
    if HAS_TARGET:
        idx = tl.load(index_ptr + rows, mask=mask, other=-1).to(tl.int32)
        own = tl.load(owned_ptr + rows, mask=mask, other=0) != 0
    else:
        idx = rows.to(tl.int32) * 0
        own = mask & (rows < 0)
    return idx, own


@triton.jit
def grad_rows(rows, mask, lse_ptr, lse_lo_ptr, ent_ptr, coef_lp_ptr, coef_h_ptr, valid_ptr,
              HAS_LP: tl.constexpr, HAS_H: tl.constexpr, HAS_VALID: tl.constexpr):
    """``(lse, lse_lo, shift, c_lp, c_h, valid)`` of ``rows`` for :func:`grad_values` (0 / True
    where a flag turns one off; ``shift = c_h H + c_lp``). A row not valid gets ``lse = +inf``,
    ``lse_lo = 0``: its ``p`` is ``e^-inf = 0``, no exp of a placeholder lse."""
    valid = tl.load(valid_ptr + rows, mask=mask, other=0) != 0 if HAS_VALID else mask | True
    lse = tl.load(lse_ptr + rows, mask=mask, other=0.0)
    lse = tl.where(valid, lse, float("inf"))
    lse_lo = tl.where(valid, tl.load(lse_lo_ptr + rows, mask=mask, other=0.0), 0.0)
    zero = tl.zeros_like(lse)
    c_lp = tl.load(coef_lp_ptr + rows, mask=mask, other=0.0) if HAS_LP else zero
    c_h = tl.load(coef_h_ptr + rows, mask=mask, other=0.0) if HAS_H else zero
    shift = c_lp
    if HAS_H:
        shift = c_h * tl.load(ent_ptr + rows, mask=mask, other=0.0)
        if HAS_LP:
            shift = shift + c_lp
    return lse, lse_lo, shift, c_lp, c_h, valid


@triton.jit
def grad_values(z, lse, lse_lo, shift, c_lp, c_h, HAS_H: tl.constexpr):
    """fp32 ``p (-c_h log p - shift)`` of ``z``, ``log p = (z - lse) - lse_lo`` as in
    ``_grad.chunk_grad`` (per-row values: scalars, or ``[R]`` expanded by the caller)."""
    logp = (z - lse) - lse_lo
    p = exp_(logp)
    if HAS_H:
        logp = max_nan(logp, _LOGP_MIN)
        grad = p * (logp * (-c_h) - shift)
    else:
        grad = p * (-c_lp)
    return grad
