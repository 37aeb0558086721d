"""Benchmark: top-k distillation loss, peak memory of forward+backward against the naive path.

Per tp rank: peak memory (MemTracker on CPU, max_memory_allocated on GPU), median time of one
forward+backward and the collective calls, for a forward-KL top-k distillation loss with a
precomputed teacher top-k (K ids and log-probs per token, an input of every provider):

* ``naive`` (tp = 1 only): the public-code path, student bf16 logits ``[T, V]`` -> ``.float()``
  -> ``log_softmax`` -> gather at the teacher ids -> ``sum p_t (log p_t - log q)``, autograd;
* ``unfused``: ``distillation_loss(student_logits, teacher, mask)`` (the logits shard exists;
  :func:`vocab_parallel_topk_logprobs` picks the K columns in bf16 and never upcasts the shard);
* ``fused``: ``distillation_loss(partial(linear_vocab_parallel_topk_logprobs, hidden, weight),
  ...)`` from bf16 hidden states ``[T, H]`` and the LM-head shard ``[V/tp, H]``: no logits.

Run (from the repo root); what the results file holds was made by::

    python benchmarks/bench_topk.py --tokens 2048 --providers naive unfused fused --results
    python benchmarks/bench_topk.py --tokens 8192 --providers fused --append --results

and the full comparison (the naive path at T = 8192 needs ~15 GiB)::

    python benchmarks/bench_topk.py --tokens 2048 8192

The driver launches one torchrun job per tp size, prints a markdown table and writes it (``.md``)
and its rows (``.csv``) to a new directory per run, ``outputs/benchmarks/topk-<UTC time>/``
(``--out PREFIX`` to choose; with ``--results`` the committed ``benchmarks/results/topk.md`` is
replaced and ``topk.csv`` appended to).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runner import (
    Measurement,
    add_output_arguments,
    device,
    drive,
    init_worker,
    is_worker,
    measure,
    output_prefix,
    write_worker_rows,
)
from megatron_vocabstats import (
    TopK,
    distillation_loss,
    linear_vocab_parallel_topk_logprobs,
)

GiB = 1024**3
PROVIDERS = ("naive", "unfused", "fused")


def naive(inputs, group, vocab):
    def step():
        lq = torch.log_softmax(inputs["logits"][..., :vocab].float(), dim=-1)
        lq = lq.gather(-1, inputs["teacher"].indices)
        lp = inputs["teacher"].logprobs
        loss = ((lp.exp() * (lp - lq)).sum(-1) * inputs["mask"]).sum()
        return lambda: _backward(loss, inputs)

    return step


def unfused(inputs, group, vocab):
    def step():
        out = distillation_loss(inputs["logits"], inputs["teacher"], inputs["mask"],
                                tp_group=group, vocab_size=vocab)
        return lambda: _backward(out.loss_sum, inputs)

    return step


def fused(inputs, group, vocab):
    def step():
        student = functools.partial(linear_vocab_parallel_topk_logprobs, inputs["hidden"],
                                    inputs["weight"])
        out = distillation_loss(student, inputs["teacher"], inputs["mask"], tp_group=group,
                                vocab_size=vocab)
        return lambda: _backward(out.loss_sum, inputs)

    return step


def _backward(loss, inputs):
    loss.backward()
    for name in ("logits", "hidden", "weight"):
        if name in inputs:
            inputs[name].grad = None


def make_inputs(provider, tokens, width, tp, args, gen):
    """The provider's inputs (counted in its peak): student tensors, teacher top-k, mask."""
    lp = torch.log_softmax(torch.randn(tokens, args.k + 1, generator=gen), -1)[:, :args.k]
    ids = torch.randint(0, args.vocab, (tokens, args.k), generator=gen)
    inputs = {"teacher": TopK(lp.to(device()), ids.to(device())),
              "mask": torch.ones(tokens, device=device())}
    if provider == "fused":
        hidden = torch.randn(tokens, args.hidden, generator=gen).to(torch.bfloat16)
        weight = (torch.randn(width, args.hidden, generator=gen) * args.hidden**-0.5)
        inputs["hidden"] = hidden.to(device()).requires_grad_()
        inputs["weight"] = weight.to(torch.bfloat16).to(device()).requires_grad_()
    else:
        logits = torch.randn(tokens, width, generator=gen).mul_(2.0).to(torch.bfloat16)
        inputs["logits"] = logits.to(device()).requires_grad_()
    return inputs


def input_bytes(inputs) -> int:
    tensors = [t for v in inputs.values() for t in (v if isinstance(v, tuple) else (v,))]
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(args) -> None:
    group = init_worker()
    rank, tp = dist.get_rank(), dist.get_world_size()
    width = -(-args.vocab // (tp * 128)) * 128  # Megatron pads V to a multiple of 128 * tp
    makers = {"naive": naive, "unfused": unfused, "fused": fused}
    rows = []
    for tokens in args.tokens:
        for name in args.providers:
            row = Measurement(provider=name, mode=f"forward_kl K={args.k}", tokens=tokens, tp=tp)
            if name == "naive" and tp > 1:
                row.skipped = "skipped: the naive path is single-rank"
                rows.append(row)
                continue
            inputs = make_inputs(name, tokens, width, tp, args,
                                 torch.Generator().manual_seed(tokens + rank))
            tensors = [t for v in inputs.values() for t in (v if isinstance(v, tuple) else (v,))]
            cpu_ms = []
            row.peak_bytes, row.time_ms, row.fwd_collectives, row.bwd_collectives = measure(
                makers[name](inputs, group, args.vocab), group=group, inputs=tensors,
                iters=args.iters, cpu_ms=cpu_ms)
            row.extra["cpu_ms"] = round(statistics.median(cpu_ms), 1)
            row.extra["input_bytes"] = input_bytes(inputs)
            rows.append(row)
            if rank == 0:
                print(f"T={tokens} tp={tp} {name}: peak {row.peak_bytes / GiB:.3f} GiB, "
                      f"{row.time_ms:.0f} ms", flush=True)
            del inputs, tensors
    write_worker_rows(args.worker_out, rows)
    dist.destroy_process_group()


def table(rows: list[Measurement]) -> str:
    """Markdown table; "naive / this" compares peaks with the naive run of the same T and tp."""
    naive_peak = {(r.tokens, r.tp): r.peak_bytes for r in rows
                  if r.provider == "naive" and not r.skipped}
    lines = [
        "| T | tp | provider | mode | peak/rank GiB | naive peak / this | peak - inputs MiB | "
        "wall ms | CPU ms | collectives fwd/bwd |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.tokens, r.tp, PROVIDERS.index(r.provider))):
        if r.skipped:
            lines.append(f"| {r.tokens} | {r.tp} | {r.provider} | {r.mode} | {r.skipped} "
                         "| | | | | |")
            continue
        key = (r.tokens, r.tp)
        ratio = f"{naive_peak[key] / r.peak_bytes:.2f}" if key in naive_peak else "n/a"
        lines.append(
            f"| {r.tokens} | {r.tp} | {r.provider} | {r.mode} | {r.peak_bytes / GiB:.3f} | "
            f"{ratio} | {(r.peak_bytes - r.extra['input_bytes']) / 2**20:.1f} | "
            f"{r.time_ms:.0f} | {r.extra['cpu_ms']:.0f} | "
            f"{r.fwd_collectives}/{r.bwd_collectives} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=64, help="teacher top-k per token")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the fused path")
    parser.add_argument("--iters", type=int, default=1, help="timed iterations (after 1 warm-up)")
    parser.add_argument("--append", action="store_true", help="append to the markdown file")
    add_output_arguments(parser, "topk")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if is_worker():
        worker(args)
        return
    args.out = output_prefix(parser, args, "topk")
    drive(os.path.abspath(__file__), args.tp, sys.argv[1:], op="distillation_loss",
          config=f"V={args.vocab} K={args.k} H={args.hidden} bf16 iters={args.iters}",
          table=table, out=args.out, note="one thread per rank", append_md=args.append)


if __name__ == "__main__":
    main()
