"""Compile the Triton kernels of ``ops.kernels.triton_stats`` for an H100/H200 (sm_90) without a
GPU: Triton's front end, its GPU passes and the wheel's ``ptxas``, for every dtype and a spread
of the constexpr flags. Catches what the interpreter lets through (non-constexpr globals, types
that do not unify across loop iterations, unsupported ops). Also checks that the bf16 statistics
kernel loads 16 bytes per thread per block when the row is 16-byte aligned, as a launch on
torch's tensors (V = 151,936) specialises it. Run by ``test_triton_kernels.py`` in a subprocess
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
STATS = dict(logits_ptr="*{dt}", stride_row="i64", index_ptr="*i64", owned_ptr="*i8",
             out_ptr="*fp32", stride_stat="i32", stride_tok="i32", n_cols="i32",
             real_width="i32", temperature="fp32", zscale="fp32")
GRAD = dict(logits_ptr="*{dt}", stride_row="i64", out_ptr="*{dt}", stride_out_row="i64",
            lse_ptr="*fp32", ent_ptr="*fp32", coef_lp_ptr="*fp32", coef_h_ptr="*fp32",
            index_ptr="*i64", owned_ptr="*i8", valid_ptr="*i8", n_cols="i32", real_width="i32",
            temperature="fp32", uniform_w="fp32", hit_w="fp32")


def compile_kernel(fn, types: dict, dtype: str, consts: dict):
    names = list(fn.arg_names)
    sig = {name: "constexpr" if name in consts else types[name].format(dt=dtype)
           for name in names}
    # Pointers and the row length / stride 16-byte aligned, as torch's tensors are launched.
    attrs = {(names.index(n),): ALIGNED for n in ("logits_ptr", "stride_row", "n_cols")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=TARGET)


def main() -> int:
    count = 0
    for dt, flags in itertools.product(("bf16", "fp16", "fp32"), itertools.product((0, 1),
                                                                                  repeat=2)):
        has_target, scale = map(bool, flags)
        for entropy, zsum in ((True, True), (False, False)):
            k = compile_kernel(ts._stats_kernel, STATS, dt, dict(
                stride_col=1, HAS_TARGET=has_target, ENTROPY=entropy, ZSUM=zsum, SCALE=scale,
                LIBM=True, BLOCK_N=ts.MAX_BLOCK_N))
            count += 1
            if dt == "bf16" and "ld.global.v4.b32" not in k.asm["ptx"]:
                print("bf16 statistics kernel: no 16-byte loads", file=sys.stderr)
                return 1
        for has_lp, has_h in ((True, True), (True, False), (False, True)):
            compile_kernel(ts._grad_kernel, GRAD, dt, dict(
                stride_col=1, stride_out_col=1, HAS_LP=has_lp, HAS_H=has_h,
                HAS_TARGET=has_lp and has_target, SMOOTH=has_lp and has_target and scale,
                HAS_VALID=has_target, SCALE=scale, OUT_BF16=dt == "bf16", LIBM=True,
                BLOCK_N=ts.MAX_BLOCK_N))
            count += 1
    print(f"compiled {count} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
