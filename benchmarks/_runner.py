"""Small shared runner for the op benchmarks.

A benchmark script runs in two roles: the *driver* (plain ``python``) launches one torchrun job
per tp size and collects what rank 0 writes; the *worker* (under torchrun) measures each provider
on each configuration with every rank in step. Results are appended to a long-format CSV
(one row per provider, configuration and metric) and printed as a markdown table.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from megatron_vocabstats.profiling import count_collectives, peak_memory_bytes

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Where a run writes unless told otherwise: a new directory per run, never a committed table.
OUTPUTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "outputs",
                           "benchmarks")
CSV_FIELDS = ("op", "provider", "mode", "metric", "unit", "tokens", "tp", "value", "config",
              "device", "version", "timestamp")


@dataclass
class Measurement:
    """What one provider did on one configuration (rank 0's view; time is max over ranks)."""

    provider: str
    mode: str
    tokens: int
    tp: int
    peak_bytes: int | None = None
    time_ms: float | None = None
    fwd_collectives: int | None = None
    bwd_collectives: int | None = None
    skipped: str | None = None
    extra: dict = field(default_factory=dict)


def is_worker() -> bool:
    return "LOCAL_RANK" in os.environ


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def available_bytes() -> int:
    """Memory a configuration may use: the GPU's total, or the host's ``MemAvailable``."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device()).total_memory
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def init_worker() -> dist.ProcessGroup:
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=30))
    return dist.group.WORLD


def _max_over_ranks(value: float, group) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure(step: Callable[[], Callable[[], None]], *, group, inputs, iters: int,
            warmup: int = 1, cpu_ms: list[float] | None = None) -> tuple[int, float, int, int]:
    """Peak bytes, median ms, and forward/backward collective counts of ``step``.

    ``step()`` runs a forward and returns the matching backward closure; ``inputs`` are the
    tensors alive before it starts (counted in the peak). Timed iterations run a fixed number of
    times on every rank, each bracketed by barriers so ranks stay in step. If ``cpu_ms`` is a
    list, the process CPU time of each timed iteration (max over ranks) is appended to it: on a
    shared CPU it is far less sensitive than wall time to other jobs.
    """
    with count_collectives() as fwd_calls:
        backward = step()
    with count_collectives() as bwd_calls:
        backward()
    del backward
    peak = peak_memory_bytes(lambda: step()(), *inputs, device=device())
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        if device().type == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        step()()
        if device().type == "cuda":
            torch.cuda.synchronize()
        elapsed = _max_over_ranks(time.perf_counter() - start, group)
        if i >= warmup:
            times.append(elapsed * 1e3)
            if cpu_ms is not None:
                cpu_ms.append(_max_over_ranks(time.process_time() - cpu_start, group) * 1e3)
    return peak, statistics.median(times), len(fwd_calls), len(bwd_calls)


def split_times(step: Callable[[], Callable[[], None]], *, iters: int,
                warmup: int) -> tuple[float, float]:
    """Median forward and backward ms of ``step`` (``step()`` runs the forward and returns the
    backward closure): CUDA events around each half on a GPU, ``time.perf_counter`` on CPU
    (for smoke runs), over ``iters`` runs after ``warmup`` untimed ones. One process: no
    barriers (use it on tp = 1)."""
    cuda = device().type == "cuda"
    fwd, bwd = [], []
    for i in range(warmup + iters):
        if cuda:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
            backward = step()
            marks[1].record()
            backward()
            marks[2].record()
            torch.cuda.synchronize()
            times = marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])
        else:
            t0 = time.perf_counter()
            backward = step()
            t1 = time.perf_counter()
            backward()
            times = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        del backward
        if i >= warmup:
            fwd.append(times[0])
            bwd.append(times[1])
    return statistics.median(fwd), statistics.median(bwd)


def launch(script: str, tp: int, args: list[str]) -> list[Measurement]:
    """Driver side: run ``script`` under torchrun on ``tp`` local ranks; rank 0's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={tp}", script, *args, "--worker-out", out]
        print(f"# tp={tp}: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        with open(out) as f:
            return [Measurement(**row) for row in json.load(f)]


def write_worker_rows(path: str, rows: list[Measurement]) -> None:
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in rows], f)


def environment() -> dict:
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else
        f"cpu ({os.cpu_count()} cores, {platform.machine()})",
        "version": f"torch {torch.__version__}",
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def append_csv(path: str, op: str, rows: list[Measurement], config: str) -> None:
    """Append ``rows`` to the long-format CSV at ``path`` (header written once)."""
    env = environment()
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        for r in rows:
            metrics = {"peak_memory": (r.peak_bytes, "bytes"), "time": (r.time_ms, "ms"),
                       "fwd_collectives": (r.fwd_collectives, "calls"),
                       "bwd_collectives": (r.bwd_collectives, "calls")}
            metrics.update({k: (v, "") for k, v in r.extra.items()})
            for metric, (value, unit) in metrics.items():
                writer.writerow({"op": op, "provider": r.provider, "mode": r.mode,
                                 "metric": metric, "unit": unit, "tokens": r.tokens, "tp": r.tp,
                                 "value": "" if value is None else value,
                                 "config": r.skipped or config, **env})


def add_output_arguments(parser, name: str) -> None:
    """``--out PREFIX`` and ``--results``: where the driver writes ``PREFIX.md`` / ``.csv``.

    Default: ``outputs/benchmarks/<name>-<UTC time>/<name>``, a new directory per run. The
    committed tables ``benchmarks/results/<name>.md`` / ``.csv`` are written only with
    ``--results`` (the ``.md`` replaced, or appended to with ``--append``; the ``.csv`` appended).
    """
    parser.add_argument("--out", default=None, metavar="PREFIX",
                        help="write PREFIX.md and append to PREFIX.csv (default: "
                        f"outputs/benchmarks/{name}-<UTC time>/{name}, a new directory per run; "
                        "an existing PREFIX.md is refused unless --append)")
    parser.add_argument("--results", action="store_true",
                        help=f"write the committed tables benchmarks/results/{name}.md/.csv")


def output_prefix(parser, args, name: str) -> str:
    """The driver's output prefix for :func:`add_output_arguments`' flags (checked here, before
    anything runs: ``parser.error`` for ``--out`` with ``--results`` or an existing ``--out``
    table without ``--append``)."""
    append = getattr(args, "append", False)
    if args.results:
        if args.out:
            parser.error("--out and --results name two places: give one")
        return os.path.join(RESULTS_DIR, name)
    if args.out:
        if os.path.exists(args.out + ".md") and not append:
            parser.error(f"--out {args.out}: {args.out}.md exists; give a new prefix"
                         + (", or --append" if hasattr(args, "append") else ""))
        return args.out
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    return os.path.join(OUTPUTS_DIR, f"{name}-{stamp}", name)


def drive(script: str, tps: list[int], script_args: list[str], *, op: str, config: str,
          table: Callable[[list[Measurement]], str], out: str, note: str = "",
          append_md: bool = False) -> list[Measurement]:
    """Driver side of a benchmark script: one torchrun job per tp size, then the markdown table
    (printed, and written to ``out + ".md"``) and the long-format rows (appended to
    ``out + ".csv"``). Returns rank 0's measurements."""
    rows = [m for tp in tps for m in launch(script, tp, script_args)]
    env = environment()
    text = (f"{config}; {env['device']}; {env['version']}; {env['timestamp']}"
            f"{'; ' + note if note else ''}\n\n{table(rows)}\n")
    print(text)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".md", "a" if append_md else "w") as f:
        f.write(text)
    append_csv(out + ".csv", op, rows, config)
    return rows
