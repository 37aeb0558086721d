"""The ``@triton.jit`` kernels of the chunk statistics and gradient (host side:
:mod:`.triton_stats`; arithmetic: ``docs/numerics.md``, "Triton kernels"; cost:
``docs/gpu-model.md``).

Unfused, one row of stored logits per program, read once in blocks of ``LANES x GROUP`` columns
(each lane with its own running statistics, merged once per row) and written once by the
gradient. Fused LM head, ``ROWS`` rows times one column split per program: statistics of
``tl.dot`` tiles of ``hidden @ weight.T`` (or per-block statistics of stored logits), the
gradient one recomputed tile at a time, cast once. Padding columns are never read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import (
    FLOOR,
    grad_rows,
    grad_values,
    load_logits,
    matmul_logits,
    merge_lanes,
    online_update,
    round_to,
    scaled_z,
    store_stats,
    target_rows,
    tile_order,
    tile_update,
)


@triton.jit
def _row_stats_kernel(x_ptr, stride_xm, stride_xk, index_ptr, owned_ptr, out_ptr, stride_stat,
                      stride_tok, n_cols, real_width, temperature, zscale,
                      HAS_TARGET: tl.constexpr, ENTROPY: tl.constexpr, ZSUM: tl.constexpr,
                      SCALE: tl.constexpr, LANES: tl.constexpr, GROUP: tl.constexpr):
    """Row ``program_id(0)``'s shard statistics ``out[k, row]`` (``_math.chunk_stats``'s)."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    lanes = tl.arange(0, LANES)
    offs = lanes[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    block = LANES * GROUP
    m = tl.full((LANES,), FLOOR, tl.float32)
    s = tl.zeros((LANES,), tl.float32)
    u, a, floor = s, s, tl.zeros((LANES,), tl.int32)
    end = tl.minimum(n_cols, real_width)  # padding columns are at the floor: not read
    full = end - end % block
    for start in range(0, full, block):
        x = tl.load(x_row + (start + offs).to(tl.int64) * stride_xk).to(tl.float32)
        seen = tl.cast(start // LANES, tl.float32)  # each lane's real columns before this block
        m, s, u, a, floor = online_update(scaled_z(x, temperature, SCALE), None, seen, m, s, u,
                                          a, floor, zscale, ENTROPY, ZSUM)
    counts = tl.zeros((LANES,), tl.float32) + tl.cast(full // LANES, tl.float32)
    if full < end:
        cols = full + offs
        inside = cols < end
        x = tl.load(x_row + cols.to(tl.int64) * stride_xk, mask=inside, other=0.0)
        z = tl.where(inside, scaled_z(x.to(tl.float32), temperature, SCALE), FLOOR)
        real = tl.minimum(tl.maximum(end - (full + lanes * GROUP), 0), GROUP)
        m, s, u, a, floor = online_update(z, inside, counts, m, s, u, a, floor, zscale, ENTROPY,
                                          ZSUM)
        counts += real.to(tl.float32)
    mx, s_row, u_row, a_row, floor_row = merge_lanes(m, s, u, a, floor, counts, zscale,
                                                     ENTROPY, ZSUM)
    t, own = 0.0, row < 0
    if HAS_TARGET:
        own = tl.load(owned_ptr + row) != 0
        idx = tl.load(index_ptr + row)
        x_t = tl.load(x_row + idx * stride_xk, mask=idx < n_cols, other=0.0).to(tl.float32)
        t = tl.where(idx < real_width, scaled_z(x_t, temperature, SCALE), FLOOR)
    store_stats(out_ptr + row.to(tl.int64) * stride_tok, True, stride_stat, mx, s_row, u_row,
                a_row, t, floor_row, own, real_width > 0, HAS_TARGET, ENTROPY, ZSUM)


@triton.jit
def _row_grad_kernel(x_ptr, stride_xm, stride_xk, out_ptr, stride_om, stride_on, lse_ptr,
                     lse_lo_ptr, ent_ptr, coef_lp_ptr, coef_h_ptr, index_ptr, owned_ptr,
                     valid_ptr, n_cols,
                     real_width, temperature, uniform_w, hit_w, HAS_LP: tl.constexpr,
                     HAS_H: tl.constexpr, HAS_TARGET: tl.constexpr, SMOOTH: tl.constexpr,
                     HAS_VALID: tl.constexpr, SCALE: tl.constexpr, ROUND: tl.constexpr,
                     GPU: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row ``program_id(0)``'s ``d loss / d logits`` in the model dtype (``out`` may be the
    logits: the target's logit is read before the row is overwritten)."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    o_row = out_ptr + row.to(tl.int64) * stride_om
    cols = tl.arange(0, BLOCK_N)
    lse, lse_lo, shift, c_lp, c_h, valid = grad_rows(row, True, lse_ptr, lse_lo_ptr, ent_ptr,
                                                     coef_lp_ptr, coef_h_ptr, valid_ptr, HAS_LP,
                                                     HAS_H, HAS_VALID)
    if HAS_LP and HAS_TARGET:
        own = tl.load(owned_ptr + row) != 0
        idx = tl.load(index_ptr + row)
        x_t = tl.load(x_row + idx * stride_xk, mask=idx < n_cols, other=0.0).to(tl.float32)
    if valid:
        uniform = c_lp * uniform_w
        end = tl.minimum(n_cols, real_width)
        full = end - end % BLOCK_N
        for start in range(0, full, BLOCK_N):
            c = (start + cols).to(tl.int64)
            z = scaled_z(tl.load(x_row + c * stride_xk).to(tl.float32), temperature, SCALE)
            g = grad_values(z, lse, lse_lo, shift, c_lp, c_h, HAS_H)
            if SMOOTH:
                g = g + uniform
            tl.store(o_row + c * stride_on, round_to(g, ROUND, GPU))
        for start in range(full, n_cols, BLOCK_N):  # the last real columns, then padding
            c = start + cols
            x = tl.load(x_row + c.to(tl.int64) * stride_xk, mask=c < n_cols, other=0.0)
            real = c < real_width
            z = tl.where(real, scaled_z(x.to(tl.float32), temperature, SCALE), FLOOR)
            g = grad_values(z, lse, lse_lo, shift, c_lp, c_h, HAS_H)
            if SMOOTH:
                g = tl.where(real, g + uniform, g)
            tl.store(o_row + c.to(tl.int64) * stride_on, round_to(g, ROUND, GPU),
                     mask=c < n_cols)
        if HAS_LP and HAS_TARGET:
            if own:  # the target's element again, with its term (after every store above)
                tl.debug_barrier()
                z_t = tl.where(idx < real_width, scaled_z(x_t, temperature, SCALE), FLOOR)
                g = grad_values(z_t, lse, lse_lo, shift, c_lp, c_h, HAS_H)
                if SMOOTH:
                    g = tl.where(idx < real_width, g + uniform, g)
                tl.store(o_row + idx * stride_on, round_to(g + c_lp * hit_w, ROUND, GPU))
    else:
        zero = round_to(tl.zeros((BLOCK_N,), tl.float32), ROUND, GPU)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            tl.store(o_row + c.to(tl.int64) * stride_on, zero, mask=c < n_cols)


@triton.jit
def _tile_stats_kernel(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden,
                       index_ptr, owned_ptr, out_ptr, stride_stat, stride_tok, stride_blk,
                       logits_ptr, stride_lm, stride_ln, n_rows, n_cols, real_width,
                       temperature, zscale, split_cols, HAS_TARGET: tl.constexpr,
                       ENTROPY: tl.constexpr, ZSUM: tl.constexpr, SCALE: tl.constexpr,
                       BLOCKS: tl.constexpr, FUSED: tl.constexpr, STORE: tl.constexpr,
                       ROUND: tl.constexpr, GPU: tl.constexpr, EVEN_K: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP: tl.constexpr):
    """``ROWS`` rows' statistics over one split of ``split_cols`` columns (a multiple of
    ``BLOCK_N``): ``out[k, row, split]`` relative to the split's maximum, or with ``BLOCKS``
    ``out[k, row, b]`` of each tile b, relative to the tile's maximum."""
    row_tiles = tl.cdiv(n_rows, ROWS)
    rt, sp = tile_order(tl.program_id(0), row_tiles, tl.cdiv(n_cols, split_cols), GROUP)
    rows = rt * ROWS + tl.arange(0, ROWS)
    mask = rows < n_rows
    zero = tl.zeros((ROWS,), tl.float32)
    flag = tl.zeros((ROWS,), tl.int32)
    idx, own = target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET)
    m, s, u, a, t, floor = zero + FLOOR, zero, zero, zero, zero, flag
    lo = sp * split_cols
    hi = tl.minimum(lo + split_cols, n_cols)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        if FUSED:
            x = round_to(matmul_logits(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk,
                                       rows, cols, n_rows, n_cols, hidden, ROUND, BLOCK_K,
                                       EVEN_K, GPU), ROUND, GPU)
            if STORE:
                offs = rows[:, None].to(tl.int64) * stride_lm + cols[None, :] * stride_ln
                tl.store(logits_ptr + offs, x, mask=mask[:, None] & (cols < n_cols)[None, :])
            x = x.to(tl.float32)
        else:
            x = load_logits(x_ptr, rows, cols, stride_xm, stride_xk, n_rows, n_cols)
        z = tl.where((cols < real_width)[None, :], scaled_z(x, temperature, SCALE), FLOOR)
        if BLOCKS:
            bm, bs, bu, ba, bt, bfloor = tile_update(
                z, cols, 0.0, zero + FLOOR, zero, zero, zero, zero, flag, idx, start,
                real_width, zscale, HAS_TARGET, ENTROPY, ZSUM)
            ptrs = out_ptr + rows.to(tl.int64) * stride_tok
            block = tl.cast(start // BLOCK_N, tl.int64)
            store_stats(ptrs + block * stride_blk, mask, stride_stat, bm, bs, bu, ba, bt,
                        bfloor, own, start < real_width, HAS_TARGET, ENTROPY, ZSUM)
        else:
            # real columns of this split before the tile (all of them, when start < real_width)
            seen = tl.cast(tl.minimum(start - lo, tl.maximum(real_width - lo, 0)), tl.float32)
            m, s, u, a, t, floor = tile_update(z, cols, seen, m, s, u, a, t, floor, idx, start,
                                               real_width, zscale, HAS_TARGET, ENTROPY, ZSUM)
    if not BLOCKS:  # (the pointers and ownership made here: fewer registers live in the loop)
        ptrs = out_ptr + rows.to(tl.int64) * stride_tok + tl.cast(sp, tl.int64) * stride_blk
        _, own = target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET)
        store_stats(ptrs, mask, stride_stat, m, s, u, a, t, floor, own, lo < real_width,
                    HAS_TARGET, ENTROPY, ZSUM)


@triton.jit
def _tile_grad_kernel(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden,
                      out_ptr, stride_om, stride_on, lse_ptr, lse_lo_ptr, ent_ptr, coef_lp_ptr,
                      coef_h_ptr,
                      index_ptr, owned_ptr, valid_ptr, n_rows, n_cols, real_width, temperature,
                      uniform_w, hit_w, HAS_LP: tl.constexpr, HAS_H: tl.constexpr,
                      HAS_TARGET: tl.constexpr, SMOOTH: tl.constexpr, HAS_VALID: tl.constexpr,
                      SCALE: tl.constexpr, ROUND: tl.constexpr, GPU: tl.constexpr,
                      EVEN_K: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """One tile (``ROWS`` rows x ``BLOCK_N`` columns) of the fused head's ``d loss / d logits``,
    its logits recomputed by ``tl.dot``, cast once."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    start = tl.program_id(1) * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    mask = rows < n_rows
    x = round_to(matmul_logits(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, rows,
                               cols, n_rows, n_cols, hidden, ROUND, BLOCK_K, EVEN_K, GPU),
                 ROUND, GPU).to(tl.float32)
    real = (cols < real_width)[None, :]
    z = tl.where(real, scaled_z(x, temperature, SCALE), FLOOR)
    lse, lse_lo, shift, c_lp, c_h, valid = grad_rows(rows, mask, lse_ptr, lse_lo_ptr, ent_ptr,
                                                     coef_lp_ptr, coef_h_ptr, valid_ptr, HAS_LP,
                                                     HAS_H, HAS_VALID)
    g = grad_values(z, lse[:, None], lse_lo[:, None], shift[:, None], c_lp[:, None],
                    c_h[:, None], HAS_H)
    if HAS_LP and HAS_TARGET:
        if SMOOTH:
            g = tl.where(real, g + (c_lp * uniform_w)[:, None], g)
        idx, own = target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET)
        inside = (idx >= start) & (idx < start + BLOCK_N)
        if tl.max(inside.to(tl.int32), 0) > 0:  # some row's target is in this tile
            hit = tl.where(own, c_lp * hit_w, 0.0)
            g = tl.where(cols[None, :] == idx[:, None], g + hit[:, None], g)
    if HAS_VALID:
        g = tl.where(valid[:, None], g, 0.0)
    offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
    tl.store(out_ptr + offs, round_to(g, ROUND, GPU), mask=mask[:, None] & (cols < n_cols)[None, :])
