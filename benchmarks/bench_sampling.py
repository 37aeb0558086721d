"""Benchmark: log-probs under the inference sampler's distribution against the gather-based path.

Per tp rank: peak memory (MemTracker on CPU, max_memory_allocated on GPU), median time of one
forward+backward and the collective calls, for ``log q(target)`` with q vLLM's v1 sampler
distribution (temperature, then min-p, then ``apply_top_k_top_p``), the targets sampled from q
(a rollout's tokens):

* ``gather``: what RL trainers do today: all-gather the vocabulary shards into full ``[T, V]``
  logits on every rank (``torch.distributed.all_gather`` of the shard, ``cat``, ``.float()``),
  ``/ temperature``, then the kept set as vLLM builds it (min-p: ``softmax >= min_p * max``;
  ``apply_top_k_top_p``: sort ascending, top-k ``< sorted[V - k]`` masked, softmax, cumsum,
  mask ``<= 1 - top_p`` keeping the last, back to vocabulary order), ``log_softmax`` over the
  kept set, gather the target, autograd backward. The mask is computed under ``no_grad`` and
  scattered back as a bool mask (vLLM scatters the masked logits): the baseline's peak is its
  sort (fp32 values, int64 indices, the softmax), not a differentiable sort;
* ``ours``: ``vocab_parallel_sampling_logprobs(logits, target, ...)`` on the shard (radix search
  of the thresholds, no ``[T, V]`` tensor);
* ``fused``: ``linear_vocab_parallel_sampling_logprobs(hidden, weight, target, ...)`` from bf16
  hidden states ``[T, H]`` and the LM-head shard ``[V/tp, H]``: no logits at all (every pass of
  the search recomputes the chunk GEMM).

Agreement: each provider's log-probs (from its last timed run) are compared with the gather
reference at the same targets, computed untimed in row chunks so it also exists where the
``gather`` provider does not fit. The reported ``max |diff|`` is over targets kept by both, in
the rows where vLLM's sorted order has no tie across the top-p boundary; the rows with such a
tie (common with bf16 logits: the sort's order among equal values decides which tied tokens
go, here a stable sort as torch's CUDA radix sort of a vocabulary row is, and ours keeps the
highest ids as that order does, see ``megatron_vocabstats/ops/sampling/from_logits.py``) are counted
separately, with the largest difference there and the targets that one side keeps and the
other drops.

Run (from the repo root); what the results file holds was made by (about 9 and 4 minutes on a
shared 2-core CPU; ours makes 14 passes over the shard in forward, the fused path one chunk GEMM
per pass)::

    python benchmarks/bench_sampling.py --tokens 1024 --tp 2 --warmup 0 --results
    python benchmarks/bench_sampling.py --tokens 1024 --tp 1 --warmup 0 --providers gather ours \
        --append --results

and the full comparison (T = 4096 costs about 4x as much per provider; the gather path there
needs ~14.5 GiB per rank at tp = 2 by the estimate, 12.8 GiB scaling the T = 1024
measurement, and is skipped on a 24 GiB machine)::

    python benchmarks/bench_sampling.py --tokens 1024 4096 --tp 2 1

The driver launches one torchrun job per tp size, prints a markdown table and writes it (``.md``)
and its rows (``.csv``) to a new directory per run, ``outputs/benchmarks/sampling-<UTC time>/``
(``--out PREFIX`` to choose; with ``--results`` the committed ``benchmarks/results/sampling.md`` is
replaced and ``sampling.csv`` appended to); the commands above also took ``--results``. A provider
whose estimated peak does not fit this machine is skipped and marked so.
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
from megatron_vocabstats import (
    linear_vocab_parallel_sampling_logprobs,
    vocab_parallel_sampling_logprobs,
)

GiB = 1024**3
PROVIDERS = ("gather", "ours", "fused")
REF_ROWS = 128  # rows per chunk of the untimed reference


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary shards; backward keeps this rank's columns (same loss on all).
    As in ``bench_vocab_parallel.py``."""

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


@torch.no_grad()
def vllm_keep(z: torch.Tensor, top_k, top_p, min_p, ties: bool = False):
    """vLLM's kept set of fp32 ``[n, V]`` ``z`` (temperature applied): the min-p processor, then
    ``apply_top_k_top_p``'s sort-based masks. With ``ties``, also a ``[n]`` bool: True where the
    smallest kept value equals the largest one top-p dropped (vLLM's sort order decides)."""
    keep = None
    if min_p:
        probs = z.softmax(-1)
        keep = probs >= min_p * probs.amax(-1, keepdim=True)
        del probs
        z = z.masked_fill(~keep, float("-inf"))
    if top_k is None and top_p is None:
        return (keep, torch.zeros(z.shape[0], dtype=torch.bool)) if ties else keep
    z_sort, idx = z.sort(dim=-1, descending=False, stable=True)
    if top_k is not None:
        kth = z_sort[:, z_sort.shape[1] - top_k].unsqueeze(1)
        z_sort.masked_fill_(z_sort < kth, float("-inf"))
    tie = torch.zeros(z.shape[0], dtype=torch.bool, device=z.device)
    if top_p is not None:
        probs_sum = z_sort.softmax(-1).cumsum_(-1)
        drop = probs_sum <= 1 - top_p
        del probs_sum
        drop[:, -1] = False
        if ties:
            first = (~drop).int().argmax(-1)  # the smallest value top-p keeps (drop is a prefix)
            below = z_sort.gather(1, (first - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            at = z_sort.gather(1, first.unsqueeze(1)).squeeze(1)
            tie = (first > 0) & (below == at) & torch.isfinite(at)
        z_sort.masked_fill_(drop, float("-inf"))
        del drop
    kept_sorted = z_sort != float("-inf")
    del z_sort
    keep_vocab = torch.empty_like(kept_sorted).scatter_(1, idx, kept_sorted)
    keep = keep_vocab if keep is None else keep & keep_vocab
    return (keep, tie) if ties else keep


def gather(inputs, group, args):
    def step():
        full = _GatherVocab.apply(inputs["logits"], group)[..., :args.vocab]
        z = full.float() / args.temperature
        del full
        keep = vllm_keep(z.detach(), args.top_k, args.top_p, args.min_p)
        logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        del z, keep
        lp = logp.gather(-1, inputs["target"].unsqueeze(-1)).squeeze(-1)
        inputs["last"] = lp.detach()
        return lambda: _backward(lp, inputs)

    return step


def _options(args, group):
    return dict(tp_group=group, vocab_size=args.vocab, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)


def ours(inputs, group, args):
    def step():
        lp = vocab_parallel_sampling_logprobs(inputs["logits"], inputs["target"],
                                              **_options(args, group)).logprobs
        inputs["last"] = lp.detach()
        return lambda: _backward(lp, inputs)

    return step


def fused(inputs, group, args):
    def step():
        lp = linear_vocab_parallel_sampling_logprobs(inputs["hidden"], inputs["weight"],
                                                     inputs["target"],
                                                     **_options(args, group)).logprobs
        inputs["last"] = lp.detach()
        return lambda: _backward(lp, inputs)

    return step


def _backward(lp, inputs):
    # The sum of the kept targets' log-probs (a target outside the kept set would be -inf).
    torch.where(torch.isfinite(lp), lp, 0.0).sum().backward()
    for name in ("logits", "hidden", "weight"):
        if name in inputs:
            inputs[name].grad = None


@torch.no_grad()
def reference(shard, group, args, target=None, seed=0):
    """The gather path's log-probs (fp32 ``[T]``) in row chunks, untimed; samples the targets
    from q first when ``target`` is None (rank 0's draw, broadcast). Returns
    ``(target, logprobs, tie rows)``."""
    tokens = shard.shape[0]
    gen = torch.Generator().manual_seed(seed)
    out_target = torch.empty(tokens, dtype=torch.int64, device=shard.device)
    lp = torch.empty(tokens, dtype=torch.float32, device=shard.device)
    tie = torch.empty(tokens, dtype=torch.bool, device=shard.device)
    for start in range(0, tokens, REF_ROWS):
        rows = slice(start, min(start + REF_ROWS, tokens))
        parts = [torch.empty_like(shard[rows]) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard[rows].contiguous(), group=group)
        z = torch.cat(parts, dim=-1)[:, :args.vocab].float() / args.temperature
        del parts
        keep, tie[rows] = vllm_keep(z, args.top_k, args.top_p, args.min_p, ties=True)
        logp = torch.log_softmax(z.masked_fill_(~keep, float("-inf")), dim=-1)
        del z, keep
        if target is None:
            draw = torch.multinomial(logp.exp().cpu(), 1, generator=gen).squeeze(1)
            out_target[rows] = draw.to(shard.device)
        else:
            out_target[rows] = target[rows]
        lp[rows] = logp.gather(1, out_target[rows].unsqueeze(1)).squeeze(1)
        del logp
    if target is None:
        dist.broadcast(out_target, 0, group=group)
        dist.broadcast(lp, 0, group=group)
        dist.broadcast(tie, 0, group=group)
    return out_target, lp, tie


def agreement(ours_lp, ref_lp, tie) -> dict:
    """Max |diff| at targets kept by both (rows without / with a top-p boundary tie), the tie
    rows and the targets kept by one side only."""
    both = torch.isfinite(ours_lp) & torch.isfinite(ref_lp)
    diff = (ours_lp - ref_lp).abs()
    clean, tied = both & ~tie, both & tie

    def worst(mask):
        return float(diff[mask].max()) if bool(mask.any()) else 0.0

    return {"max_abs_diff": worst(clean), "tie_rows": int(tie.sum()),
            "max_abs_diff_tie_rows": worst(tied),
            "kept_by_one_side": int((torch.isfinite(ours_lp) != torch.isfinite(ref_lp)).sum())}


def estimate_bytes(provider: str, tokens: int, width: int, tp: int, args) -> int:
    """Rough per-rank peak, used only to skip configurations that cannot fit."""
    shard = tokens * width * 2
    if provider == "gather":
        # fp32 logits, sorted values, int64 indices, softmax/cumsum, masks: ~23 B per element of
        # the full [T, V]; plus the bf16 shard and its gradient.
        return 2 * shard + 23 * tokens * width * tp
    if provider == "ours":  # shard, its gradient, chunk buffers, keys and masses
        return 2 * shard + 512 * 2**20
    return 1 * GiB


def make_inputs(provider, tokens, width, args, gen):
    """The provider's differentiable inputs (counted in its peak)."""
    if provider == "fused":
        hidden = torch.randn(tokens, args.hidden, generator=gen).to(torch.bfloat16)
        weight = torch.randn(width, args.hidden, generator=gen).mul_(2.0 * args.hidden**-0.5)
        return {"hidden": hidden.to(device()).requires_grad_(),
                "weight": weight.to(torch.bfloat16).to(device()).requires_grad_()}
    logits = torch.randn(tokens, width, generator=gen).mul_(2.0).to(torch.bfloat16)
    return {"logits": logits.to(device()).requires_grad_()}


def worker(args) -> None:
    group = init_worker()
    rank, tp = dist.get_rank(), dist.get_world_size()
    width = -(-args.vocab // (tp * 128)) * 128  # Megatron pads V to a multiple of 128 * tp
    budget = (min(args.memory_fraction * available_bytes(), args.memory_cap * GiB)
              / (1 if torch.cuda.is_available() else tp))
    makers = {"gather": gather, "ours": ours, "fused": fused}
    mode = (f"temp={args.temperature} k={args.top_k} p={args.top_p}"
            + (f" min_p={args.min_p}" if args.min_p else ""))
    rows = []
    for tokens in args.tokens:
        shared = None  # the logits shard, targets and reference shared by gather and ours
        for name in args.providers:
            row = Measurement(provider=name, mode=mode, tokens=tokens, tp=tp)
            need = estimate_bytes(name, tokens, width, tp, args)
            if need > budget:
                row.skipped = f"skipped: needs ~{need / GiB:.1f} GiB per rank"
                rows.append(row)
                continue
            if name == "fused":
                inputs = make_inputs(name, tokens, width, args,
                                     torch.Generator().manual_seed(2 * tokens + rank))
                with torch.no_grad():
                    shard = (inputs["hidden"] @ inputs["weight"].T)
                target, ref_lp, tie = reference(shard, group, args, seed=tokens)
                del shard
            else:
                if shared is None:
                    logits = make_inputs(name, tokens, width, args,
                                         torch.Generator().manual_seed(tokens + rank))["logits"]
                    shared = (logits, *reference(logits.detach(), group, args, seed=tokens))
                logits, target, ref_lp, tie = shared
                inputs = {"logits": logits}
            inputs["target"] = target
            tensors = [inputs[k] for k in ("logits", "hidden", "weight", "target") if k in inputs]
            cpu_ms = []
            row.peak_bytes, row.time_ms, row.fwd_collectives, row.bwd_collectives = measure(
                makers[name](inputs, group, args), group=group, inputs=tensors,
                iters=args.iters, warmup=args.warmup, cpu_ms=cpu_ms)
            row.extra["cpu_ms"] = round(statistics.median(cpu_ms), 1)
            row.extra["input_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
            row.extra.update(agreement(inputs["last"], ref_lp, tie))
            rows.append(row)
            if rank == 0:
                print(f"T={tokens} tp={tp} {name}: peak {row.peak_bytes / GiB:.3f} GiB, "
                      f"{row.extra['cpu_ms']:.0f} CPU ms, max|diff| "
                      f"{row.extra['max_abs_diff']:.2e}, tie rows {row.extra['tie_rows']}",
                      flush=True)
            del inputs, tensors
        del shared
    write_worker_rows(args.worker_out, rows)
    dist.destroy_process_group()


def table(rows: list[Measurement]) -> str:
    """Markdown table; "gather / this" compares peaks with the gather run of the same T and tp."""
    gather_peak = {(r.tokens, r.tp): r.peak_bytes for r in rows
                   if r.provider == "gather" and not r.skipped}
    lines = [
        "| T | tp | provider | mode | peak/rank GiB | gather peak / this | peak - inputs MiB | "
        "wall ms | CPU ms | collectives fwd/bwd | max abs diff vs gather | tie rows | "
        "max abs diff, tie rows | kept by one side |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r.tokens, -r.tp, PROVIDERS.index(r.provider))):
        if r.skipped:
            lines.append(f"| {r.tokens} | {r.tp} | {r.provider} | {r.mode} | {r.skipped} "
                         "| | | | | | | | | |")
            continue
        key, x = (r.tokens, r.tp), r.extra
        ratio = f"{gather_peak[key] / r.peak_bytes:.2f}" if key in gather_peak else "n/a"
        lines.append(
            f"| {r.tokens} | {r.tp} | {r.provider} | {r.mode} | {r.peak_bytes / GiB:.3f} | "
            f"{ratio} | {(r.peak_bytes - x['input_bytes']) / 2**20:.1f} | "
            f"{r.time_ms:.0f} | {x['cpu_ms']:.0f} | {r.fwd_collectives}/{r.bwd_collectives} | "
            f"{x['max_abs_diff']:.1e} | {x['tie_rows']} | {x['max_abs_diff_tie_rows']:.1e} | "
            f"{x['kept_by_one_side']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the fused path")
    parser.add_argument("--iters", type=int, default=1, help="timed iterations (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations before them")
    parser.add_argument("--memory-fraction", type=float, default=0.7,
                        help="skip a provider estimated above this share of free memory")
    parser.add_argument("--memory-cap", type=float, default=18.0,
                        help="... or above this many GiB over all ranks")
    parser.add_argument("--append", action="store_true", help="append to the markdown file")
    add_output_arguments(parser, "sampling")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if is_worker():
        worker(args)
        return
    args.out = output_prefix(parser, args, "sampling")
    drive(os.path.abspath(__file__), args.tp, sys.argv[1:], op="sampling_logprobs",
          config=(f"V={args.vocab} H={args.hidden} bf16 temperature={args.temperature} "
                  f"top_k={args.top_k} top_p={args.top_p} min_p={args.min_p} "
                  f"iters={args.iters} warmup={args.warmup}"),
          table=table, out=args.out, note="one thread per rank", append_md=args.append)


if __name__ == "__main__":
    main()
