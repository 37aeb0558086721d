"""Compile the Triton kernels of ``ops.kernels.triton_stats`` (unfused and fused, per-row and
per-block statistics, gradient) for an H100/H200 (sm_90) without a GPU: Triton's front end, its
GPU passes and the wheel's ``ptxas``, for every dtype and a spread of the constexpr flags. Catches what the interpreter lets through (non-constexpr globals, types
that do not unify across loop iterations, unsupported ops). Also checks that the bf16 statistics
kernel loads 16 bytes per thread per block when the row is 16-byte aligned, as a launch on
torch's tensors (V = 151,936) specialises it, and that the fused bf16/fp16 kernels use Hopper's
``wgmma`` tensor-core instructions. Run by ``test_triton_kernels.py`` in a subprocess
(``python tests/unit/_triton_compile.py``): prints ``compiled N kernels`` and exits 0.
"""

from __future__ import annotations

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_vocabstats.ops.kernels import triton_stats as ts

TARGET = GPUTarget("cuda", 90, 32)
ALIGNED = [["tt.divisibility", 16]]
SOURCE = dict(x_ptr="*{dt}", stride_xm="i64", w_ptr="*{dt}", stride_wn="i64", stride_wk="i32",
              hidden="i32")
STATS = dict(SOURCE, index_ptr="*i64", owned_ptr="*i8", out_ptr="*fp32", stride_stat="i32",
             stride_tok="i32", stride_blk="i32", n_rows="i32", n_cols="i32", real_width="i32",
             temperature="fp32", zscale="fp32")
GRAD = dict(SOURCE, out_ptr="*{dt}", stride_om="i64", lse_ptr="*fp32", lse_lo_ptr="*fp32",
            ent_ptr="*fp32",
            coef_lp_ptr="*fp32", coef_h_ptr="*fp32", index_ptr="*i64", owned_ptr="*i8",
            valid_ptr="*i8", n_rows="i32", n_cols="i32", real_width="i32", temperature="fp32",
            uniform_w="fp32", hit_w="fp32")
ROUND = {"fp32": ts.ROUND_FP32, "bf16": ts.ROUND_BF16, "fp16": ts.ROUND_FP16}


def compile_kernel(fn, types: dict, dtype: str, consts: dict, fused: bool = False):
    names = list(fn.arg_names)
    # Pointers and the row length / stride 16-byte aligned, as torch's tensors are launched.
    aligned = ("x_ptr", "w_ptr", "hidden", "stride_xm", "stride_wn") if fused else (
        "x_ptr", "stride_xm", "n_cols")
    attrs = {(names.index(n),): ALIGNED for n in aligned}
    consts = dict(consts, FUSED=fused, GPU=True)
    if fused:
        consts.update(stride_xk=1, ROUND=ROUND[dtype], ROWS=ts.LINEAR_BLOCKS["BLOCK_M"],
                      BLOCK_K=ts.LINEAR_BLOCKS["BLOCK_K"])
        consts.setdefault("BLOCK_N", ts.LINEAR_BLOCKS["BLOCK_N"])
    else:
        consts.update(stride_xk=1, ROUND=0, ROWS=1, BLOCK_K=16)
        consts.setdefault("BLOCK_N", ts.MAX_BLOCK_N)
    sig = {name: "constexpr" if name in consts else types[name].format(dt=dtype)
           for name in names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=TARGET)


def _stats(dt, fused, has_target, scale, entropy, blocks=False):
    k = compile_kernel(ts._stats_kernel, STATS, dt, dict(
        HAS_TARGET=has_target, ENTROPY=entropy, ZSUM=entropy, SCALE=scale, BLOCKS=blocks,
        **({"BLOCK_N": 128} if blocks else {})), fused)
    if dt == "bf16" and not fused and not blocks and "ld.global.v4.b32" not in k.asm["ptx"]:
        raise SystemExit("bf16 statistics kernel: no 16-byte loads")
    if fused and dt != "fp32" and "wgmma" not in k.asm["ptx"]:
        raise SystemExit(f"fused {dt} statistics kernel: no wgmma")


def _grad(dt, fused, has_target, scale, has_lp, has_h):
    compile_kernel(ts._grad_kernel, GRAD, dt, dict(
        stride_on=1, HAS_LP=has_lp, HAS_H=has_h, HAS_TARGET=has_lp and has_target,
        SMOOTH=has_lp and has_target and scale, HAS_VALID=has_target, SCALE=scale,
        OUT_BF16=dt == "bf16"), fused)


def main() -> int:
    """Every dtype; the unfused kernels with every (target, temperature) pair, the per-block and
    the fused ones with both or neither (their flags reach the same code as the unfused ones)."""
    count = 0
    for dt in ("bf16", "fp16", "fp32"):
        for has_target, scale in itertools.product((False, True), repeat=2):
            both = has_target == scale
            for entropy in (True, False):
                _stats(dt, False, has_target, scale, entropy)
                count += 1
            for fused in (False, True) if both else (False,):
                terms = ((True, True), (True, False), (False, True)) if not fused else (
                    (True, True), (True, False))
                for has_lp, has_h in terms if both else ():
                    _grad(dt, fused, has_target, scale, has_lp, has_h)
                    count += 1
            if both:
                for entropy in (True, False):
                    _stats(dt, True, has_target, scale, entropy)
                    count += 1
        for fused in (False, True):
            _stats(dt, fused, True, True, True, blocks=True)
            count += 1
    print(f"compiled {count} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
