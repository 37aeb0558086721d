"""Compile, for an H100/H200 (sm_90) without a GPU, every variant of the Triton kernels of
``ops.kernels`` that the ops launch: Triton's front end, its GPU passes and the wheel's
``ptxas``. Catches what the interpreter lets through (non-constexpr globals, types that do not
unify across loop iterations, unsupported ops) and what only the compiled code shows.

The variants are not restated here: the ops run on fake CUDA tensors
(``benchmarks/gpu_capture.py``) over :data:`CONFIGS` (every dtype; unfused and fused; every
entropy mode, targets or not, temperature, label smoothing, batch-invariant modes, the
forward-gradient mode; shard widths that are and are not multiples of 16), their launches are
recorded, and each distinct specialisation (Triton's own binder on the recorded arguments: the
same constexprs, 16-byte alignment and ``== 1`` specialisation of ints and strides, dtypes) is
compiled once. Checks on what compiled:

* no local memory (register spills) in any variant;
* on 16-byte aligned bf16/fp16 rows (V = 151,936, as torch's tensors are launched) every global
  load of a kernel's main innermost loop (the one with the widest loads: the unfused kernels'
  masked tail loop may load narrow) is 16 bytes per thread (``.128``): the fused kernels' weight
  too, since the launch passes ``stride_wk == 1``, which Triton makes constexpr (a runtime
  stride compiles 2-byte loads);
* the fused bf16/fp16 kernels use Hopper's ``wgmma`` (``HGMMA``);
* coverage: every constexpr parameter of each kernel takes each value in :data:`COVERAGE` in some
  compiled variant, so a flag value the ops can launch cannot go unchecked.

Run by ``test_triton_compile.py`` in a subprocess (``python tests/unit/_triton_compile.py``):
prints ``compiled N launched variants for sm_90`` and exits 0, or prints what failed and exits
1.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))

import gpu_capture  # noqa: E402
import gpu_sass  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (name, kwargs): fused ops get hidden/weight, unfused logits; "target": False for none,
# "hidden": the fused head's H (default HIDDEN; one not a multiple of BLOCK_K keeps the K mask).
CONFIGS = (
    ("unfused", dict(entropy="grad", temperature=0.7, label_smoothing=0.1)),
    ("unfused", dict(entropy="off")),
    ("unfused", dict(entropy="grad", target=False)),
    ("unfused", dict(entropy="metric", batch_invariant="tp")),
    ("fused", dict(entropy="grad", temperature=0.7, label_smoothing=0.1)),
    ("fused", dict(entropy="off")),
    ("fused", dict(entropy="metric", grad_weights=True, label_smoothing=0.1)),
    ("fused", dict(entropy="metric", batch_invariant="tp")),
    ("fused", dict(entropy="grad", target=False, hidden=1000)),
)
# Shard widths: Qwen's 151,936 over tp 2 (a multiple of 128), and one no multiple of 16 (its
# unaligned rows: for the first configuration, whose flags reach every part of the kernels).
WIDTHS = (75968, 1001)
TOKENS, HIDDEN = 1000, 4096
# constexpr -> values every kernel that has it must be compiled with.
COVERAGE = {
    "HAS_TARGET": (False, True), "ENTROPY": (False, True), "ZSUM": (False, True),
    "SCALE": (False, True), "BLOCKS": (False, True), "FUSED": (False, True),
    "STORE": (False, True), "EVEN_K": (False, True), "ROUND": (0, 1, 2),
    "HAS_LP": (False, True), "HAS_H": (False, True), "SMOOTH": (False, True),
    "HAS_VALID": (False, True), "GPU": (True,),
}


def _run(kind: str, opts: dict, dtype, width: int) -> None:
    import megatron_vocabstats as m

    opts = dict(opts)
    has_target = opts.pop("target", True)
    t = torch.zeros(TOKENS, dtype=torch.long, device="cuda") if has_target else None
    common = dict(kernel="triton", validate=False, vocab_size=width, **opts)
    if kind == "unfused":
        x = torch.empty(TOKENS, width, dtype=dtype, device="cuda", requires_grad=True)
        out = m.vocab_parallel_stats(x, t, **common)
    else:
        hidden = common.pop("hidden", HIDDEN)
        h = torch.empty(TOKENS, hidden, dtype=dtype, device="cuda", requires_grad=True)
        w = torch.empty(width, hidden, dtype=dtype, device="cuda", requires_grad=True)
        if common.pop("grad_weights", False):
            common["grad_weights"] = torch.ones(TOKENS, device="cuda")
        out = m.linear_vocab_parallel_stats(h, w, t, **common)
    ones = torch.ones(TOKENS, device="cuda")
    grads = (ones if t is not None else None, ones if opts["entropy"] == "grad" else None, None)
    if any(g is not None for g in grads):
        gpu_capture.backward(out.logprobs if t is not None else out.entropy, *grads)


def launches() -> list:
    """Every Triton launch of :data:`CONFIGS` over the dtypes and widths."""
    with gpu_capture.capturing() as cap:
        for dtype in DTYPES:
            for kind, opts in CONFIGS:
                _run(kind, opts, dtype, WIDTHS[0])
            _run(*CONFIGS[0], dtype=dtype, width=WIDTHS[1])
    return cap.triton()


_TODO: list = []  # the variants to compile (read by the forked workers)


def _compile(i: int) -> tuple:
    """``(spilled bytes or instructions, wgmma count, (wide, narrow) global loads in the
    innermost loop)`` of variant ``i``."""
    kernel = gpu_capture.compile_launch(_TODO[i])
    sass = gpu_sass.read(kernel)
    # The innermost loops that load: the K loop of the fused kernels, the column loops of the
    # unfused ones (whose masked tail loop may load narrow).
    inner = [[i for i in gpu_sass.loop_body(sass, loop) if i.root in _LOADS]
             for loop in sass.loops if loop[2] == sass.max_depth]
    inner = [loads for loads in inner if loads]
    best = max(inner, key=lambda loads: sum(_wide_load(i) for i in loads) / len(loads),
               default=[])
    wide = sum(_wide_load(i) for i in best)
    return (sass.local_bytes + sass.spill_instrs, sass.count(lambda i: i.root == "HGMMA"),
            (wide, len(best) - wide))


_LOADS = ("LDG", "LDGSTS", "UTMALDG")


def _wide_load(i) -> bool:
    return i.root == "UTMALDG" or ".128" in i.opcode


def _consts(launch) -> dict:
    return {name: launch.arg(name) for name in COVERAGE if name in launch.kernel.arg_names}


def _wide(launch) -> bool:
    """Whether 16-byte loads are expected: bf16/fp16 logits or hidden rows 16-byte aligned and
    the tile wide enough (not the per-128-column blocks of one stored row), no K mask (an H that
    is no multiple of 16 masks single elements)."""
    x = launch.arg("x_ptr")
    aligned = x.itemsize < 4 and x.stride[0] * x.itemsize % 16 == 0 and x.data_ptr() % 16 == 0
    narrow = launch.name == "_tile_stats_kernel" and not launch.arg("FUSED")
    masked_k = "EVEN_K" in launch.kernel.arg_names and not launch.arg("EVEN_K")
    return aligned and not (narrow or masked_k)


def main() -> int:
    variants: dict = {}
    for launch in launches():
        variants.setdefault(gpu_capture.specialisation_key(launch), launch)
    errors = []
    seen: dict = {}
    for launch in variants.values():
        for name, value in _consts(launch).items():
            seen.setdefault((launch.name, name), set()).add(value)
    for (kernel, name), values in sorted(seen.items()):
        missing = set(COVERAGE[name]) - values
        if missing:
            errors.append(f"{kernel}: no launched variant with {name} in {sorted(missing)}")
    _TODO[:] = variants.values()
    workers = max(1, min(4, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_compile, range(len(_TODO))))
    for launch, (spills, wgmma, wide) in zip(_TODO, results, strict=True):
        what = f"{launch.name} {_consts(launch)} {launch.arg('x_ptr').dtype}"
        if spills:
            errors.append(f"{what}: {spills} bytes/instructions of local memory (spills)")
        fused = launch.name.startswith("_tile") and launch.arg("hidden") > 1
        if fused and launch.arg("x_ptr").itemsize < 4 and not wgmma:
            errors.append(f"{what}: no wgmma")
        if _wide(launch) and (wide[1] or not wide[0]):
            errors.append(f"{what}: {wide[1]} of {sum(wide)} global loads in its widest "
                          "innermost loop are narrower than 16 bytes")
    for e in errors:
        print(e)
    print(f"compiled {len(variants)} launched variants for sm_90")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
