"""Benchmark: vocab_parallel_stats against Megatron's cross-entropy and a full-gather baseline.

Per tp rank: peak memory (MemTracker on CPU, max_memory_allocated on GPU), median time of one
forward+backward, and the collective calls in forward and in backward, for

* ``ours`` / ``logprob``: ``vocab_parallel_stats(..., entropy="off")``, backward of the logprobs;
* ``ours`` / ``logprob+entropy``: ``entropy="grad"``, backward of logprobs and entropy;
* ``megatron`` / ``logprob``: ``tensor_parallel.vocab_parallel_cross_entropy`` (logprob only);
* ``full_gather`` / ``logprob+entropy``: all-gather the vocabulary, fp32 ``log_softmax``, gather
  the target, ``-(p * logp).sum()``, autograd backward;
* with ``--batch-invariant``, also ``ours`` / ``logprob+entropy bi=batch`` and ``bi=tp``
  (``batch_invariant=True`` and ``"tp"``: fixed-order block reductions; see docs/cuda-graphs.md).

Run (from the repo root)::

    python benchmarks/bench_vocab_parallel.py --tokens 1024 4096 16384 --tp 1 2 4

The driver launches one torchrun job per tp size, prints a markdown table and writes it (``.md``)
and its rows (``.csv``) to a new directory per run, ``outputs/benchmarks/vocab_parallel-<UTC
time>/`` (``--out PREFIX`` to choose; with ``--results`` the committed
``benchmarks/results/vocab_parallel.md`` is replaced and ``vocab_parallel.csv`` appended to). A
configuration whose estimated memory does not fit on this machine is skipped and marked so.
"""

from __future__ import annotations

import argparse
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
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops.options import auto_chunk_size

GiB = 1024**3
# Fixed per-token fp32 allowance in the bound: stats [5, T], gathered [tp, 5, T], outputs, masks.
BOUND_PER_TOKEN_VECTORS = 48


def ours(entropy: str, chunk: int, batch_invariant: bool | str = False, kernel: str = "auto",
         validate: bool = True):
    def make(logits, target, group, vocab):
        def step():
            st = vocab_parallel_stats(logits, target, tp_group=group, vocab_size=vocab,
                                      chunk_size=chunk, entropy=entropy,
                                      batch_invariant=batch_invariant, kernel=kernel,
                                      validate=validate)
            outs = [st.logprobs] + ([st.entropy] if entropy == "grad" else [])
            return lambda: _backward(outs, logits)

        return step

    return make


def megatron_ce(group):
    """Megatron's ``tensor_parallel.vocab_parallel_cross_entropy`` as ``ce(logits, target)`` (the
    per-token loss) on ``group``; releases before 0.19 read the global TP group, set up here."""
    import inspect

    from megatron.core import tensor_parallel

    fn = tensor_parallel.vocab_parallel_cross_entropy
    if "tp_group" not in inspect.signature(fn).parameters:  # before 0.19: the global TP group
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(dist.get_world_size(group))
        return fn
    return lambda logits, target: fn(logits, target, tp_group=group)


def megatron_fused_ce(group):
    """Megatron's fused ``fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy``
    (torch.compile'd; bf16 logits only, its gradient cast to bf16) as ``ce(logits, target)``."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    return lambda logits, target: fused_vocab_parallel_cross_entropy(logits, target, group)


def logits_ce(ce_of):
    """The provider ``make(logits, target, group, vocab)`` of the per-token loss
    ``ce_of(group)(logits, target)`` (e.g. :func:`megatron_ce`), backward of all its values."""
    def make(logits, target, group, vocab):
        ce = ce_of(group)

        def step():
            loss = ce(logits, target)
            return lambda: _backward([loss], logits)

        return step

    return make


megatron = logits_ce(megatron_ce)


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary shards; backward keeps this rank's columns (same loss on all)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group, ctx.width = group, shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad[..., rank * ctx.width:(rank + 1) * ctx.width], None


def full_gather(logits, target, group, vocab):
    def step():
        full = _GatherVocab.apply(logits, group)[..., :vocab].float()
        logp = torch.log_softmax(full, dim=-1)
        lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        return lambda: _backward([lp, ent], logits)

    return step


def _backward(outputs, leaf):
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    leaf.grad = None


def peak_bound(tokens: int, width: int, chunk: int, tp: int = 1, elem_bytes: int = 2,
               rounding: float = 0.0) -> int:
    """Bytes ``vocab_parallel_stats`` is held to for one forward + backward of a
    ``[tokens, width]`` shard (``elem_bytes`` per logit) with ``chunk`` tokens per fp32 chunk on
    ``tp`` ranks: the shard and its gradient, two fp32 ``[chunk, width]`` buffers (larger by the
    share ``rounding`` where a cache rounds them up) and ``BOUND_PER_TOKEN_VECTORS`` fp32 numbers
    per token and rank."""
    shard = tokens * width * elem_bytes
    buffers = int(2 * chunk * width * 4 * (1 + rounding))
    return 2 * shard + buffers + BOUND_PER_TOKEN_VECTORS * tp * tokens * 4


def estimate_bytes(provider: str, tokens: int, width: int, tp: int, chunk: int) -> int:
    """Rough per-rank peak, used only to skip configurations that cannot fit."""
    shard = tokens * width * 2
    full = shard * tp
    if provider == "ours":
        return 2 * shard + 2 * chunk * width * 4
    if provider == "megatron":  # bf16 logits + fp32 softmax + bf16 grad (measured 4.0x)
        return 4 * shard
    return shard + 11 * full  # gathered bf16 + fp32 upcast, log_softmax, exp, grads (measured 11x)


def worker(args) -> None:
    group = init_worker()
    rank, tp = dist.get_rank(), dist.get_world_size()
    width = -(-args.vocab // (tp * 128)) * 128  # Megatron pads V to a multiple of 128 * tp
    chunk = args.chunk or auto_chunk_size(width, device())
    budget = args.memory_fraction * available_bytes() / (1 if torch.cuda.is_available() else tp)
    providers = [
        ("ours", "logprob", ours("off", chunk)),
        ("ours", "logprob+entropy", ours("grad", chunk)),
        ("megatron", "logprob", megatron),
        ("full_gather", "logprob+entropy", full_gather),
    ]
    if args.batch_invariant:
        providers += [("ours", f"logprob+entropy bi={mode}", ours("grad", chunk, flag))
                      for mode, flag in (("batch", True), ("tp", "tp"))]
    rows = []
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(tokens)
        full_logits = None
        for name, mode, make in providers:
            row = Measurement(provider=name, mode=mode, tokens=tokens, tp=tp)
            need = estimate_bytes(name, tokens, width, tp, chunk)
            if need > budget:
                row.skipped = f"skipped: needs ~{need / GiB:.1f} GiB per rank"
                rows.append(row)
                continue
            if full_logits is None:  # same shard for every provider
                shard = torch.randn(tokens, width, generator=gen).mul_(2.0)
                full_logits = shard.to(torch.bfloat16).to(device()).requires_grad_()
                target = torch.randint(0, args.vocab, (tokens,), generator=gen).to(device())
                del shard
            step = make(full_logits, target, group, args.vocab)
            cpu_ms = []
            row.peak_bytes, row.time_ms, row.fwd_collectives, row.bwd_collectives = measure(
                step, group=group, inputs=(full_logits, target), iters=args.iters, cpu_ms=cpu_ms)
            row.extra["cpu_ms"] = round(statistics.median(cpu_ms), 1)
            row.extra["shard_bytes"] = full_logits.numel() * 2
            if name == "ours":
                row.extra["chunk"] = chunk
            if name == "ours" and "bi=" not in mode:  # block statistics are outside the bound
                bound = peak_bound(tokens, width, chunk, tp)
                row.extra["bound_ratio"] = round(row.peak_bytes / bound, 3)
            rows.append(row)
            if rank == 0:
                print(f"T={tokens} tp={tp} {name}/{mode}: peak {row.peak_bytes / GiB:.3f} GiB, "
                      f"{row.time_ms:.0f} ms", flush=True)
        del full_logits
    write_worker_rows(args.worker_out, rows)
    dist.destroy_process_group()


def table(rows: list[Measurement]) -> str:
    """Markdown table; ratios are against Megatron's logprob-only run and the full gather, in the
    same run. CPU time (max over ranks) is what to compare on a shared CPU; wall time is shown
    too."""
    def by(provider, key):
        return {(r.tokens, r.tp): r.extra[key] if key in r.extra else getattr(r, key)
                for r in rows if r.provider == provider and not r.skipped}

    megatron, gather = by("megatron", "cpu_ms"), by("full_gather", "cpu_ms")
    lines = [
        "| T | tp | provider | mode | peak/rank GiB | peak / bf16 shard | bound ratio | "
        "wall ms | CPU ms | CPU / Megatron | full-gather CPU / this | collectives fwd/bwd |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.tokens, r.tp)):
        if r.skipped:
            lines.append(f"| {r.tokens} | {r.tp} | {r.provider} | {r.mode} | {r.skipped} "
                         "| | | | | | | |")
            continue
        key, cpu = (r.tokens, r.tp), r.extra["cpu_ms"]
        ratio = f"{cpu / megatron[key]:.2f}" if key in megatron else "n/a"
        speedup = f"{gather[key] / cpu:.2f}" if key in gather else "n/a"
        lines.append(
            f"| {r.tokens} | {r.tp} | {r.provider} | {r.mode} | {r.peak_bytes / GiB:.3f} | "
            f"{r.peak_bytes / r.extra['shard_bytes']:.2f} | {r.extra.get('bound_ratio', '')} | "
            f"{r.time_ms:.0f} | {cpu:.0f} | {ratio} | {speedup} | "
            f"{r.fwd_collectives}/{r.bwd_collectives} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=None,
                        help="ours: tokens per fp32 chunk (default: the op's auto size)")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations (after 1 warm-up)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also run ours with batch_invariant=True and 'tp'")
    parser.add_argument("--memory-fraction", type=float, default=0.7,
                        help="skip a configuration estimated above this share of free memory")
    add_output_arguments(parser, "vocab_parallel")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if is_worker():
        worker(args)
        return
    args.out = output_prefix(parser, args, "vocab_parallel")
    drive(os.path.abspath(__file__), args.tp, sys.argv[1:], op="vocab_parallel_stats",
          config=f"V={args.vocab} chunk={args.chunk or 'auto'} bf16 iters={args.iters}",
          table=table, out=args.out, note="glibc malloc defaults, one thread per rank")

if __name__ == "__main__":
    main()
