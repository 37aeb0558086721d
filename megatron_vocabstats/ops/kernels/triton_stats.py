"""The host side of the Triton kernels behind the engine's per-chunk seam
(:class:`TritonShardStats`, :class:`TritonStatsGrad`): a chunk's statistics and gradient from
stored logits (the unfused op) or from hidden states (the fused LM head).

Same formulas as the torch path (``docs/numerics.md``), not the same bits. A row's statistics
depend only on its logits, the shard width and the fixed tiles and splits (never autotuned), so
``batch_invariant=True`` holds as it is; ``"tp"`` takes per-block statistics. Supported:
bf16/fp16/fp32 logits or hidden/weight with any strides, W >= 1, H >= 1, any n; int64 target
index. Logits below ``Z_FLOOR`` (-inf too) and padding columns count as the floor; a NaN logit
gives NaN statistics, ``+inf`` NaN as in the torch path. Imports ``triton``: only
:mod:`..engine.backends` imports this module, lazily, once ``"triton"`` was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .._layout import BLOCK, ShardLayout
from .._math import NUM_STATS, STAT_TARGET, Z_FLOOR, reduce_blocks, zsum_scale
from . import MAX_BLOCK_N, block_columns, linear_blocks
from .triton_kernels import (
    _row_grad_kernel,
    _row_stats_kernel,
    _tile_grad_kernel,
    _tile_stats_kernel,
)
from .triton_tiles import ROUND_BF16, ROUND_FP16, ROUND_FP32

_ROUND = {torch.float32: ROUND_FP32, torch.bfloat16: ROUND_BF16, torch.float16: ROUND_FP16}


def _block(block_n: int | None, width: int, itemsize: int) -> int:
    if block_n is None:
        return block_columns(width, itemsize)
    if not (isinstance(block_n, int) and 16 <= block_n <= MAX_BLOCK_N
            and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n must be a power of two in [16, {MAX_BLOCK_N}], got "
                         f"{block_n!r}")
    return block_n


# FP contraction (a * b + c as one FMA), given at every launch so that the bits do not depend on
# TRITON_DEFAULT_FP_FUSION (docs/kernels.md). On: the bits tests/unit/_triton_compile.py checked,
# one rounding per FMA, within the bounds of docs/numerics.md.
FP_FUSION = True


def launch(kernel, grid, *args, **consts) -> None:
    """``kernel[grid](*args, **consts)`` with :data:`FP_FUSION`; under the interpreter, its error
    for a variable set after triton was imported becomes a ``ValueError`` that says so."""
    try:
        kernel[grid](*args, enable_fp_fusion=FP_FUSION, **consts)
    except Exception as exc:
        if "outside of the scope of a kernel" not in str(exc):
            raise
        raise ValueError("kernel='triton' on CPU: TRITON_INTERPRET=1 was set after triton was "
                         "imported; set it before the first import of triton (import "
                         "megatron.core imports it: export it in the shell)") from exc


def _flag(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.int8).contiguous()


def _dense(x: torch.Tensor | None) -> torch.Tensor | None:
    """A ``[n]`` per-row vector as the kernels read it (``ptr + row``): contiguous, a copy only
    of a strided one (an upstream gradient may be, e.g. a ``sum``'s expanded one)."""
    return None if x is None else x.contiguous()


def _operands(logits, hidden, weight):
    """``(x, w, hidden size, width, fused)``: the stored logits ``[n, W]`` (then ``w`` is a
    placeholder), or (``logits`` None) ``hidden [n, H]`` and ``weight [W, H]``."""
    if logits is not None:
        return logits, logits, 1, logits.shape[1], False
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, H] and weight [W, H] must share H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    return hidden, weight, hidden.shape[1], weight.shape[0], True


def _tiles(x, hidden_size: int, blocks: dict | None, per_block: bool = False,
           store: bool = False, grad: bool = False) -> tuple:
    """``(launch constexprs and options, columns per split, row tiles per group)`` of the fused
    kernels, fixed by ``x``'s dtype and H alone: ``per_block`` 128-column tiles, ``grad``
    ``GRAD_BLOCK_N`` columns, ``store`` half the K step and one more stage (registers for the
    store), K steps of 16 for an H that is no multiple of the K step (wider masked ones spill)."""
    t = linear_blocks(x.dtype, blocks)
    block_n = BLOCK if per_block else t["GRAD_BLOCK_N" if grad else "BLOCK_N"]
    block_k, stages = t["BLOCK_K"], t["num_stages"]
    if store:
        block_k, stages = max(16, block_k // 2), stages + 1
    if hidden_size % block_k:
        block_k = 16
    split = -(-t["SPLIT_N"] // block_n) * block_n
    return dict(ROWS=t["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k,
                EVEN_K=hidden_size % block_k == 0, num_warps=t["num_warps"],
                num_stages=stages), split, t["GROUP_M"]


def shard_stats(logits, index, owned, out: torch.Tensor, *, layout: ShardLayout,
                temperature: float, entropy: bool, zsum: bool, per_block: bool = False,
                hidden=None, weight=None, block_n: int | None = None,
                blocks: dict | None = None, store: torch.Tensor | None = None) -> None:
    """Write a chunk's shard statistics into ``out`` as ``_math.chunk_stats`` of
    ``load_chunk(logits)`` does (same rows, same units).

    The chunk: ``logits`` ``[n, W]`` (bf16/fp16/fp32, any strides), or with ``logits=None``
    ``hidden`` ``[n, H]`` and the weight shard ``weight`` ``[W, H]`` (same dtype), whose logits
    ``hidden @ weight.T`` are rounded to that dtype and written into ``store`` (``[n, W]``) if
    given. ``out``: fp32 ``[NUM_STATS, n]`` (any strides), or with ``per_block``
    ``[NUM_STATS, n, ceil(W / BLOCK)]`` (``_math.block_stats``). ``index``/``owned``: as for
    ``chunk_stats``. ``block_n``: columns per step of the unfused pass (a power of two in
    [16, 2048], default :func:`block_columns`); ``blocks``: fused tiles (``LINEAR_BLOCKS`` keys).
    Method: one pass of online rescaling (:mod:`.triton_tiles`) per lane of a row (unfused,
    merged in the kernel) or per column split (fused, merged by ``_math.reduce_blocks``), the
    fused tiles never stored unless asked, as in cut cross-entropy (Wijmans et al. 2024,
    arXiv:2411.09009). Raises ``ValueError`` for a misshaped ``out`` or ``store``, a bad
    ``block_n`` or mismatched hidden/weight.
    """
    x, w, hidden_size, width, fused = _operands(logits, hidden, weight)
    n = x.shape[0]
    want = (NUM_STATS, n, -(-width // BLOCK)) if per_block else (NUM_STATS, n)
    if out.shape != want or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 {list(want)}, got {out.dtype} {tuple(out.shape)}")
    if store is not None and (store.shape != (n, width) or store.dtype != x.dtype):
        raise ValueError(f"store must be {x.dtype} [{n}, {width}], got {store.dtype} "
                         f"{tuple(store.shape)}")
    if n == 0:
        return
    has_target = index is not None
    # With the logits stored, the shard's target logits are read from there (fewer registers in
    # the kernel: none of its tiles look for a target); per block, the kernel places them.
    picked = has_target and (store is None or per_block)
    flags = dict(HAS_TARGET=picked, ENTROPY=entropy, ZSUM=zsum, SCALE=temperature != 1.0)
    targets = (_dense(index), _flag(owned)) if picked else (out, out)  # placeholders: never read
    scalars = (float(temperature), zsum_scale(layout.vocab_size))
    if not (fused or per_block):
        block = _block(block_n, width, x.element_size())
        group = min(16 // x.element_size(), block)  # one 16-byte load per lane and step
        lanes = block // group
        # One lane per thread for the widest blocks (256 lanes: 8 warps; 4 spill: docs/kernels.md)
        launch(_row_stats_kernel, (n,), x, x.stride(0), x.stride(1), *targets, out,
               out.stride(0), out.stride(1), width, layout.real_width, *scalars,
               LANES=lanes, GROUP=group, num_warps=max(4, min(8, lanes // 32)), **flags)
        return
    if fused:
        consts, split, group = _tiles(x, hidden_size, blocks, per_block, store is not None)
    else:  # per-block statistics of stored logits: one row per program, every block
        consts = dict(ROWS=1, BLOCK_N=BLOCK, BLOCK_K=16, EVEN_K=True)
        split, group = want[2] * BLOCK, 1
    splits = -(-width // split)
    parts = out if per_block or splits == 1 else out.new_empty((NUM_STATS, n, splits))
    dest = store if store is not None else x
    grid = (triton.cdiv(n, consts["ROWS"]) * splits,)
    launch(_tile_stats_kernel, grid, x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1),
           hidden_size, *targets, parts, parts.stride(0), parts.stride(1),
           parts.stride(2) if parts.dim() == 3 else 0, dest, dest.stride(0), dest.stride(1), n,
           width, layout.real_width, *scalars, split, BLOCKS=per_block, FUSED=fused,
           STORE=store is not None, ROUND=_ROUND[x.dtype], GPU=x.is_cuda, GROUP=group,
           **consts, **flags)
    if parts is not out:
        reduce_blocks(parts, out, entropy=entropy, target=picked, zsum=zsum, layout=layout,
                      part_width=split)
    if has_target and not picked:
        out[STAT_TARGET] = _target_logits(store, index, owned, layout, temperature)


def _target_logits(logits, index, owned, layout: ShardLayout, temperature: float):
    """``[n]`` fp32 ``z`` of each row's target column in ``logits`` where this shard owns it, else
    0: ``_math.load_chunk``'s value there (IEEE division by tau, the floor, padding)."""
    z = logits.gather(1, index.unsqueeze(1)).squeeze(1).float()
    if temperature != 1.0:
        z = z / temperature
    z = torch.where(index < layout.real_width, z.clamp(min=Z_FLOOR), Z_FLOOR)
    return torch.where(owned, z, 0.0)


def stats_grad(logits, out: torch.Tensor, *, lse, ent, coef_lp, coef_h, index, owned, valid,
               layout: ShardLayout, label_smoothing: float, temperature: float, hidden=None,
               weight=None, block_n: int | None = None, blocks: dict | None = None,
               lse_lo=None) -> None:
    """Write ``d loss / d logits`` of a chunk into ``out`` (``[n, W]``, the model dtype) by
    ``_grad.chunk_grad``'s closed form: one row per program (unfused; ``out`` may be ``logits``,
    each row read before the same program writes it), one recomputed tile per program (fused;
    ``out`` must not overlap ``hidden``/``weight``).

    The chunk, ``block_n`` and ``blocks`` as in :func:`shard_stats`; the rest as in
    ``_grad.chunk_grad`` (``[n]`` fp32 vectors of the chunk's rows; ``lse_lo`` None: zeros).
    Raises ``ValueError`` for a misshaped ``out`` or neither coefficient given.
    """
    x, w, hidden_size, width, fused = _operands(logits, hidden, weight)
    n = x.shape[0]
    if out.shape != (n, width):
        raise ValueError(f"out must be [{n}, {width}] like the chunk's logits, got "
                         f"{tuple(out.shape)}")
    if n == 0:
        return
    has_lp, has_h = coef_lp is not None, coef_h is not None
    if not (has_lp or has_h):
        raise ValueError("stats_grad needs coef_lp or coef_h")
    has_target = has_lp and index is not None
    flags = dict(HAS_LP=has_lp, HAS_H=has_h, HAS_TARGET=has_target,
                 SMOOTH=has_target and label_smoothing > 0.0, HAS_VALID=valid is not None,
                 SCALE=temperature != 1.0, ROUND=_ROUND[out.dtype], GPU=x.is_cuda)
    lse, lse_lo, ent, coef_lp, coef_h, index = map(_dense, (lse, lse_lo, ent, coef_lp, coef_h,
                                                            index))
    dummy = lse  # placeholders: the constexpr flags turn those loads off
    rows = (lse, torch.zeros_like(lse) if lse_lo is None else lse_lo, ent if has_h else dummy,
            coef_lp if has_lp else dummy,
            coef_h if has_h else dummy, index if has_target else dummy,
            _flag(owned) if has_target else dummy, _flag(valid) if valid is not None else dummy)
    scalars = (layout.real_width, float(temperature), label_smoothing / layout.vocab_size,
               1.0 - label_smoothing)
    if not fused:
        launch(_row_grad_kernel, (n,), x, x.stride(0), x.stride(1), out, out.stride(0),
               out.stride(1), *rows, width, *scalars,
               BLOCK_N=_block(block_n, width, x.element_size()), **flags)
        return
    consts, _, _ = _tiles(x, hidden_size, blocks, grad=True)
    grid = (triton.cdiv(n, consts["ROWS"]), triton.cdiv(width, consts["BLOCK_N"]))
    launch(_tile_grad_kernel, grid, x, x.stride(0), x.stride(1), w, w.stride(0), w.stride(1),
           hidden_size, out, out.stride(0), out.stride(1), *rows, n, width, *scalars, **consts,
           **flags)


def _chunk_source(chunk) -> dict:
    """The chunk's hidden rows and the weight shard (a fused chunk), or its logits."""
    if chunk.hidden is not None:
        return dict(logits=None, hidden=chunk.hidden, weight=chunk.weight)
    return dict(logits=chunk.logits)


@dataclass(frozen=True, slots=True, eq=False)
class TritonShardStats:
    """:class:`~..engine.kernel.ChunkStats` of :func:`shard_stats`: ``engine.kernel.ShardStats``'s
    fields plus the temperature (the torch path's ``load_chunk`` applies it)."""

    layout: ShardLayout
    entropy: bool
    zsum: bool
    temperature: float
    blocks: bool = False

    def __call__(self, chunk, out: torch.Tensor) -> None:
        # A fused chunk that also carries a logits buffer gets its logits stored there.
        store = chunk.logits if chunk.hidden is not None else None
        shard_stats(index=chunk.index, owned=chunk.owned, out=out, layout=self.layout,
                    temperature=self.temperature, entropy=self.entropy, zsum=self.zsum,
                    per_block=self.blocks, store=store, **_chunk_source(chunk))


@dataclass(frozen=True, slots=True, eq=False)
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
