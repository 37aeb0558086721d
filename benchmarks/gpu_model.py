"""Static performance model of the ops' GPU kernels on an H200, without a GPU.

Each scenario runs the real op on fake CUDA tensors (:mod:`gpu_capture`): its host code makes the
launches a GPU run makes, which are recorded, not run. Every Triton launch is compiled for sm_90
exactly as that launch specialises it (Triton's binder on the recorded arguments) and its SASS
read (:mod:`gpu_sass`); cuBLAS GEMMs and torch's elementwise kernels are recorded with their
shapes. :mod:`gpu_cost` turns each into an estimated time (constants and assumptions:
``docs/gpu-model.md``). Liger-Kernel's fused linear cross-entropy (0.8.5, the wheel of
``tests/gpu/fetch_wheels.sh``) is modelled the same way on the same shapes.

A model, not a measurement: the first GPU run of ``tests/gpu/run.sh`` prints its measured times
next to these estimates.

The scenarios are the rows of the GPU suite's speed tables (:mod:`gpu_scenarios`). Run (from the
repo root; ``TRITON_CACHE_DIR`` keeps the compiled kernels between runs)::

    python benchmarks/gpu_model.py [--tokens 8192 ...] [--hidden 4096] [--vocab 151936]
        [--scenario TEXT ...] [--summary] [--json OUT] [--speed-rows OUT]

prints per scenario a table of its kernels (grid, CTAs per SM, waves, registers, spills, shared
memory, 16-byte loads, wgmma, FLOPs, HBM bytes, estimated time and its bound, roofline) and the
scenario's total against the sum of the rooflines, then one summary line per scenario.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import gpu_capture  # noqa: E402
import gpu_cost  # noqa: E402
import gpu_sass  # noqa: E402
import gpu_work  # noqa: E402


@dataclass
class Row:
    """One group of identical launches of a scenario."""

    phase: str
    name: str
    count: int
    grid: tuple
    occ: int | None
    waves: int | None
    regs: int | None
    spills: int | None
    smem: int | None
    loads16: str
    wgmma: int | None
    est: gpu_cost.Estimate  # of one launch (glue: of all its kernels, count 1)
    kernels: int = 1  # glue: how many torch kernels the row sums


_COMPILED: dict = {}
_MATMULS = ("mm", "addmm", "addmm_", "bmm")
# torch ops that read a few elements of their first input, not all of it.
_GATHERS = ("gather", "index", "index_select", "take_along_dim")


@dataclass
class Compiled:
    """What the model reads of a compiled variant."""

    num_warps: int
    shared: int
    sass: gpu_sass.Sass


def _compile(launch) -> tuple:
    k = gpu_capture.compile_launch(launch)
    return bytes(k.asm["cubin"]), k.metadata.num_warps, k.metadata.shared


_PENDING: list = []  # launches to compile (read by forked workers)


def _compile_pending(i: int) -> tuple:
    return _compile(_PENDING[i])


def precompile(launches, jobs: int) -> None:
    """Compile the distinct variants of ``launches`` in ``jobs`` forked processes."""
    todo = {}
    for launch in launches:
        key = gpu_capture.specialisation_key(launch)
        if key not in _COMPILED and key not in todo:
            todo[key] = launch
    if jobs <= 1 or len(todo) <= 1:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    _PENDING[:] = todo.values()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for key, (cubin, warps, shared) in zip(todo, pool.map(_compile_pending,
                                                              range(len(_PENDING)))):
            _COMPILED[key] = Compiled(warps, shared, gpu_sass.read_cubin(cubin))


def compiled(launch) -> Compiled:
    key = gpu_capture.specialisation_key(launch)
    if key not in _COMPILED:
        cubin, warps, shared = _compile(launch)
        _COMPILED[key] = Compiled(warps, shared, gpu_sass.read_cubin(cubin))
    return _COMPILED[key]


def triton_row(launch, mma_efficiency: float) -> Row:
    kernel = compiled(launch)
    sass, warps = kernel.sass, kernel.num_warps
    occ = gpu_cost.occupancy(sass.regs, kernel.shared, warps)
    work = gpu_work.work_of(launch, occ)
    counts = gpu_sass.dynamic_counts(sass, work.trips, warps)
    ctas = launch.ctas()
    est = gpu_cost.triton_kernel(counts, ctas=ctas, num_warps=warps, occ=occ,
                                 hbm_bytes=work.hbm_bytes, l2_bytes_per_cta=work.l2_bytes_per_cta,
                                 mma_efficiency=mma_efficiency)
    loads = sass.count(lambda i: i.root in ("LDG", "LDGSTS", "UTMALDG"))
    wide = sass.count(lambda i: i.root == "UTMALDG" or (
        i.root in ("LDG", "LDGSTS") and ".128" in i.opcode))
    return Row(launch.phase, launch.name, 1, launch.grid, occ,
               math.ceil(ctas / (gpu_cost.SMS * max(occ, 1))), sass.regs,
               sass.spill_instrs + sass.local_bytes, kernel.shared,
               f"{wide}/{loads}", sass.count(lambda i: i.root == "HGMMA"), est)


def torch_row(op) -> Row:
    if op.name in _MATMULS:
        a, b = op.inputs[-2], op.inputs[-1]
        m, k = a.shape[-2], a.shape[-1]
        n = b.shape[-1]
        # beta = 0: the output is written, not read
        read = op.inputs[1:] if op.kwargs.get("beta", 1) == 0 else op.inputs
        in_bytes = sum(t.nbytes for t in read)
        est = gpu_cost.cublas(m, n, k, in_bytes, sum(t.nbytes for t in op.outputs))
        name = f"cuBLAS {op.name} {m}x{n}x{k}"
    else:
        if op.name in _GATHERS:  # reads only what it gathers: the output and the index
            moved = 2 * sum(t.nbytes for t in op.outputs) + sum(
                t.nbytes for t in op.inputs[1:])
        else:
            moved = sum(t.nbytes for t in op.inputs + op.outputs)
        est = gpu_cost.torch_kernel(moved)
        name = "torch glue"
    return Row(op.phase, name, 1, (), None, None, None, None, None, "", None, est)


def rows_of(cap, mma_efficiency: float = 1.0) -> list:
    """Group the scenario's launches: one row per (phase, kernel, specialisation, grid)."""
    groups: dict = {}
    for e in cap.events:
        triton = isinstance(e, gpu_capture.TritonLaunch)
        if triton:
            key = (e.phase, gpu_capture.specialisation_key(e), e.grid, _work_key(e))
        else:
            is_mm = e.name in _MATMULS
            shapes = tuple((t.shape, t.dtype) for t in e.inputs + e.outputs) if is_mm else ()
            key = (e.phase, e.name if is_mm else "glue", shapes)
        if key not in groups:
            groups[key] = triton_row(e, mma_efficiency) if triton else torch_row(e)
        else:
            row = groups[key]
            if key[1] == "glue":  # glue kernels differ in size: one row sums them
                row.est = _add(row.est, torch_row(e).est)
                row.kernels += 1
            else:
                row.count += 1
    return list(groups.values())


def _work_key(launch) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in gpu_work.work_signature(launch).items()))


def _add(a: gpu_cost.Estimate, b: gpu_cost.Estimate) -> gpu_cost.Estimate:
    bounds = {k: a.bounds.get(k, 0) + b.bounds.get(k, 0) for k in a.bounds.keys() | b.bounds}
    return gpu_cost.Estimate(a.time + b.time, bounds, a.floor + b.floor, a.flops + b.flops,
                             a.hbm_bytes + b.hbm_bytes)


def totals(rows, phase: str | None = None) -> tuple:
    """``(estimated seconds, sum of rooflines)`` of a scenario's rows (of one ``phase``)."""
    rows = [r for r in rows if phase is None or r.phase == phase]
    return (sum(r.count * r.est.time for r in rows),
            sum(r.count * r.est.floor for r in rows))


def _fmt(x, unit=1.0, digits=2):
    return "" if x is None else f"{x / unit:.{digits}f}"


def table(title: str, rows) -> str:
    head = ("| phase | kernel | launches | grid | CTAs/SM | waves | regs | spills | smem KiB | "
            "16B loads | wgmma | GFLOP | HBM GB | est. ms | bound | roofline ms |")
    lines = [f"### {title}", "", head, "|" + "---|" * 16]
    for r in rows:
        launches = f"{r.kernels} kernels" if r.name == "torch glue" else str(r.count)
        est_ms, floor_ms = r.count * r.est.time * 1e3, r.count * r.est.floor * 1e3
        grid = "x".join(map(str, r.grid))
        lines.append(
            f"| {r.phase} | {r.name} | {launches} | {grid} | {_fmt(r.occ, 1, 0)} | "
            f"{_fmt(r.waves, 1, 0)} | {_fmt(r.regs, 1, 0)} | {_fmt(r.spills, 1, 0)} | "
            f"{_fmt(r.smem, 1024, 0)} | {r.loads16} | {_fmt(r.wgmma, 1, 0)} | "
            f"{r.count * r.est.flops / 1e9:.0f} | {r.count * r.est.hbm_bytes / 1e9:.2f} | "
            f"{est_ms:.3f} | {r.est.bound} | {floor_ms:.3f} |")
    est, floor = totals(rows)
    lines += ["", f"total: est. {est * 1e3:.2f} ms, sum of rooflines {floor * 1e3:.2f} ms, "
              f"ratio {est / floor:.2f}", ""]
    return "\n".join(lines)


def _liger():
    """Liger's autograd Function: liger_kernel installed, or its wheel in .whl/
    (tests/gpu/fetch_wheels.sh) unpacked into a temporary folder; None without either."""
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "liger_kernel-*.whl")))
        if not wheels:
            return None
        import tempfile
        import zipfile

        site = os.path.join(tempfile.gettempdir(), "gpu-model-" + os.path.basename(wheels[-1]))
        if not os.path.isdir(site):
            with zipfile.ZipFile(wheels[-1]) as z:
                z.extractall(site + ".part")
            os.replace(site + ".part", site)
        sys.path.insert(0, site)
    from liger_kernel.ops.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyFunction,
    )

    return LigerFusedLinearCrossEntropyFunction


def summary(results: dict) -> str:
    """One line per scenario: modelled forward, backward and total ms, the sum of rooflines."""
    lines = ["| scenario | fwd ms | bwd ms | est. ms | sum of rooflines ms | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for title, r in results.items():
        lines.append(f"| {title} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['est_ms']:.2f} | "
                     f"{r['roofline_ms']:.2f} | {r['est_ms'] / r['roofline_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--scenario", action="append",
                   help="run only scenarios whose title contains this (repeatable)")
    p.add_argument("--mma-efficiency", type=float, default=1.0,
                   help="fraction of the tensor peak the Triton kernels' wgmma sustain "
                        "(default 1.0: the bound; cuBLAS is at gpu_cost.CUBLAS_EFFICIENCY)")
    p.add_argument("--summary", action="store_true", help="print the summary table only")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes compiling the kernels (default: CPUs, at most 8)")
    p.add_argument("--json", help="write every scenario's rows and totals here")
    p.add_argument("--speed-rows", help="write the estimates keyed as the GPU suite's speed "
                                        "tables' rows here (tests/gpu/_suite.py reads it)")
    args = p.parse_args(argv)
    import gpu_scenarios

    results, speed, captures = {}, [], {}
    for sc, run in gpu_scenarios.scenarios(args.tokens, args.hidden, args.vocab,
                                           _liger).items():
        if not args.scenario or any(f in sc.title for f in args.scenario):
            captures[sc] = run()
    precompile([e for cap in captures.values() if cap is not None for e in cap.triton()],
               args.jobs)
    for sc, cap in captures.items():
        if cap is None:
            if not args.summary:
                print(f"### {sc.title}\n\nskipped: liger-kernel not found (bash "
                      "tests/gpu/fetch_wheels.sh puts its wheel in .whl/)\n")
            continue
        rows = rows_of(cap, args.mma_efficiency)
        if not args.summary:
            print(table(sc.title, rows), flush=True)
        est, floor = totals(rows)
        fwd, bwd = totals(rows, "forward")[0], totals(rows, "backward")[0]
        results[sc.title] = {"est_ms": est * 1e3, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3,
                             "roofline_ms": floor * 1e3,
                             "kernels": [_row_json(r) for r in rows]}
        speed.append({"table": sc.table, "provider": sc.provider, "mode": sc.mode,
                      "tokens": sc.tokens, "hidden": sc.hidden, "fwd_ms": fwd * 1e3,
                      "bwd_ms": bwd * 1e3, "time_ms": est * 1e3})
    print(summary(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.speed_rows:
        with open(args.speed_rows, "w") as f:
            json.dump({"model": "benchmarks/gpu_model.py (static, H200 constants)",
                       "rows": speed}, f, indent=1)
    return 0


def _row_json(r: Row) -> dict:
    return {"phase": r.phase, "kernel": r.name, "launches": r.count, "grid": list(r.grid),
            "ctas_per_sm": r.occ, "regs": r.regs, "spills": r.spills, "smem": r.smem,
            "est_ms": r.est.time * 1e3 * r.count,
            "bound": r.est.bound, "roofline_ms": r.est.floor * 1e3,
            "bounds_ms": {k: v * 1e3 * r.count for k, v in r.est.bounds.items()}}


if __name__ == "__main__":
    sys.exit(main())
