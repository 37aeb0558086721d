"""The GPU suite's fused LM-head speed table: one forward + backward of a loss of
``hidden @ weight.T`` w.r.t. hidden and weight, bf16, T = 8192, H = 4096, V = 151,936 on one GPU
(tp = 1, an NCCL group of one rank), for

* ``megatron``: ``logits = hidden @ weight.T``, then Megatron-Core's
  ``tensor_parallel.vocab_parallel_cross_entropy``;
* ``megatron_fused``: the same logits, then its ``fused_vocab_parallel_cross_entropy``
  (torch.compile'd);
* ``ours`` / ``ours_triton``: ``linear_vocab_parallel_stats`` with ``kernel="torch"`` /
  ``"triton"``: ``logprob`` (``entropy="off"``; backward recomputes the logits, 4 matmuls in all),
  ``logprob fwd-grad`` (``linear_vocab_parallel_cross_entropy(..., loss_weights=mask)``: the
  gradients computed in forward, 3 matmuls) and ``logprob+entropy`` (``entropy="grad"``, both
  differentiated);
* ``liger``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (``reduction="sum"``; Liger
  computes the gradients in forward), with its default bf16 weight-gradient accumulation and
  with ``accum_dtype=torch.float32`` (ours sums dW in fp32); and its differentiable entropy
  (``LigerFusedLinearScaledCrossEntropyFunction``, ``return_entropy=True``), which on sm90 is a
  CuTe DSL kernel needing ``nvidia-cutlass-dsl``: without it the row says so.

Every loss is ``sum(mask * per-token loss)`` (entropy rows: ``+ 0.01 * sum(mask * entropy)``)
with the mask of ``benchmarks/bench_fused_linear.Inputs`` (10% zeros: prompt tokens); Liger,
which takes no mask, gets ``ignore_index`` targets there.

Per row: ``fwd_ms`` / ``bwd_ms`` (``_runner.split_times``: CUDA events, median of ``--iters``
after ``--warmup``; ``time_ms`` is their sum), the peak (``max_memory_allocated`` over one
forward + backward after the warm-up, inputs included), TFLOP/s of the matmul floor's flops
(forward ``2 T H W``: the logits; backward ``4 T H W``: dX and dW; W = V padded to 128) and the
ratio of forward + backward to that floor at ``--peak-tflops``. Rows whose gradients are computed
in forward (``fwd-grad``, Liger) carry ``grads_in_forward``: their split says where the time
went, not a phase's rate. A provider that raises gets its error in its row.

Run (from the repo root)::

    python tests/gpu/speed_fused.py --out /tmp/fused.json [--tokens 8192] [--hidden 4096]

``tests/gpu/speed.py`` (the suite's ``speed`` step) runs it after its own table and stores its
report under ``"fused"`` of ``speed.json``. Without CUDA it writes ``{"skipped": reason}`` and
launches nothing (the hidden ``--cpu`` runs the workers on CPU with gloo: a smoke test of the
providers at small sizes, no timing worth reading).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from _suite import OUR_KERNELS, exit_with_launcher  # noqa: E402  (tests/gpu)

from _runner import (  # noqa: E402
    Measurement,
    device,
    init_worker,
    is_worker,
    launch,
    split_times,
    write_worker_rows,
)
from bench_fused_linear import Inputs, _backward, fused, fused_fwd_grad, pair  # noqa: E402
from bench_vocab_parallel import megatron_ce, megatron_fused_ce  # noqa: E402
from megatron_vocabstats.ops.options import IGNORE_INDEX  # noqa: E402
from megatron_vocabstats.profiling import peak_memory_bytes  # noqa: E402

# H200 bf16 dense peak, the data sheet's. Observed on an H200: an 8192^3 bf16 matmul through
# PyTorch at ~790 TFLOP/s, so a provider whose matmuls run at cuBLAS speed sits near 1.25 x this
# floor; the 1.3 x target leaves little beyond the three GEMMs.
H200_BF16_TFLOPS = 989.0
LIGER_MISSING = "liger-kernel is not installed (bash tests/gpu/fetch_wheels.sh carries it)"


class Unavailable(Exception):
    """A provider that cannot run here (not installed, no kernel for this GPU): a skip, not an
    error."""


def _need_liger() -> None:
    if importlib.util.find_spec("liger_kernel") is None:
        raise Unavailable(LIGER_MISSING)


def liger(accum_dtype):
    """Liger's ``LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=...)``."""
    def make(inputs: Inputs, group, chunk):
        _need_liger()
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=accum_dtype)
        target = _masked_target(inputs)

        def step():
            loss = loss_fn(inputs.weight, inputs.hidden, target)
            return lambda: _backward(loss, inputs)

        return step

    return make


def liger_entropy(inputs: Inputs, group, chunk):
    """Liger's differentiable entropy: ``LigerFusedLinearScaledCrossEntropyFunction.apply(...,
    return_entropy=True)`` (per-token NLL and entropy), a CuTe DSL kernel on sm90 only."""
    _need_liger()
    try:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            LigerFusedLinearScaledCrossEntropyFunction,
        )
    except ImportError as exc:
        raise Unavailable(f"this liger-kernel has no differentiable entropy ({exc})") from None
    if device().type != "cuda" or torch.cuda.get_device_capability(device()) != (9, 0):
        raise Unavailable("Liger's entropy kernel is sm90-only (elsewhere a torch fallback)")
    if importlib.util.find_spec("cutlass") is None:
        raise Unavailable("needs nvidia-cutlass-dsl (Liger's sm90 entropy is a CuTe DSL kernel; "
                          "its cu13 libraries' wheel is 92 MB, over a device call's 64 MiB)")
    target = _masked_target(inputs)

    def step():
        nll, ent = LigerFusedLinearScaledCrossEntropyFunction.apply(
            inputs.hidden, inputs.weight, target, temperature=1.0, ignore_index=IGNORE_INDEX,
            return_entropy=True)
        loss = nll.sum() + 0.01 * (ent.float() * inputs.mask).sum()
        return lambda: _backward(loss, inputs)

    return step


def _masked_target(inputs: Inputs) -> torch.Tensor:
    return torch.where(inputs.mask > 0, inputs.target, IGNORE_INDEX)


OUR_MODES = {"logprob": lambda kernel: fused("off", kernel=kernel, validate=False),
             "logprob fwd-grad": lambda kernel: fused_fwd_grad(kernel=kernel, validate=False),
             "logprob+entropy": lambda kernel: fused("grad", kernel=kernel, validate=False)}


def providers():
    """``(name, mode, make)``; ``make(inputs, group, chunk)`` returns a benchmark step. The Triton
    rows come last: a kernel fault spoils the CUDA context for every row after it."""
    return [
        ("megatron", "logprob", pair(megatron_ce)),
        ("megatron_fused", "logprob", pair(megatron_fused_ce)),
        ("liger", "logprob fwd-grad", liger(None)),
        ("liger", "logprob fwd-grad fp32 dW", liger(torch.float32)),
        ("liger", "logprob+entropy", liger_entropy),
        *((name, mode, of_kernel(kernel)) for name, kernel in OUR_KERNELS.items()
          for mode, of_kernel in OUR_MODES.items()),
    ]


def grads_in_forward(provider: str, mode: str) -> bool:
    return provider == "liger" or "fwd-grad" in mode


def matmul_floor(tokens: int, hidden: int, width: int, fwd_ms: float, bwd_ms: float,
                 peak_tflops: float) -> dict:
    """TFLOP/s of the matmul floor's flops (forward ``2 T H W``, backward ``4 T H W``) in each
    phase and in all, the floor's ms at ``peak_tflops`` and the ratio of fwd + bwd to it."""
    fwd_flops, bwd_flops = 2 * tokens * hidden * width, 4 * tokens * hidden * width
    floor_ms = (fwd_flops + bwd_flops) / (peak_tflops * 1e9)
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": fwd_flops / (fwd_ms * 1e9),
            "bwd_tflops": bwd_flops / (bwd_ms * 1e9),
            "tflops": (fwd_flops + bwd_flops) / ((fwd_ms + bwd_ms) * 1e9),
            "floor_ms": floor_ms, "vs_floor": (fwd_ms + bwd_ms) / floor_ms}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the suite's table")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--iters", type=int, default=5, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed iterations first (compiles and autotunes in them)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                        help="bf16 dense matmul peak of the floor, TFLOP/s (H200: 989; "
                             "measured ~790)")
    parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.tokens + args.hidden + [args.vocab, args.iters]) <= 0 or args.warmup < 0:
        parser.error("--tokens, --hidden, --vocab and --iters must be positive, --warmup >= 0")
    if args.peak_tflops <= 0:
        parser.error("--peak-tflops must be positive")
    return args


def padded_width(vocab: int) -> int:
    return -(-vocab // 128) * 128  # Megatron pads V to a multiple of 128 * tp (tp = 1)


def measure_row(row: Measurement, make, inputs: Inputs, group, args) -> None:
    """Fill ``row`` with the peak, the forward/backward split and the floor of ``make``."""
    step = make(inputs, group, None)
    fwd, bwd = split_times(step, iters=args.iters, warmup=args.warmup)
    row.peak_bytes = peak_memory_bytes(lambda: step()(), *inputs.tensors(), device=device())
    row.time_ms = fwd + bwd
    row.extra.update(matmul_floor(row.tokens, row.extra["hidden"], inputs.weight.shape[0], fwd,
                                  bwd, args.peak_tflops),
                     grads_in_forward=grads_in_forward(row.provider, row.mode))


def worker(args) -> None:
    exit_with_launcher()
    group = init_worker()
    width = padded_width(args.vocab)
    rows = []
    for hidden in args.hidden:
        gen = torch.Generator(device()).manual_seed(hidden)
        weight = ((torch.randn(width, hidden, generator=gen, device=device()) * hidden**-0.5)
                  .bfloat16().requires_grad_())
        for tokens in args.tokens:
            inputs = Inputs(weight, tokens, hidden, args.vocab, seed=tokens)
            for name, mode, make in providers():
                row = Measurement(provider=name, mode=mode, tokens=tokens, tp=1,
                                  extra={"hidden": hidden})
                try:
                    measure_row(row, make, inputs, group, args)
                except Unavailable as exc:
                    row.skipped = f"skipped: {exc}"
                except Exception as exc:  # noqa: BLE001 - reported in the table
                    row.skipped = f"error: {type(exc).__name__}: {exc}"
                    inputs.hidden.grad = inputs.weight.grad = None
                rows.append(row)
                print(f"T={tokens} H={hidden} {name}/{mode}: {row.time_ms} ms "
                      f"{row.skipped or ''}", flush=True)
            del inputs
        del weight
    write_worker_rows(args.worker_out, rows)
    dist.destroy_process_group()


def script_args(args) -> list[str]:
    """The command line of ``args`` (for the torchrun worker)."""
    return ["--out", args.out, "--tokens", *map(str, args.tokens), "--hidden",
            *map(str, args.hidden), "--vocab", str(args.vocab), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--peak-tflops", str(args.peak_tflops),
            *(["--cpu"] if args.cpu else [])]


def report(args) -> dict:
    """Driver side: ``{"config", "rows"}`` from one torchrun worker, or ``{"skipped": why}``
    without CUDA (unless ``--cpu``). Raises ``subprocess.CalledProcessError`` if the worker
    fails."""
    if not (torch.cuda.is_available() or args.cpu):
        return {"skipped": "needs a CUDA device"}
    rows = launch(os.path.abspath(__file__), 1, script_args(args))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU smoke run"
    return {"config": f"V={args.vocab} (W={padded_width(args.vocab)}), tp=1, median of "
                      f"{args.iters} after {args.warmup} warm-up, floor at {args.peak_tflops} "
                      f"TFLOP/s, {name}",
            "rows": [asdict(r) for r in rows]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if is_worker():
        worker(args)
        return 0
    with open(args.out, "w") as f:
        json.dump(report(args), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
