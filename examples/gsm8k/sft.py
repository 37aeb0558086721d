"""SFT mode: train on GSM8K answers, evaluate before/after, compare loss paths, report."""

from __future__ import annotations

import contextlib
import random
import time

from . import report
from .data import Batch, PackedRows
from .model import Parallel, clip_grad_norm_, make_optimizer, run_schedule
from .steps import (
    compare_loss_paths,
    evaluate_nll,
    labels_forward_step,
    reduce_reports,
    shard_batch,
)


def step_rows(rows: PackedRows, step: int, args, par: Parallel) -> list[Batch]:
    """This data-parallel rank's microbatches of ``step`` (cycling over the rows)."""
    per_step = args.micro_batches * par.dp
    first = 0 if args.repeat_batch else step * per_step
    mine = list(range(first, first + per_step))[par.dp_rank::par.dp]
    return [rows[k % len(rows)] for k in mine]


def train(model, train_rows: PackedRows, args, par: Parallel, step_hook=None) -> list[dict]:
    """``args.steps`` optimizer steps; returns per-step loss, grad norm, lr, tokens/s.

    ``step_hook(step, model, optimizer)``, if given, returns a context manager entered around
    each step's forward/backward/optimizer work (``step`` counts from 1); the profiler
    (``python -m examples.gsm8k.profile``) uses it to wrap the steps it measures.
    """
    from tqdm import tqdm

    optimizer, scheduler = make_optimizer(model, args)
    history = []
    bar = tqdm(range(args.steps), desc="sft", disable=not par.is_main, dynamic_ncols=True,
               mininterval=0.5)
    for step in bar:
        rows = step_rows(train_rows, step, args, par)
        hooked = step_hook(step + 1, model, optimizer) if step_hook else contextlib.nullcontext()
        with hooked:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            results = run_schedule(model, labels_forward_step(),
                                   [shard_batch(b, par) for b in rows],
                                   forward_only=False, seq_length=args.seq_length)
            norm = clip_grad_norm_(model, args.clip_grad, par)
            optimizer.step()
            scheduler.step()
        loss = reduce_reports(results, ["lm loss"], par)["lm loss"]
        seconds = time.perf_counter() - start
        real = sum(b.real_tokens for b in rows) * par.dp
        history.append({"step": step + 1, "loss": loss, "grad_norm": norm.item(),
                        "lr": scheduler.get_last_lr()[0], "seconds": seconds,
                        "tokens": real, "tokens_per_second": real / seconds})
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{real / seconds:.0f}")
    bar.close()
    return history


def packed_rows(data: dict, args, par: Parallel, alignment: int, thd: bool):
    """``(train examples shuffled with args.seed, their PackedRows, this rank's test batches)``.

    Test rows are split over data-parallel ranks (a rank left without one repeats the first).
    """
    train_examples = list(data["train"])
    random.Random(args.seed).shuffle(train_examples)
    layout = dict(seq_length=args.seq_length, alignment=alignment, device=par.device, thd=thd)
    train_rows = PackedRows(train_examples, **layout)
    test_rows = PackedRows(data["test"], **layout)
    test_batches = [test_rows[i] for i in range(par.dp_rank, len(test_rows), par.dp)] or \
        [test_rows[0]]
    return train_examples, train_rows, test_batches


def run(model, data: dict, args, par: Parallel, alignment: int, thd: bool) -> dict:
    """The SFT demo: test NLL, training, test NLL, loss-path comparison; prints and writes.

    ``data`` holds ``train`` and ``test`` lists of :class:`Example`. Returns the result dict
    (also written as JSON on rank 0, with the PNG, once everything has succeeded).
    """
    train_examples, train_rows, test_batches = packed_rows(data, args, par, alignment, thd)

    if par.is_main:
        print(f"sft: {len(train_examples)} train examples in {len(train_rows)} packed rows of "
              f"{args.seq_length} tokens; {len(data['test'])} test examples; "
              f"{args.steps} steps x {args.micro_batches} microbatches x dp {par.dp}", flush=True)
    clock = {"start": time.perf_counter()}
    nll_before = evaluate_nll(model, test_batches, par, args.seq_length)
    clock["eval before"] = time.perf_counter()
    if par.is_main:
        print(f"test NLL before training: {nll_before:.4f} nats/answer token", flush=True)
    history = train(model, train_rows, args, par)
    clock["train"] = time.perf_counter()
    nll_after = evaluate_nll(model, test_batches, par, args.seq_length)
    clock["eval after"] = time.perf_counter()
    if par.is_main:
        print("comparing Megatron's loss, the plugin and the fused plugin on the same batches",
              flush=True)
    compare_batches = [train_rows[i] for i in range(min(args.compare_batches, len(train_rows)))]
    compare = compare_loss_paths(model, compare_batches, par,
                                 seq_length=args.seq_length,
                                 lm_head_chunk_size=args.lm_head_chunk_size or args.compare_chunk,
                                 bf16=args.bf16)
    clock["compare"] = time.perf_counter()
    marks = list(clock.items())
    phases = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    result = {
        "mode": "sft",
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "world": {"tp": par.tp, "cp": par.cp, "dp": par.dp, "device": par.device.type},
        "train": history,
        "test_nll": {"before": nll_before, "after": nll_after,
                     "examples": len(data["test"])},
        "comparison": compare,
        "phase_seconds": phases,
    }
    if par.is_main:
        print(summary(result), flush=True)
        json_path, png_path = report.report_paths(args.out, "sft")
        report.write_outputs({json_path: report.json_writer(result),
                              png_path: (report.sft_figure(result), True)})
        print(f"wrote {json_path} and {png_path}", flush=True)
    return result


def summary(result: dict) -> str:
    """The final table: loss paths side by side, then test NLL before/after."""
    cmp = result["comparison"]
    legs = cmp["legs"]
    ranks = len(legs[0]["peak_bytes_per_rank"])
    rows = [["mean loss (nats/answer token)"] + [f"{leg['mean_loss']:.6f}" for leg in legs],
            ["max |loss - megatron| per token"] + [f"{leg['max_abs_loss_diff']:.2e}"
                                                   for leg in legs],
            ["max rel. grad diff vs megatron"] + [f"{leg['max_rel_grad_diff']:.2e}"
                                                  for leg in legs]]
    for label, key in report.peak_series(cmp):
        rows += [[f"peak LM head+loss, {label}, rank {r}"] + [report.mib(leg[key][r])
                                                               for leg in legs]
                 for r in range(ranks)]
    rows.append(["step time fwd+bwd (s)"] + [f"{leg['step_seconds']:.2f}" for leg in legs])
    verdict = "ok" if cmp["ok"] else "FAILED"
    text = report.table(["same batches"] + [leg["name"] for leg in legs], rows,
                        title=f"\nplugin vs Megatron's native loss: {verdict} "
                              f"(tolerance {cmp['tolerance']:.1e} on per-token loss)")
    test = result["test_nll"]
    train = result["train"]
    rate = sum(s["tokens"] for s in train) / max(sum(s["seconds"] for s in train), 1e-9)
    text += "\n\n" + report.table(
        ["held-out GSM8K test", "before", "after"],
        [[f"answer-token NLL ({test['examples']} questions)", f"{test['before']:.4f}",
          f"{test['after']:.4f}"],
         ["train loss (first / last step)", f"{train[0]['loss']:.4f}" if train else "-",
          f"{train[-1]['loss']:.4f}" if train else "-"]])
    text += f"\ntraining throughput: {rate:.0f} tokens/s (real tokens, all ranks of a replica)"
    text += "\nphases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["phase_seconds"].items())
    return text
