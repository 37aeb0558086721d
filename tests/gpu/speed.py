"""The GPU suite's bf16 speed table: ``vocab_parallel_stats`` against Megatron-Core's native
``tensor_parallel.vocab_parallel_cross_entropy`` and its fused
``fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy`` (torch.compile'd), one
forward + backward of ``[T, V]`` bf16 logits on one GPU (tp = 1, an NCCL group of one rank).

Run (from the repo root)::

    python tests/gpu/speed.py --out /tmp/speed.json [--tokens 2048 8192] [--iters 10]

The driver launches one torchrun worker (``benchmarks/_runner.launch``) and writes
``{"config", "rows"}`` to ``--out`` for ``tests/gpu/_suite.py``; without CUDA it writes
``{"skipped": reason}`` and launches nothing. Timing and peak memory are the benchmarks' own
(``benchmarks/_runner.measure``: median wall time over ``--iters`` after ``--warmup`` runs,
``torch.cuda.max_memory_allocated``). A provider that raises gets its error in the row.

Our rows run the torch path (``ours``, ``kernel="torch"``) and the Triton kernels
(``ours_triton``, ``kernel="triton"``). Each of them also gets forward and backward
times of their own (``_runner.split_times``: CUDA events, ``validate=False``, median over
``--iters``), the achieved bandwidth of the bytes a one-read kernel must move (forward: read the
bf16 logits once, 2 B per logit; backward: read them and write the gradient, 4 B) and the ratio of
forward + backward to that floor at ``--peak-tbps`` (H200: 4.8 TB/s), in the row's ``extra``.

Then, unless ``--no-fused``, the fused LM-head table of ``tests/gpu/speed_fused.py`` (T = 8192,
H = 4096, against Megatron's pairs and Liger; same ``--vocab``, ``--iters`` and ``--warmup``) in a
second torchrun worker, stored under ``"fused"`` of the same JSON (rewritten once the first table
is in, so that a fused run that fails or times out leaves the first one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import speed_fused  # noqa: E402  (tests/gpu: this script's directory)
from _suite import OUR_KERNELS as KERNEL_OF  # noqa: E402
from _suite import exit_with_launcher  # noqa: E402

from _runner import (  # noqa: E402
    Measurement,
    device,
    init_worker,
    is_worker,
    launch,
    measure,
    split_times,
    write_worker_rows,
)
from bench_vocab_parallel import logits_ce, megatron, megatron_fused_ce, ours  # noqa: E402
from megatron_vocabstats.ops.options import auto_chunk_size

megatron_fused = logits_ce(megatron_fused_ce)
ENTROPY_OF = {"logprob": "off", "logprob+entropy": "grad"}


def providers(chunk: int):
    """``(name, mode, make)``; ``make(logits, target, group, vocab)`` returns a benchmark step."""
    return [
        *((name, mode, ours(ENTROPY_OF[mode], chunk, kernel=kernel))
          for name, kernel in KERNEL_OF.items() for mode in ENTROPY_OF),
        ("megatron", "logprob", megatron),
        ("megatron_fused", "logprob", megatron_fused),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the suite's table")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed iterations first (Megatron's fused op compiles in them)")
    parser.add_argument("--peak-tbps", type=float, default=4.8,
                        help="memory bandwidth of the floor, TB/s (H200: 4.8)")
    parser.add_argument("--no-fused", action="store_true",
                        help="skip the fused LM-head table (tests/gpu/speed_fused.py)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("tokens", "iters"):
        values = getattr(args, name)
        if any(v <= 0 for v in (values if isinstance(values, list) else [values])):
            parser.error(f"--{name} must be positive")
    if args.vocab <= 0 or args.warmup < 0:
        parser.error("--vocab must be positive and --warmup >= 0")
    return args


def bandwidth(tokens: int, vocab: int, fwd_ms: float, bwd_ms: float, peak_tbps: float) -> dict:
    """Achieved TB/s of the one-read floor's bytes and the ratio of fwd + bwd to that floor."""
    fwd_bytes, bwd_bytes = 2 * tokens * vocab, 4 * tokens * vocab
    floor_ms = (fwd_bytes + bwd_bytes) / (peak_tbps * 1e9)
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tbps": fwd_bytes / (fwd_ms * 1e9),
            "bwd_tbps": bwd_bytes / (bwd_ms * 1e9), "floor_ms": floor_ms,
            "vs_floor": (fwd_ms + bwd_ms) / floor_ms}


def worker(args) -> None:
    exit_with_launcher()
    group = init_worker()
    chunk = auto_chunk_size(args.vocab, device())
    rows = []
    for tokens in args.tokens:
        gen = torch.Generator(device()).manual_seed(tokens)  # on the device: 1.2e9 at T=8192
        logits = ((torch.randn(tokens, args.vocab, generator=gen, device=device()) * 2)
                  .bfloat16().requires_grad_())
        target = torch.randint(0, args.vocab, (tokens,), generator=gen, device=device())
        for name, mode, make in providers(chunk):
            row = Measurement(provider=name, mode=mode, tokens=tokens, tp=1)
            try:
                row.peak_bytes, row.time_ms, _, _ = measure(
                    make(logits, target, group, args.vocab), group=group,
                    inputs=(logits, target), iters=args.iters, warmup=args.warmup)
                if name in KERNEL_OF:
                    fast = ours(ENTROPY_OF[mode], chunk, kernel=KERNEL_OF[name], validate=False)
                    row.extra = bandwidth(tokens, args.vocab, *split_times(
                        fast(logits, target, group, args.vocab), iters=args.iters,
                        warmup=args.warmup), args.peak_tbps)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                row.skipped = f"error: {type(exc).__name__}: {exc}"
                logits.grad = None
            rows.append(row)
            print(f"T={tokens} {name}/{mode}: {row.time_ms} ms {row.skipped or ''}", flush=True)
        del logits, target
    write_worker_rows(args.worker_out, rows)
    dist.destroy_process_group()


def fused_report(args) -> dict:
    """``speed_fused``'s report for the same V, iterations and warm-up, or ``{"failed": why}``
    when its worker fails."""
    fused_args = speed_fused.parse_args(["--out", args.out, "--vocab", str(args.vocab),
                                         "--iters", str(args.iters),
                                         "--warmup", str(args.warmup)])
    try:
        return speed_fused.report(fused_args)
    except (subprocess.CalledProcessError, OSError) as exc:
        return {"failed": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if is_worker():
        worker(args)
        return 0
    if not torch.cuda.is_available():
        report = {"skipped": "needs a CUDA device"}
    else:
        script_args = ["--out", args.out, "--tokens", *map(str, args.tokens), "--vocab",
                       str(args.vocab), "--iters", str(args.iters), "--warmup", str(args.warmup),
                       "--peak-tbps", str(args.peak_tbps)]
        rows = launch(os.path.abspath(__file__), 1, script_args)
        report = {"config": f"V={args.vocab}, tp=1, median of {args.iters} after {args.warmup} "
                            f"warm-up, floor at {args.peak_tbps} TB/s, "
                            f"{torch.cuda.get_device_name()}",
                  "rows": [asdict(r) for r in rows]}
    _write(args.out, report)
    if "skipped" not in report and not args.no_fused:
        report["fused"] = fused_report(args)
        _write(args.out, report)
    return 0


def _write(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    sys.exit(main())
