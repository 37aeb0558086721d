"""GRPO-style mode: groups of stand-in rollouts, group-normalised advantages, clipped updates.

Per step, for each of ``--questions-per-step`` questions (per data-parallel rank), a group of
``--group-size`` answers (:func:`.data.corrupted_answers`: the reference and corrupted variants,
standing in for sampled rollouts) gets reward 1 when its final ``#### number`` matches the
reference (Shao et al. 2024, "DeepSeekMath", GRPO: advantage ``(r - mean_group) / (std_group +
eps)``). Old log-probs come from one forward-only pass; then ``--ppo-epochs`` updates minimise
:func:`megatron_vocabstats.policy_loss` (PPO clipped surrogate, token mean) on those rollouts.

Reported per step: mean reward, entropy, clip fraction and KL (``approx kl``: Schulman's k3
estimate of KL(pi_old || pi) over response tokens, from the last update), the policy loss, and
the margin: mean per-token log-prob of rewarded minus unrewarded responses under pi_old (it rises
as the policy learns to prefer correct answers).
"""

from __future__ import annotations

import functools
import random
import time

import torch
import torch.distributed as dist

from megatron_vocabstats import policy_loss, score_tokens

from . import report
from .data import PackedRows, corrupted_answers, encode_gsm8k, reward, sequence_ids
from .model import Parallel, clip_grad_norm_, make_optimizer, run_schedule
from .steps import (gather_tokens, logits_forward_step, reduce_reports, shard_batch,
                    shard_tokens, step_batch)

EPS = 1e-6
METRICS = ("reward", "entropy", "clip fraction", "approx kl", "policy loss", "margin")


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``(r - mean) / (std + 1e-6)`` within each group; ``rewards`` ``[groups, size]`` fp32."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    return (rewards - mean) / (std + EPS)


def rollouts(rows: list[dict], tokenizer, group_size: int, rng: random.Random):
    """Tokenised stand-in rollouts (``group_size`` per GSM8K row, grouped) and their rewards.

    Returns ``(examples, rewards)``: ``Q * G`` :class:`.data.Example` and fp32 ``[Q, G]``.
    """
    examples, rewards = [], []
    for row in rows:
        answers = corrupted_answers(row["answer"], group_size, rng)
        examples += [encode_gsm8k(tokenizer, row["question"], a) for a in answers]
        rewards.append([reward(a, row["answer"]) for a in answers])
    return examples, torch.tensor(rewards, dtype=torch.float32)


def _per_token(values: torch.Tensor, batch, index: int) -> torch.Tensor:
    """``[1, T]`` tensor holding ``values[first + seq(p)]`` at each packed position p."""
    seq = sequence_ids(batch.packed.cu_seqlens_padded, batch.num_tokens)
    return values[index + seq.clamp(max=batch.num_sequences - 1).cpu()].to(
        batch.labels.device).unsqueeze(0)


def grpo_step(model, optimizer, scheduler, examples, rewards, args, par: Parallel,
              alignment: int, thd: bool, vocab_size: int) -> dict:
    """One GRPO step on this rank's rollouts; returns the step's metrics (all ranks reduced)."""
    advantages = group_advantages(rewards).reshape(-1)
    rows = PackedRows(examples, seq_length=args.seq_length, alignment=alignment,
                      device=par.device, thd=thd)
    batches = [rows[i] for i in range(len(rows))]
    firsts = [group[0] for group in rows.groups]
    # Old log-probs: one forward-only pass (logits path, entropy as a metric).
    model.eval()
    with torch.no_grad():
        scored = run_schedule(model, logits_forward_step(score_tokens, vocab_size=vocab_size,
                                                         entropy="metric"),
                              [step_batch(shard_batch(b, par)) for b in batches],
                              forward_only=True, seq_length=args.seq_length)
    model.train()
    old = [s["logprobs"] for s in scored]
    margin = _margin(batches, firsts, old, rewards.reshape(-1), par)
    items = []
    for b, first, old_lp in zip(batches, firsts, old):
        local = shard_batch(b, par)
        adv = shard_tokens(_per_token(advantages, b, first), b, par)
        items.append(step_batch(local, {"old_logprobs": old_lp, "advantages": adv}))
    loss_fn = functools.partial(policy_loss, clip_eps=args.clip_eps,
                                entropy_coef=args.entropy_coef)
    entropy = "grad" if args.entropy_coef else "metric"
    for _ in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        results = run_schedule(model, logits_forward_step(loss_fn, vocab_size=vocab_size,
                                                          entropy=entropy),
                               items, forward_only=False, seq_length=args.seq_length)
        clip_grad_norm_(model, args.clip_grad, par)
        optimizer.step()
    scheduler.step()
    metrics = reduce_reports(results, ["policy loss", "clip fraction", "approx kl", "entropy"],
                             par)
    total = torch.tensor([rewards.sum().item(), rewards.numel()], dtype=torch.float64)
    if par.dp > 1:
        dist.all_reduce(total, group=par.dp_cp_group)
    metrics["reward"] = (total[0] / total[1]).item()
    metrics["margin"] = margin
    return metrics


def _margin(batches, firsts, old, rewards, par: Parallel) -> float:
    """Mean token log-prob of rewarded minus unrewarded responses (pi_old), over ranks."""
    sums = torch.zeros(4, dtype=torch.float64)
    for b, first, lp in zip(batches, firsts, old):
        full = gather_tokens(lp, b, par).double().cpu().reshape(-1)
        mask = b.loss_mask.reshape(-1).cpu() != 0
        good = _per_token(rewards, b, first).reshape(-1).cpu() > 0.5
        sums += torch.stack([full[mask & good].sum(), (mask & good).sum(),
                             full[mask & ~good].sum(), (mask & ~good).sum()]).double()
    if par.dp > 1:
        dist.all_reduce(sums, group=par.dp_cp_group)
    if sums[1] == 0 or sums[3] == 0:
        return float("nan")
    return (sums[0] / sums[1] - sums[2] / sums[3]).item()


def run(model, data: dict, args, par: Parallel, alignment: int, thd: bool) -> dict:
    """``args.steps`` GRPO steps; prints a per-step table and writes ``grpo.json`` / ``.png``."""
    from tqdm import tqdm

    tokenizer = data["tokenizer"]
    rows = list(data["train_rows"])
    random.Random(args.seed).shuffle(rows)
    optimizer, scheduler = make_optimizer(model, args)
    per_step = args.questions_per_step * par.dp
    history = []
    bar = tqdm(range(args.steps), desc="grpo", disable=not par.is_main, dynamic_ncols=True,
               mininterval=0.5)
    for step in bar:
        first = 0 if args.repeat_batch else step * per_step
        chosen = [rows[(first + k) % len(rows)] for k in range(per_step)][par.dp_rank::par.dp]
        rng = random.Random(args.seed * 1000003 + first + par.dp_rank)
        examples, rewards = rollouts(chosen, tokenizer, args.group_size, rng)
        start = time.perf_counter()
        metrics = grpo_step(model, optimizer, scheduler, examples, rewards, args, par,
                            alignment, thd, tokenizer.n_words)
        metrics.update(step=step + 1, seconds=time.perf_counter() - start)
        history.append(metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", kl=f"{metrics['approx kl']:.1e}",
                        margin=f"{metrics['margin']:.3f}")
    bar.close()
    result = {"mode": "grpo", "config": dict(vars(args)),
              "world": {"tp": par.tp, "cp": par.cp, "dp": par.dp, "device": par.device.type},
              "steps": history}
    if par.is_main:
        print(report.table(["step"] + list(METRICS),
                           [[h["step"]] + [f"{h[k]:.4g}" for k in METRICS] for h in history],
                           title="\nGRPO-style steps (stand-in rollouts)"), flush=True)
        json_path, png_path = report.report_paths(args.out, "grpo")
        report.write_outputs({json_path: report.json_writer(result),
                              png_path: (report.curves_figure(history, METRICS,
                                                              "GRPO-style steps"), True)})
        print(f"wrote {json_path} and {png_path}", flush=True)
    return result
