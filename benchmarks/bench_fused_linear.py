"""Benchmark: the fused LM head + statistics against the unfused pairs.

Per tp rank: peak memory (MemTracker on CPU, max_memory_allocated on GPU), median wall and
process-CPU time of one forward+backward of ``sum(loss_mask * per_token_loss)`` (gradients of
hidden and of the weight shard included), collective calls in forward and backward, and the
workspace: the peak minus the inputs (hidden, weight shard, target, mask) and their gradients.
Providers:

* ``megatron_pair``: Megatron's ``ColumnParallelLinear`` (logits ``[T, V/tp]``) +
  ``tensor_parallel.vocab_parallel_cross_entropy``;
* ``unfused_ours``: the same ``ColumnParallelLinear`` + our ``vocab_parallel_stats``;
* ``fused``: ``linear_vocab_parallel_stats`` (recompute backward), log-prob only, and with
  differentiable entropy;
* ``fused_fwd_grad``: ``linear_vocab_parallel_cross_entropy(..., loss_weights=loss_mask)``
  (gradients in forward, 3 matmuls per chunk).

All share one bf16 weight shard (the ``ColumnParallelLinear`` parameter). The hidden size is a
flag: on a CPU, H = 256 keeps T = 8192 at V = 151,936 within minutes; on a GPU use the model's.

Run (from the repo root)::

    python benchmarks/bench_fused_linear.py --tokens 2048 8192 32768 --tp 2 --hidden 4096
    python benchmarks/bench_fused_linear.py --tokens 512 --tp 2 --hidden 512 1024 \\
        --sweep-chunk 32 64 128 256 512      # fused only, one row per chunk size

The driver launches one torchrun job per tp size, prints a markdown table (time and peak ratios
against ``megatron_pair`` in the same run, workspace slope in bytes per token across the T values)
and writes it (``.md``) and its rows (``.csv``) to a new directory per run,
``outputs/benchmarks/fused_linear-<UTC time>/`` (``--out PREFIX`` to choose; with ``--results`` the
committed ``benchmarks/results/fused_linear.md`` is replaced and ``fused_linear.csv`` appended to).
Timings on a shared machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runner import (
    Measurement,
    add_output_arguments,
    available_bytes,
    device,
    drive,
    init_worker,
    is_worker,
    measure,
    output_prefix,
    write_worker_rows,
)
from bench_vocab_parallel import megatron_ce
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops.engine.linear import auto_linear_chunk_size
from megatron_vocabstats.ops.stats.from_hidden import (
    linear_vocab_parallel_cross_entropy,
    linear_vocab_parallel_stats,
)

GiB = 1024**3
BASELINE = "megatron_pair"


class Inputs:
    """The tensors every provider of one configuration shares: ``hidden`` (bf16 leaf), the given
    ``weight`` (shard), ``target`` and a loss ``mask`` (10% prompt tokens). ``layer`` (Megatron's
    ``ColumnParallelLinear`` holding ``weight``) computes the unfused pairs' logits; None: a
    plain ``hidden @ weight.T``."""

    def __init__(self, weight, tokens: int, hidden_size: int, vocab: int, seed: int, layer=None):
        gen = torch.Generator().manual_seed(seed)
        dev = device()
        self.layer = layer
        self.weight = weight
        self.hidden = (torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16)
                       .to(dev).requires_grad_())
        self.target = torch.randint(0, vocab, (tokens,), generator=gen).to(dev)
        self.mask = (torch.rand(tokens, generator=gen) > 0.1).float().to(dev)  # 10% prompt
        self.vocab = vocab

    def tensors(self):
        return self.hidden, self.weight, self.target, self.mask

    def logits(self):
        if self.layer is None:
            return self.hidden @ self.weight.T
        return self.layer(self.hidden)[0]

    def input_and_grad_bytes(self) -> int:
        h, w, t, m = self.tensors()
        dense = h.numel() * h.element_size() + w.numel() * w.element_size()
        return 2 * dense + t.numel() * t.element_size() + m.numel() * m.element_size()


def _backward(loss, inputs: Inputs):
    loss.backward()
    inputs.hidden.grad = None
    inputs.weight.grad = None


def pair(ce_of):
    """The unfused pair of the LM head's logits (``Inputs.logits``) and the per-token loss
    ``ce_of(group)(logits, target)`` (``bench_vocab_parallel.megatron_ce`` and the like)."""
    def make(inputs: Inputs, group, chunk):
        ce = ce_of(group)

        def step():
            logits = inputs.logits()
            loss = (ce(logits, inputs.target) * inputs.mask).sum()
            del logits
            return lambda: _backward(loss, inputs)

        return step

    return make


def _ours_ce(group, vocab):
    def ce(logits, target):
        return -vocab_parallel_stats(logits, target, tp_group=group, vocab_size=vocab,
                                     entropy="off").logprobs

    return ce


def unfused_ours(inputs: Inputs, group, chunk):
    return pair(lambda g: _ours_ce(g, inputs.vocab))(inputs, group, chunk)


def _kernel_kwargs(kernel: str | None) -> dict:
    # None: the op's default, without naming the keyword (older releases have none).
    return {} if kernel is None else {"kernel": kernel}


def fused(entropy: str, batch_invariant: bool = False, kernel: str | None = None,
          validate: bool = True):
    def make(inputs: Inputs, group, chunk):
        def step():
            st = linear_vocab_parallel_stats(inputs.hidden, inputs.weight, inputs.target,
                                             tp_group=group, vocab_size=inputs.vocab,
                                             chunk_size=chunk, entropy=entropy,
                                             batch_invariant=batch_invariant, validate=validate,
                                             **_kernel_kwargs(kernel))
            loss = -(st.logprobs * inputs.mask).sum()
            if entropy == "grad":
                loss = loss + 0.01 * (st.entropy * inputs.mask).sum()
            return lambda: _backward(loss, inputs)

        return step

    return make


def fused_fwd_grad(kernel: str | None = None, validate: bool = True):
    def make(inputs: Inputs, group, chunk):
        def step():
            loss = linear_vocab_parallel_cross_entropy(
                inputs.hidden, inputs.weight, inputs.target, tp_group=group,
                vocab_size=inputs.vocab, chunk_size=chunk, loss_weights=inputs.mask,
                validate=validate, **_kernel_kwargs(kernel))
            loss = (loss * inputs.mask).sum()
            return lambda: _backward(loss, inputs)

        return step

    return make


PROVIDERS = {
    (BASELINE, "logprob"): pair(megatron_ce),
    ("unfused_ours", "logprob"): unfused_ours,
    ("fused", "logprob"): fused("off"),
    ("fused", "logprob+entropy"): fused("grad"),
    ("fused_fwd_grad", "logprob"): fused_fwd_grad(),
    ("fused_batch_invariant", "logprob"): fused("off", batch_invariant=True),
}
# Run only when named in --providers.
OPT_IN = {"fused_batch_invariant"}


def estimate_bytes(provider: str, tokens: int, width: int, hidden: int, chunk: int) -> int:
    """Rough per-rank peak, used only to skip configurations that cannot fit."""
    fixed = 2 * (tokens + width) * hidden * 2 + width * hidden * 4
    if provider.startswith("fused"):
        return fixed + 10 * chunk * width + tokens * hidden * 2
    return fixed + tokens * width * 7  # measured on CPU: ~6.3 B per logit (bf16 + fp32 copies)


def build_layer(hidden: int, vocab_padded: int, group):
    """Megatron's ColumnParallelLinear (no bias, no gather), bf16, random weight shard."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    tp = dist.get_world_size(group)
    if not parallel_state.model_parallel_is_initialized():  # releases whose CE reads the global
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=torch.bfloat16,
                                 use_cpu_initialization=device().type == "cpu",
                                 perform_initialization=False)
    kwargs = {"tp_group": group} if "tp_group" in inspect.signature(
        tensor_parallel.ColumnParallelLinear).parameters else {}
    layer = tensor_parallel.ColumnParallelLinear(
        hidden, vocab_padded, config=config, init_method=torch.nn.init.zeros_, bias=False,
        gather_output=False, **kwargs).to(device())
    gen = torch.Generator().manual_seed(1000 + dist.get_rank(group))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * hidden ** -0.5)
    return layer


def worker(args) -> None:
    group = init_worker()
    rank, tp = dist.get_rank(), dist.get_world_size()
    width = -(-args.vocab // (tp * 128)) * 128  # Megatron pads V to a multiple of 128 * tp
    budget = args.memory_fraction * available_bytes() / (1 if torch.cuda.is_available() else tp)
    if args.sweep_chunk:
        runs = [(("fused", "logprob"), c) for c in args.sweep_chunk]
    else:
        chunk = args.chunk or auto_linear_chunk_size(width, device())
        runs = [(key, chunk) for key in PROVIDERS
                if (key[0] in args.providers if args.providers else key[0] not in OPT_IN)]
    rows = []
    for hidden in args.hidden:
        layer = build_layer(hidden, width * tp, group)
        for tokens in args.tokens:
            inputs = Inputs(layer.weight, tokens, hidden, args.vocab, seed=tokens, layer=layer)
            for (name, mode), chunk in runs:
                row = Measurement(provider=name, mode=mode, tokens=tokens, tp=tp)
                row.extra.update(hidden=hidden, chunk=chunk if name.startswith("fused") else 0)
                need = estimate_bytes(name, tokens, width, hidden, chunk)
                if need > budget:
                    row.skipped = f"skipped: needs ~{need / GiB:.1f} GiB per rank"
                    rows.append(row)
                    continue
                step = PROVIDERS[(name, mode)](inputs, group, chunk)
                cpu_ms = []
                row.peak_bytes, row.time_ms, row.fwd_collectives, row.bwd_collectives = measure(
                    step, group=group, inputs=inputs.tensors(), iters=args.iters,
                    warmup=args.warmup, cpu_ms=cpu_ms)
                row.extra["cpu_ms"] = statistics.median(cpu_ms)
                row.extra["workspace_bytes"] = row.peak_bytes - inputs.input_and_grad_bytes()
                rows.append(row)
                if rank == 0:
                    print(f"H={hidden} T={tokens} tp={tp} chunk={row.extra['chunk']} "
                          f"{name}/{mode}: peak {row.peak_bytes / GiB:.3f} GiB, "
                          f"{row.time_ms:.0f} ms wall, {row.extra['cpu_ms']:.0f} ms cpu",
                          flush=True)
            del inputs
        del layer
    write_worker_rows(args.worker_out, rows)
    dist.destroy_process_group()


def _slopes(rows: list[Measurement]) -> dict:
    """Least-squares slope of workspace bytes over T, per (provider, mode, tp, hidden, chunk)."""
    series: dict = {}
    for r in rows:
        if not r.skipped:
            key = (r.provider, r.mode, r.tp, r.extra["hidden"], r.extra["chunk"])
            series.setdefault(key, []).append((r.tokens, r.extra["workspace_bytes"]))
    slopes = {}
    for key, pts in series.items():
        if len({t for t, _ in pts}) < 2:
            continue
        mt = sum(t for t, _ in pts) / len(pts)
        mw = sum(w for _, w in pts) / len(pts)
        slopes[key] = (sum((t - mt) * (w - mw) for t, w in pts)
                       / sum((t - mt) ** 2 for t, _ in pts))
    return slopes


def table(rows: list[Measurement]) -> str:
    """Markdown table; ratios are against ``megatron_pair`` of the same T, tp and H."""
    base = {(r.tokens, r.tp, r.extra["hidden"]): r for r in rows
            if r.provider == BASELINE and not r.skipped}
    slopes = _slopes(rows)
    lines = [
        "| H | T | tp | chunk | provider | mode | peak/rank GiB | Megatron peak / this | "
        "workspace MiB | Megatron workspace / this | workspace slope B/token | time ms | "
        "time / Megatron | CPU ms | CPU / Megatron | collectives fwd/bwd |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.extra["hidden"], r.tokens, r.tp, r.extra["chunk"])):
        head = f"| {r.extra['hidden']} | {r.tokens} | {r.tp} | {r.extra['chunk'] or ''} | " \
               f"{r.provider} | {r.mode} |"
        if r.skipped:
            lines.append(f"{head} {r.skipped} | | | | | | | | | |")
            continue
        b = base.get((r.tokens, r.tp, r.extra["hidden"]))
        peak_ratio = f"{b.peak_bytes / r.peak_bytes:.1f}" if b else "n/a"
        space = r.extra["workspace_bytes"]
        space_ratio = f"{b.extra['workspace_bytes'] / space:.1f}" if b else "n/a"
        time_ratio = f"{r.time_ms / b.time_ms:.2f}" if b else "n/a"
        cpu_ratio = f"{r.extra['cpu_ms'] / b.extra['cpu_ms']:.2f}" if b else "n/a"
        slope = slopes.get((r.provider, r.mode, r.tp, r.extra["hidden"], r.extra["chunk"]))
        lines.append(
            f"{head} {r.peak_bytes / GiB:.3f} | {peak_ratio} | "
            f"{space / 2**20:.1f} | {space_ratio} | "
            f"{'' if slope is None else f'{slope:.0f}'} | {r.time_ms:.0f} | {time_ratio} | "
            f"{r.extra['cpu_ms']:.0f} | {cpu_ratio} | {r.fwd_collectives}/{r.bwd_collectives} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--hidden", type=int, nargs="+", default=None,
                        help="hidden sizes (default 4096 on GPU, 256 on CPU)")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=None,
                        help="fused: tokens per chunk (default: auto_linear_chunk_size)")
    parser.add_argument("--sweep-chunk", type=int, nargs="+", default=None,
                        help="measure only the fused op, once per chunk size")
    parser.add_argument("--providers", nargs="+", default=None,
                        choices=sorted({name for name, _ in PROVIDERS}))
    parser.add_argument("--iters", type=int, default=2, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations before them")
    parser.add_argument("--memory-fraction", type=float, default=0.6,
                        help="skip a configuration estimated above this share of free memory")
    add_output_arguments(parser, "fused_linear")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hidden is None:
        args.hidden = [4096] if torch.cuda.is_available() else [256]
    if is_worker():
        worker(args)
        return
    args.out = output_prefix(parser, args, "fused_linear")
    script_args = sys.argv[1:]
    if "--hidden" not in script_args:
        script_args += ["--hidden", *map(str, args.hidden)]
    config = (f"V={args.vocab} bf16 chunk={args.chunk or 'auto'} iters={args.iters} "
              f"warmup={args.warmup}{' sweep' if args.sweep_chunk else ''}")
    drive(os.path.abspath(__file__), args.tp, script_args, op="linear_vocab_parallel_stats",
          config=config, table=table, out=args.out, note="one thread per rank",
          append_md=bool(args.sweep_chunk))


if __name__ == "__main__":
    main()
