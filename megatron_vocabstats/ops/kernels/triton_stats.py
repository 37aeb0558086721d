"""The Triton kernels behind the engine's per-chunk seam: statistics and gradient of a chunk, from
stored logits (the unfused op) or from hidden states (the fused LM head).

Two kernels, each with a constexpr ``FUSED`` choosing where a tile of logits comes from
(:mod:`.triton_tiles`): the stored logits ``[n, W]`` (``load_logits``, one program per row,
``ROWS = 1``), or ``hidden [n, H] @ weight [W, H].T`` by ``tl.dot`` (``matmul_logits``,
``BLOCK_M`` rows per program), never stored:

* :func:`_stats_kernel`: a chunk's shard statistics (the ``[NUM_STATS, n]`` of
  ``_math.chunk_stats``) in one pass over the columns with online rescaling, or with ``BLOCKS``
  the per-block statistics of ``_math.block_stats`` (``[NUM_STATS, n, nb]``, blocks of
  ``_layout.BLOCK`` columns, batch-invariant mode "tp");
* :func:`_grad_kernel`: the chunk's logits gradient (``_grad.chunk_grad``, both upstream
  gradients folded) in one pass, one program per (rows, block of columns), written once in the
  model dtype: in place of the logits (unfused) or into the fused head's gradient buffer, from
  which cuBLAS makes ``dX`` and ``dW`` (``engine.wgrad``).

The host wrappers are :func:`shard_stats` / :func:`stats_grad`; the seam's objects
(:class:`TritonShardStats`, :class:`TritonStatsGrad`) call them with what the chunk holds: its
logits, or (``chunk.logits`` None) its hidden rows and the weight shard.

Same formulas as the torch path (``docs/numerics.md``), not the same bits. Batch invariance: a
row's statistics depend only on its own logits, the shard width and the block sizes, which
depend on nothing else (no autotuning), so ``batch_invariant=True`` holds as it is; ``"tp"``
takes ``BLOCKS``, whose parts the torch merge combines in its fixed tree.

Supported: logits or hidden/weight bf16/fp16/fp32 with any strides, W >= 1, H >= 1, any n
(grid dimension 0); fp32 statistics; int64 target index. Blocks: powers of two, ``BLOCK_N`` <=
1024 columns (unfused; 128 for ``BLOCKS`` and the fused kernels), ``BLOCK_M`` and ``BLOCK_K``
>= 16 (``tl.dot``). Logits below ``Z_FLOOR`` (-inf too) and padding columns (local id >=
``real_width``) count as the floor; a row with a NaN logit gets NaN statistics; ``+inf`` gives
NaN as in the torch path.

Imports ``triton`` at import time: only :mod:`..engine.backends` imports this module, lazily,
once ``kernels.resolve_kernel`` chose ``"triton"``. May import triton, torch, :mod:`.._layout`,
:mod:`.._math` (constants), :mod:`..options` and :mod:`.triton_tiles`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._layout import BLOCK, ShardLayout
from .._math import NUM_STATS, zsum_scale
from . import LINEAR_BLOCKS, MAX_BLOCK_N, block_columns
from .triton_tiles import (
    FLOOR,
    ROUND_BF16,
    ROUND_FP16,
    ROUND_FP32,
    grad_rows,
    grad_tile,
    load_logits,
    matmul_logits,
    online_update,
    round_bf16,
    scaled_z,
    store_stats,
    target_rows,
)

_ROUND = {torch.float32: ROUND_FP32, torch.bfloat16: ROUND_BF16, torch.float16: ROUND_FP16}


@triton.jit
def _tile(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden, rows, cols, n_rows,
          n_cols, real_width, temperature, SCALE: tl.constexpr, FUSED: tl.constexpr,
          ROUND: tl.constexpr, BLOCK_K: tl.constexpr, GPU: tl.constexpr):
    """The ``z`` tile ``[R, BLOCK_N]`` at (``rows``, ``cols``): from the stored logits ``x`` or,
    ``FUSED``, from ``x`` = hidden times the weight shard ``w``."""
    if FUSED:
        x = matmul_logits(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, rows, cols,
                          n_rows, n_cols, hidden, ROUND, BLOCK_K, GPU)
    else:
        x = load_logits(x_ptr, rows, cols, stride_xm, stride_xk, n_rows, n_cols)
    return scaled_z(x, cols, real_width, temperature, SCALE)


@triton.jit
def _stats_kernel(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden, index_ptr,
                  owned_ptr, out_ptr, stride_stat, stride_tok, stride_blk, n_rows, n_cols,
                  real_width, temperature, zscale, HAS_TARGET: tl.constexpr,
                  ENTROPY: tl.constexpr, ZSUM: tl.constexpr, SCALE: tl.constexpr,
                  BLOCKS: tl.constexpr, FUSED: tl.constexpr, ROUND: tl.constexpr,
                  GPU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """``ROWS`` rows' shard statistics: ``out[k, row]`` for k in (max, sum-exp, entropy sum,
    target logit, smoothing sum), relative to the row's shard maximum (the last one scaled by
    ``zscale``), or with ``BLOCKS`` ``out[k, row, b]`` of each block b of ``BLOCK_N`` columns,
    relative to the block's maximum."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = rows < n_rows
    zero = tl.zeros((ROWS,), tl.float32)
    flag = tl.zeros((ROWS,), tl.int32)
    idx, own = target_rows(rows, mask, index_ptr, owned_ptr, HAS_TARGET)
    m, s, u, a, t, bad, floor = zero + FLOOR, zero, zero, zero, zero, flag, flag
    ptrs = out_ptr + rows.to(tl.int64) * stride_tok
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        z = _tile(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden, rows, cols,
                  n_rows, n_cols, real_width, temperature, SCALE, FUSED, ROUND, BLOCK_K, GPU)
        if BLOCKS:
            bm, bs, bu, ba, bt, bbad, bfloor = online_update(
                z, cols, 0.0, zero + FLOOR, zero, zero, zero, zero, flag, flag, idx,
                real_width, zscale, HAS_TARGET, ENTROPY, ZSUM, GPU)
            block = tl.cast(start // BLOCK_N, tl.int64)
            store_stats(ptrs + block * stride_blk, mask, stride_stat, bm, bs, bu,
                        ba, bt, bbad, bfloor, own, start < real_width, HAS_TARGET, ENTROPY, ZSUM)
        else:
            # start real columns came before this block (all of them, when start < real_width).
            seen = tl.minimum(start, real_width).to(tl.float32)
            m, s, u, a, t, bad, floor = online_update(
                z, cols, seen, m, s, u, a, t, bad, floor, idx, real_width, zscale, HAS_TARGET,
                ENTROPY, ZSUM, GPU)
    if not BLOCKS:
        store_stats(ptrs, mask, stride_stat, m, s, u, a, t, bad, floor, own, real_width > 0,
                    HAS_TARGET, ENTROPY, ZSUM)


@triton.jit
def _grad_kernel(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden, out_ptr,
                 stride_om, stride_on, lse_ptr, lse_lo_ptr, ent_ptr, coef_lp_ptr, coef_h_ptr,
                 index_ptr,
                 owned_ptr, valid_ptr, n_rows, n_cols, real_width, temperature, uniform_w, hit_w,
                 HAS_LP: tl.constexpr, HAS_H: tl.constexpr, HAS_TARGET: tl.constexpr,
                 SMOOTH: tl.constexpr, HAS_VALID: tl.constexpr, SCALE: tl.constexpr,
                 FUSED: tl.constexpr, ROUND: tl.constexpr, OUT_BF16: tl.constexpr,
                 GPU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """One tile (``ROWS`` rows x ``BLOCK_N`` columns) of ``d loss / d logits``, cast once."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rows < n_rows
    z = _tile(x_ptr, stride_xm, stride_xk, w_ptr, stride_wn, stride_wk, hidden, rows, cols,
              n_rows, n_cols, real_width, temperature, SCALE, FUSED, ROUND, BLOCK_K, GPU)
    lse, lse_lo, ent, c_lp, c_h, idx, own, valid = grad_rows(
        rows, mask, lse_ptr, lse_lo_ptr, ent_ptr, coef_lp_ptr, coef_h_ptr, index_ptr, owned_ptr,
        valid_ptr,
        HAS_LP, HAS_H, HAS_TARGET, HAS_VALID)
    grad = grad_tile(z, cols, lse, lse_lo, ent, c_lp, c_h, idx, own, valid, real_width, uniform_w,
                     hit_w, HAS_LP, HAS_H, HAS_TARGET, SMOOTH, HAS_VALID, GPU)
    if OUT_BF16:
        grad = round_bf16(grad)
    offs = rows[:, None].to(tl.int64) * stride_om + cols[None, :].to(tl.int64) * stride_on
    tl.store(out_ptr + offs, grad.to(out_ptr.dtype.element_ty),
             mask=mask[:, None] & (cols < n_cols)[None, :])


def _block(block_n: int | None, width: int) -> int:
    if block_n is None:
        return block_columns(width)
    if not (isinstance(block_n, int) and 16 <= block_n <= MAX_BLOCK_N
            and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n must be a power of two in [16, {MAX_BLOCK_N}], got "
                         f"{block_n!r}")
    return block_n


def launch(kernel, grid, *args, **consts) -> None:
    """``kernel[grid](*args, **consts)``; under the interpreter, its error for a variable set
    after triton was imported becomes a ``ValueError`` that says so."""
    try:
        kernel[grid](*args, **consts)
    except Exception as exc:
        if "outside of the scope of a kernel" not in str(exc):
            raise
        raise ValueError("kernel='triton' on CPU: TRITON_INTERPRET=1 was set after triton was "
                         "imported; set it before the first import of triton (import "
                         "megatron.core imports it: export it in the shell)") from exc


def _flag(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.int8)


def _source(logits, hidden, weight, blocks: dict | None):
    """``(x, w, hidden size, width, fused, launch constexprs)`` of one launch: the stored logits
    ``[n, W]``, or (``logits`` None) ``hidden [n, H]`` and ``weight [W, H]``."""
    if logits is not None:
        return logits, logits, 1, logits.shape[1], False, dict(ROUND=ROUND_FP32, BLOCK_K=16)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, H] and weight [W, H] must share H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    tiles = {**LINEAR_BLOCKS, **(blocks or {})}
    return hidden, weight, hidden.shape[1], weight.shape[0], True, dict(
        ROUND=_ROUND[hidden.dtype], BLOCK_K=tiles["BLOCK_K"], ROWS=tiles["BLOCK_M"],
        BLOCK_N=tiles["BLOCK_N"])


def shard_stats(logits, index, owned, out: torch.Tensor, *, layout: ShardLayout,
                temperature: float, entropy: bool, zsum: bool, per_block: bool = False,
                hidden=None, weight=None, block_n: int | None = None,
                blocks: dict | None = None) -> None:
    """Write the shard statistics of a chunk into ``out``, as ``_math.chunk_stats`` of
    ``load_chunk(logits)`` does (same rows written, same units).

    The chunk: ``logits`` ``[n, W]`` (bf16/fp16/fp32, this shard's columns, any strides), or
    with ``logits=None`` its rows ``hidden`` ``[n, H]`` and the weight shard ``weight`` ``[W,
    H]`` (same dtype): the logits ``hidden @ weight.T`` tile by tile, rounded to that dtype.
    ``out``: fp32 ``[NUM_STATS, n]`` (any strides), or with ``per_block`` ``[NUM_STATS, n, nb]``
    (``_math.block_stats``: blocks of ``BLOCK`` columns, nb = ceil(W / BLOCK)).
    ``index``/``owned``: ``[n]`` int64 / bool from ``local_target_index`` or None.
    ``block_n``: columns per block of the unfused pass (a power of two in [16, 1024]; default
    :func:`block_columns`); ``blocks``: the fused tiles (keys of :data:`LINEAR_BLOCKS`).
    Method: one pass over the columns with online rescaling (Milakov & Gimelshein 2018,
    "Online normalizer calculation for softmax", extended to the entropy and smoothing sums,
    :mod:`.triton_tiles`); the fused tiles as in cut cross-entropy (Wijmans et al. 2024,
    arXiv:2411.09009): never stored.
    Raises ``ValueError`` for a misshaped ``out``, bad ``block_n`` or mismatched hidden/weight.
    """
    x, w, hidden_size, width, fused, consts = _source(logits, hidden, weight, blocks)
    n = x.shape[0]
    nb = -(-width // BLOCK)
    want = (NUM_STATS, n, nb) if per_block else (NUM_STATS, n)
    if out.shape != want or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 {list(want)}, got {out.dtype} {tuple(out.shape)}")
    if n == 0:
        return
    if per_block:
        consts["BLOCK_N"] = BLOCK
    consts.setdefault("ROWS", 1)
    consts.setdefault("BLOCK_N", _block(block_n, width))
    has_target = index is not None
    dummy = out  # never read: the constexpr flags turn those loads off
    launch(
        _stats_kernel, (triton.cdiv(n, consts["ROWS"]),),
        x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1), hidden_size,
        index if has_target else dummy, _flag(owned) if has_target else dummy,
        out, out.stride(0), out.stride(1), out.stride(2) if per_block else 0, n, width,
        layout.real_width, float(temperature), zsum_scale(layout.vocab_size),
        HAS_TARGET=has_target, ENTROPY=entropy, ZSUM=zsum, SCALE=temperature != 1.0,
        BLOCKS=per_block, FUSED=fused, GPU=x.is_cuda, **consts)


def stats_grad(logits, out: torch.Tensor, *, lse, ent, coef_lp, coef_h, index, owned, valid,
               layout: ShardLayout, label_smoothing: float, temperature: float, hidden=None,
               weight=None, block_n: int | None = None, blocks: dict | None = None,
               lse_lo=None) -> None:
    """Write ``d loss / d logits`` of a chunk into ``out`` (``[n, W]``, the model dtype).

    The chunk as in :func:`shard_stats`: ``logits`` (then ``out`` may be ``logits`` itself:
    each element is read before it is written by the same program) or ``hidden``/``weight``
    (``out`` then must not overlap them). The other arguments are those of
    ``_grad.chunk_grad`` (``[n]`` fp32 vectors of this chunk's rows; ``coef_lp``/``coef_h``
    already carry ``1 / temperature``); ``block_n``/``blocks`` as in :func:`shard_stats`.
    Method: ``_grad.chunk_grad``'s closed form (``docs/numerics.md``), one tile per program.
    Raises ``ValueError`` for a misshaped ``out`` or neither coefficient given.
    """
    x, w, hidden_size, width, fused, consts = _source(logits, hidden, weight, blocks)
    n = x.shape[0]
    if out.shape != (n, width):
        raise ValueError(f"out must be [{n}, {width}] like the chunk's logits, got "
                         f"{tuple(out.shape)}")
    if n == 0:
        return
    has_lp, has_h = coef_lp is not None, coef_h is not None
    if not (has_lp or has_h):
        raise ValueError("stats_grad needs coef_lp or coef_h")
    consts.setdefault("ROWS", 1)
    consts.setdefault("BLOCK_N", _block(block_n, width))
    has_target = has_lp and index is not None
    dummy = lse
    grid = (triton.cdiv(n, consts["ROWS"]), triton.cdiv(width, consts["BLOCK_N"]))
    launch(
        _grad_kernel, grid,
        x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1), hidden_size,
        out, out.stride(0), out.stride(1),
        lse, torch.zeros_like(lse) if lse_lo is None else lse_lo, ent if has_h else dummy,
        coef_lp if has_lp else dummy,
        coef_h if has_h else dummy, index if has_target else dummy,
        _flag(owned) if has_target else dummy,
        _flag(valid) if valid is not None else dummy,
        n, width, layout.real_width, float(temperature),
        label_smoothing / layout.vocab_size, 1.0 - label_smoothing,
        HAS_LP=has_lp, HAS_H=has_h, HAS_TARGET=has_target, SMOOTH=label_smoothing > 0.0,
        HAS_VALID=valid is not None, SCALE=temperature != 1.0, FUSED=fused,
        OUT_BF16=out.dtype == torch.bfloat16, GPU=x.is_cuda, **consts)


def _chunk_source(chunk) -> dict:
    """The chunk's logits, or its hidden rows and the weight shard (``chunk.logits`` None)."""
    if chunk.logits is not None:
        return dict(logits=chunk.logits)
    return dict(logits=None, hidden=chunk.hidden, weight=chunk.weight)


@dataclass(frozen=True, slots=True)
class TritonShardStats:
    """:class:`~..engine.kernel.ChunkStats` of :func:`shard_stats` (the fields of
    ``engine.kernel.ShardStats`` plus the temperature, which the torch path applies in
    ``load_chunk``); ``blocks`` for batch-invariant mode "tp"."""

    layout: ShardLayout
    entropy: bool
    zsum: bool
    temperature: float
    blocks: bool = False

    def __call__(self, chunk, out: torch.Tensor) -> None:
        shard_stats(index=chunk.index, owned=chunk.owned, out=out, layout=self.layout,
                    temperature=self.temperature, entropy=self.entropy, zsum=self.zsum,
                    per_block=self.blocks, **_chunk_source(chunk))


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

        stats_grad(out=out, lse=g.lse[rows], lse_lo=part(g.lse_lo), ent=part(g.ent),
                   coef_lp=part(g.coef_lp),
                   coef_h=part(g.coef_h), index=chunk.index, owned=chunk.owned,
                   valid=part(g.valid), layout=g.layout, label_smoothing=g.label_smoothing,
                   temperature=self.temperature, **_chunk_source(chunk))
