"""Pure parts of the GPU suite (``tests/gpu/run.sh``): GPU-count skips, the peak-memory bounds the
GPU checks hold the ops to, and the final table.

Nothing here needs CUDA; ``tests/unit/test_gpu_suite.py`` tests it on CPU.

The table: ``python tests/gpu/_suite.py OUT`` reads what ``run.sh`` left in ``OUT`` (``steps.tsv``
with one ``name<TAB>limit_s<TAB>exit code<TAB>seconds`` line per step, a JUnit XML file
``<name>.xml`` per pytest step, ``speed.json`` from ``tests/gpu/speed.py`` with the fused LM-head
table of ``tests/gpu/speed_fused.py`` under ``"fused"``, and with a GPU ``gpu_model.json``, the
static model's estimates of the same rows from ``benchmarks/gpu_model.py``), prints the speed
tables, the measured times next to the model's, and then one row per test function, and exits 1
if any test or step failed (skips are fine).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import signal
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_fused_linear import estimate_bytes as fused_estimate_bytes  # noqa: E402
from bench_vocab_parallel import BOUND_PER_TOKEN_VECTORS  # noqa: E402

# The bound benchmarks/bench_vocab_parallel.py holds the core op to (measured 0.995 .. 1.0 of it
# on CPU, results/vocab_parallel.md); ``rounding``: WORKSPACE_ROUNDING.
from bench_vocab_parallel import peak_bound as vocab_parallel_peak_bound  # noqa: E402,F401

GiB = 1024**3
MiB = 1024**2
# What the CUDA caching allocator adds over the tensors the CPU benchmark's MemTracker counts:
# each block rounded up to 512 bytes, and library workspaces (cuBLAS) allocated on first use.
GPU_ALLOWANCE_BYTES = 32 * MiB
# The ops' workspace cache (megatron_vocabstats/ops/workspace.py) hands out each chunk buffer
# rounded up to its size class: at most 1/8 more than asked.
WORKSPACE_ROUNDING = 1 / 8
TIMEOUT_CODES = (124, 137)  # GNU timeout: TERM sent at the limit; KILL after --kill-after
# Our providers in the speed tables and the ``kernel`` each one runs with.
OUR_KERNELS = {"ours": "torch", "ours_triton": "triton"}
# The targets for the fused LM head on an H200: (fwd + bwd) within this factor of the matmul
# floor, and not slower than Liger's fused linear cross-entropy.
FUSED_FLOOR_TARGET = 1.3


def load_module(path: str, name: str):
    """The Python file at ``path`` imported as module ``name`` (for scripts and the unit suite's
    ``conftest.py``, whose plain names would clash with this directory's)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def exit_with_launcher() -> None:
    """Have the kernel send this process SIGTERM when its parent (torchrun) exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``; nothing elsewhere).

    torchrun starts each rank in a session of its own, out of reach of the process-group kill
    of ``run.sh``'s ``timeout``: without this, a rank of a timed-out step could outlive it and
    keep its GPU.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher was already gone
        os.kill(os.getpid(), signal.SIGTERM)


def gpu_skip_reason(needed: int, available: int | None = None) -> str | None:
    """``"needs N GPUs (found k)"`` when fewer than ``needed`` CUDA devices are visible, else None.

    NCCL refuses two ranks on one device, so a tp = N check needs N GPUs. ``available`` defaults
    to ``torch.cuda.device_count()`` (0 without CUDA).
    """
    if available is None:
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available >= needed:
        return None
    return f"needs {needed} GPU{'s' if needed > 1 else ''} (found {available})"


def fused_peak_bound(tokens: int, width: int, hidden: int, chunk: int,
                     wgrad_mode: str = "addmm", rounding: float = 0.0) -> int:
    """Bytes: a bound on the peak of one bf16 forward + backward of
    ``linear_vocab_parallel_stats`` (tp = 1, recompute backward), inputs and gradients included.

    ``bench_fused_linear.estimate_bytes("fused", ...)`` (hidden and weight with their bf16
    gradients, the fp32 ``[W, H]`` weight-gradient sums, 10 bytes per ``[chunk, W]`` element for
    the bf16 logits chunk and the two fp32 buffers, ``dX``), plus the fp32 ``[W, H]`` product the
    ``"mm"`` weight-gradient mode adds before accumulating, plus per-token vectors, target and
    mask. The CPU benchmark's peaks sit below it (0.273 GiB against 0.313 at T = 8192, H = 256).
    ``rounding``: the share by which chunk buffers may exceed their size (``WORKSPACE_ROUNDING``).
    """
    product = width * hidden * 4 if wgrad_mode == "mm" else 0
    buffers = int(10 * chunk * width * rounding)
    return (fused_estimate_bytes("fused", tokens, width, hidden, chunk) + product + buffers
            + BOUND_PER_TOKEN_VECTORS * tokens * 4 + tokens * (8 + 4))


# ---------------------------------------------------------------------------------------------
# Results and the final table


@dataclass(frozen=True)
class Row:
    """One line of the summary: a test function (its parametrisations together) or a step."""

    step: str
    check: str
    status: str  # "ok", "skipped: why" or "FAIL: why"

    @property
    def failed(self) -> bool:
        return self.status.startswith("FAIL")


def _short(text: str, limit: int = 90) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unprefixed(name: str) -> str:
    return name[len("test_"):] if name.startswith("test_") else name


def junit_rows(step: str, path: str) -> list[Row]:
    """Summary rows of one pytest JUnit XML file: one per test function, parametrisations merged,
    labelled ``module::function`` without their ``test_`` prefixes.

    A function fails if any of its cases failed or errored, is ok if some passed, else skipped
    (with the first reason); the counts are given when they are mixed.
    """
    groups: dict[str, dict[str, list[str]]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = _unprefixed(case.get("classname", "").rsplit(".", 1)[-1])
        # A module skipped or broken at collection has no class name; its name is the module.
        name = _unprefixed(re.sub(r"\[.*\]$", "", case.get("name", "")).rsplit(".", 1)[-1])
        label = f"{module}::{name}" if module else f"{name} (module)"
        outcome, message = "ok", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "fail", child.get("message") or (child.text or "")
            elif child.tag == "skipped":
                outcome, message = "skip", child.get("message") or ""
                # A collection skip: message "collection skipped", the reason in a tuple repr.
                found = re.search(r"Skipped: (.*)'\)\s*$", child.text or "")
                if found:
                    message = found.group(1)
        groups.setdefault(label, {"ok": [], "skip": [], "fail": []})[outcome].append(message)
    rows = []
    for label, seen in groups.items():
        counts = ", ".join(f"{len(v)} {k}" for k, v in seen.items() if v)
        total = sum(len(v) for v in seen.values())
        mixed = f" ({counts})" if total > 1 and len([v for v in seen.values() if v]) > 1 else ""
        if seen["fail"]:
            status = f"FAIL: {_short(seen['fail'][0])}{mixed}"
        elif seen["ok"]:
            status = f"ok{mixed or (f' ({total} cases)' if total > 1 else '')}"
        else:
            status = f"skipped: {_short(re.sub(r'^Skipped: ', '', seen['skip'][0]))}"
        rows.append(Row(step, label, status))
    return rows


def step_row(step: str, limit: str, code: int, log_tail: str) -> Row | None:
    """A row for a step that exited badly (timeout, crash, failure without a report), or None."""
    if code == 0:
        return None
    if code in TIMEOUT_CODES:
        return Row(step, "(step)", f"FAIL: timed out after {limit} s")
    return Row(step, "(step)", f"FAIL: exit code {code}: {_short(log_tail, 120)}")


def speed_table(report: dict) -> tuple[str, list[Row]]:
    """The markdown speed tables of ``speed.json`` and their summary rows.

    ``report``: ``{"config": str, "rows": [{"provider", "mode", "tokens", "time_ms",
    "peak_bytes", "skipped"}], "fused": {...}}`` or ``{"skipped": why}``; ``"fused"`` (absent in
    older reports) is :func:`fused_table`'s. Ratios are against Megatron's native and fused
    cross-entropy at the same T. A provider of ours that errored fails the suite; one of
    Megatron's is reported as unavailable.
    """
    if "skipped" in report:
        return "", [Row("speed", "bf16 speed tables", f"skipped: {report['skipped']}")]
    rows = report["rows"]
    times = {(r["provider"], r["tokens"]): r["time_ms"] for r in rows if not r.get("skipped")}
    lines = [f"Speed, bf16, forward + backward ({report.get('config', '')}):", "",
             "| T | provider | mode | ms | / Megatron | / Megatron fused | peak GiB |",
             "|---:|---|---|---:|---:|---:|---:|"]
    summary = []
    for r in rows:
        head = f"| {r['tokens']} | {r['provider']} | {r['mode']} |"
        if r.get("skipped"):
            _not_run(r, head, 4, f"ours {r['mode']} T={r['tokens']}", lines, summary)
            continue
        ratios = []
        for base in ("megatron", "megatron_fused"):
            b = times.get((base, r["tokens"]))
            ratios.append(f"{r['time_ms'] / b:.2f}" if b else "n/a")
        lines.append(f"{head} {r['time_ms']:.2f} | {ratios[0]} | {ratios[1]} | "
                     f"{r['peak_bytes'] / GiB:.2f} |")
    lines += _bandwidth_lines(rows)
    if not summary:
        summary.append(Row("speed", "bf16 speed table", f"ok ({len(rows)} rows)"))
    if "fused" in report:
        fused_lines, fused_summary = fused_table(report["fused"])
        if fused_lines:
            lines += ["", *fused_lines]
        summary += fused_summary
    return "\n".join(lines), summary


def _not_run(r: dict, head: str, columns: int, check: str, lines: list[str],
             summary: list[Row]) -> None:
    """A speed row that did not run: its reason in the first of ``columns`` cells after
    ``head``, and a failing summary row ``check`` if it is ours (ours must run; the others may
    be unavailable)."""
    lines.append(f"{head} {r['skipped']}" + " |" * columns)
    if r["provider"] == "ours":
        summary.append(Row("speed", check, f"FAIL: {_short(r['skipped'])}"))


def _bandwidth_lines(rows: list[dict]) -> list[str]:
    """Forward/backward ms, achieved TB/s and the ratio to the one-read floor (``speed.py``'s
    ``bandwidth``) of the rows that carry them; none for older reports."""
    split = [r for r in rows if not r.get("skipped") and "fwd_ms" in (r.get("extra") or {})]
    if not split:
        return []
    lines = ["", "Forward / backward against the bandwidth floor (fwd reads 2 B per logit, bwd "
             "reads and writes 4 B):", "",
             "| T | provider | mode | fwd ms | bwd ms | fwd TB/s | bwd TB/s | floor ms | "
             "/ floor |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in split:
        x = r["extra"]
        lines.append(f"| {r['tokens']} | {r['provider']} | {r['mode']} | {x['fwd_ms']:.2f} | "
                     f"{x['bwd_ms']:.2f} | {x['fwd_tbps']:.2f} | {x['bwd_tbps']:.2f} | "
                     f"{x['floor_ms']:.2f} | {x['vs_floor']:.2f} |")
    return lines


FUSED_CHECK = "bf16 fused LM-head table"
LIGER_BASE = ("liger", "logprob fwd-grad")  # Liger's fused linear cross-entropy, its defaults


def fused_table(report: dict) -> tuple[list[str], list[Row]]:
    """The fused LM-head table (``speed_fused.py``'s report) and its summary rows.

    ``report``: ``{"config", "rows"}`` (rows as in :func:`speed_table`, ``extra`` holding
    ``hidden`` and, once measured, ``speed_fused.matmul_floor``'s numbers and
    ``grads_in_forward``), ``{"skipped": why}`` or ``{"failed": why}`` (the worker died). Ratios
    are against ``megatron`` and Liger's default row (:data:`LIGER_BASE`) at the same T and H;
    per-phase TFLOP/s are left out where the gradients are computed in forward. A row of
    ``ours`` that errored, or a failed worker, fails the suite. Closes with the targets
    and where ``ours_triton`` stands.
    """
    if "skipped" in report:
        return [], [Row("speed", FUSED_CHECK, f"skipped: {report['skipped']}")]
    if "failed" in report:
        return [], [Row("speed", FUSED_CHECK, f"FAIL: {_short(report['failed'])}")]
    rows = report["rows"]
    times = {(r["provider"], r["mode"], r["tokens"], r["extra"]["hidden"]): r["time_ms"]
             for r in rows if not r.get("skipped")}
    lines = [f"Fused LM head, bf16, forward + backward w.r.t. hidden and weight "
             f"({report.get('config', '')}); floor: 2 T H W flops forward, 4 T H W backward:",
             "", "| T | H | provider | mode | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | "
             "TFLOP/s | / floor | / Megatron | / Liger | peak GiB |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary = []
    for r in rows:
        hidden = r["extra"]["hidden"]
        head = f"| {r['tokens']} | {hidden} | {r['provider']} | {r['mode']} |"
        if r.get("skipped"):
            _not_run(r, head, 9, f"fused ours {r['mode']} T={r['tokens']} H={hidden}", lines,
                     summary)
            continue
        x = r["extra"]
        ratios = []
        for base in (("megatron", "logprob"), LIGER_BASE):
            b = times.get((*base, r["tokens"], hidden))
            ratios.append(f"{r['time_ms'] / b:.2f}" if b else "n/a")
        rates = (["n/a", "n/a"] if x["grads_in_forward"]
                 else [f"{x['fwd_tflops']:.0f}", f"{x['bwd_tflops']:.0f}"])
        lines.append(f"{head} {x['fwd_ms']:.2f} | {x['bwd_ms']:.2f} | {rates[0]} | {rates[1]} | "
                     f"{x['tflops']:.0f} | {x['vs_floor']:.2f} | {ratios[0]} | {ratios[1]} | "
                     f"{r['peak_bytes'] / GiB:.2f} |")
    lines += ["", _fused_targets(rows, times)]
    if not summary:
        summary.append(Row("speed", FUSED_CHECK, f"ok ({len(rows)} rows)"))
    return lines, summary


def _fused_targets(rows: list[dict], times: dict) -> str:
    """One line: the targets and the fastest measured ``ours_triton`` row against them."""
    line = (f"Targets (H200): fwd + bwd <= {FUSED_FLOOR_TARGET} x the floor, and not "
            "slower than Liger (/ Liger <= 1).")
    ours = [r for r in rows if r["provider"] == "ours_triton" and not r.get("skipped")]
    if not ours:
        return line + " No ours_triton row was measured."
    best = min(ours, key=lambda r: r["time_ms"])
    liger = times.get((*LIGER_BASE, best["tokens"], best["extra"]["hidden"]))
    vs_liger = f"{best['time_ms'] / liger:.2f}" if liger else "n/a"
    return (line + f" Fastest ours_triton ({best['mode']}, T={best['tokens']}, "
            f"H={best['extra']['hidden']}): {best['extra']['vs_floor']:.2f} x the floor, "
            f"{vs_liger} x Liger.")


# run.sh's file of the static model's estimates (benchmarks/gpu_model.py --speed-rows).
MODEL_JSON = "gpu_model.json"
MODEL_CHECK = "static model estimates"


def model_lines(report: dict, model: dict) -> list[str]:
    """Each measured row of ``speed.json`` (and of its fused table) next to the static model's
    estimate of the same launch (``model``: ``benchmarks/gpu_model.py --speed-rows``'s
    ``{"rows": [{"table", "provider", "mode", "tokens", "hidden", "fwd_ms", "bwd_ms",
    "time_ms"}]}``, ``docs/gpu-model.md``): forward, backward and total ms and measured over
    modelled, the numbers that calibrate the model. Empty if no row has an estimate."""
    est = {(m["table"], m["provider"], m["mode"], m["tokens"], m.get("hidden")): m
           for m in model.get("rows", [])}
    fused = report.get("fused") or {}
    measured = [("unfused", r, None) for r in report.get("rows", [])] + [
        ("fused", r, (r.get("extra") or {}).get("hidden")) for r in fused.get("rows", [])]
    lines = []
    for table, r, hidden in measured:
        m = est.get((table, r["provider"], r["mode"], r["tokens"], hidden))
        if m is None or r.get("skipped") or r.get("time_ms") is None:
            continue
        x = r.get("extra") or {}
        fwd, bwd = x.get("fwd_ms"), x.get("bwd_ms")
        split = (f"{fwd:.2f} | {m['fwd_ms']:.2f} | {bwd:.2f} | {m['bwd_ms']:.2f}"
                 if fwd is not None and bwd is not None else
                 f"n/a | {m['fwd_ms']:.2f} | n/a | {m['bwd_ms']:.2f}")
        lines.append(f"| {table} | {r['tokens']} | {hidden or ''} | {r['provider']} | "
                     f"{r['mode']} | {split} | {r['time_ms']:.2f} | {m['time_ms']:.2f} | "
                     f"{r['time_ms'] / m['time_ms']:.2f} |")
    if not lines:
        return []
    return ["Measured against the static model of the same launches (benchmarks/gpu_model.py, "
            "H200 constants; docs/gpu-model.md):", "",
            "| table | T | H | provider | mode | fwd ms | model fwd | bwd ms | model bwd | ms | "
            "model ms | measured / model |",
            "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|", *lines]


def read_results(out: str) -> tuple[str, list[Row]]:
    """Everything ``run.sh`` left in ``out``: (speed table text, summary rows in step order)."""
    rows: list[Row] = []
    speed_text = ""
    speed_report = None
    model_path = os.path.join(out, MODEL_JSON)
    steps_path = os.path.join(out, "steps.tsv")
    steps = []
    if os.path.exists(steps_path):
        with open(steps_path) as f:
            steps = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for name, limit, code, _seconds in steps:
        code = int(code)
        log = os.path.join(out, f"{name}.log")
        tail = open(log, errors="replace").read()[-2000:] if os.path.exists(log) else ""
        xml = os.path.join(out, f"{name}.xml")
        found: list[Row] = []
        if os.path.exists(xml):
            try:
                found = junit_rows(name, xml)
            except ET.ParseError:
                found = []
        json_path = os.path.join(out, f"{name}.json")
        if name == "model" and os.path.exists(model_path):
            with open(model_path) as f:
                found = [Row(name, MODEL_CHECK,
                             f"ok ({len(json.load(f).get('rows', []))} rows)")]
        elif os.path.exists(json_path):
            with open(json_path) as f:
                speed_report = json.load(f)
            speed_text, found = speed_table(speed_report)
        bad = step_row(name, limit, code, tail)
        # A failing step whose own rows already show the failure needs no extra row.
        if bad is not None and not (code not in TIMEOUT_CODES and any(r.failed for r in found)):
            found.append(bad)
        if not found:
            found.append(Row(name, "(step)", "FAIL: no results" if code else "ok (no results)"))
        rows.extend(found)
    if not steps:
        rows.append(Row("suite", "(run.sh)", f"FAIL: no steps recorded in {out}"))
    if speed_report is not None and os.path.exists(model_path):
        with open(model_path) as f:
            lines = model_lines(speed_report, json.load(f))
        if lines:
            speed_text = "\n".join([speed_text, "", *lines]) if speed_text else "\n".join(lines)
    return speed_text, rows


def summary_table(rows: list[Row], header: str) -> str:
    """The short table run.sh prints last, then a one-line count."""
    width = max([len(r.check) for r in rows] + [5])
    lines = [header, "", f"| step | {'check'.ljust(width)} | result |",
             f"|---|{'-' * (width + 2)}|---|"]
    lines += [f"| {r.step} | {r.check.ljust(width)} | {r.status} |" for r in rows]
    failed = sum(r.failed for r in rows)
    skipped = sum(r.status.startswith("skipped") for r in rows)
    lines += ["", f"GPU suite: {len(rows) - failed - skipped} ok, {skipped} skipped, "
                  f"{failed} failed"]
    return "\n".join(lines)


def device_line() -> str:
    if torch.cuda.is_available():
        return (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; "
                f"torch {torch.__version__}")
    return f"no CUDA device; torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    """Print the speed table and the summary of the run in ``argv[0]``; 1 if anything failed."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python tests/gpu/_suite.py RESULTS_DIR", file=sys.stderr)
        return 2
    speed_text, rows = read_results(argv[0])
    if speed_text:
        print(speed_text + "\n")
    print(summary_table(rows, f"GPU suite results ({device_line()}; logs in {argv[0]}):"))
    return int(any(r.failed for r in rows))


if __name__ == "__main__":
    sys.exit(main())
