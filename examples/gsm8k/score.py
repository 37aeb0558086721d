"""Scoring mode: forward-only per-token log-probs and entropy of ``{"prompt", "response"}`` rows.

Each row is tokenised as ``[BOS] + tekken(prompt)`` then ``tekken(response)`` (no EOS), packed
with the others, and scored with :func:`megatron_vocabstats.score_tokens` through Megatron's
schedule (``forward_only=True``). The output JSONL has one line per input row, in input order::

    {"prompt": ..., "response": ..., "tokens": [ids of the response],
     "logprobs": [log p(token) in nats, <= 0], "entropy": [H of the next-token distribution,
     0 <= H <= log V], "sum_logprob": ..., "mean_entropy": ...}

The entropy at response token k is that of the distribution the token was drawn from (the
model's prediction after the prompt and the first k response tokens). Log-probs and entropy are
over the real vocabulary (``vocab_size`` = the tokenizer's), whatever Megatron's padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_vocabstats import score_tokens
from megatron_vocabstats.packing import unpack_sequences

from . import report
from .data import PackedRows
from .model import Parallel, run_schedule
from .steps import gather_tokens, logits_forward_step, shard_batch, step_batch


def _rows_of(batch, scores: dict) -> list[dict]:
    """Per-sequence response logprobs/entropy of one packed row (host lists)."""
    packed = batch.packed
    values = torch.stack([scores["logprobs"], scores["entropy"],
                          batch.loss_mask.to(scores["logprobs"].dtype)])  # [3, 1, T]
    out, _ = unpack_sequences(values.squeeze(1), packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                              cu_seqlens_padded=packed.cu_seqlens_padded)  # [3, N, S]
    out = out.double().cpu()
    rows = []
    for n in range(batch.num_sequences):
        scored = out[2, n] != 0
        lp, h = out[0, n][scored], out[1, n][scored]
        rows.append({"logprobs": lp.tolist(), "entropy": h.tolist(),
                     "sum_logprob": lp.sum().item(), "mean_entropy": h.mean().item()})
    return rows


def run(model, data: dict, args, par: Parallel, alignment: int, thd: bool) -> list[dict]:
    """Score every row; rank 0 writes ``args.output`` (atomically) and returns the rows."""
    examples = data["examples"]
    vocab_size = data["tokenizer"].n_words
    rows = PackedRows(examples, seq_length=args.seq_length, alignment=alignment,
                      device=par.device, thd=thd)
    results = {}
    model.eval()
    for g in range(par.dp_rank, len(rows), par.dp):
        batch = rows[g]
        with torch.no_grad():
            (scores,) = run_schedule(
                model, logits_forward_step(score_tokens, vocab_size=vocab_size,
                                           entropy="metric"),
                [step_batch(shard_batch(batch, par))], forward_only=True,
                seq_length=args.seq_length)
        full = {k: gather_tokens(v, batch, par) for k, v in scores.items()}
        for i, row in zip(rows.groups[g], _rows_of(batch, full)):
            results[i] = row
    everyone = [None] * par.world
    dist.all_gather_object(everyone, results if par.owns_data_shard else {})
    merged = {}
    for part in everyone:
        merged.update(part)
    rows = []
    for i, (source, example) in enumerate(zip(data["rows"], examples)):
        rows.append({"prompt": source["prompt"], "response": source["response"],
                     "tokens": example.response, **merged[i]})
    if par.is_main:
        report.write_outputs({args.output: report.jsonl_writer(rows)})
        total = sum(len(r["tokens"]) for r in rows)
        print(f"scored {len(rows)} rows ({total} response tokens); wrote {args.output}",
              flush=True)
    return rows
