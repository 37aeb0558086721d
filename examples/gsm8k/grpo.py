"""GRPO-style mode: groups of rollouts, group-normalised advantages, clipped updates.

Per step, for each of ``--questions-per-step`` questions (per data-parallel rank), a group of
``--group-size`` answers gets reward 1 when its final ``#### number`` matches the
reference (Shao et al. 2024, "DeepSeekMath", GRPO: advantage ``(r - mean_group) / (std_group +
eps)``). The answers are either

* ``--rollouts standin`` (default): :func:`.data.corrupted_answers`, the reference and corrupted
  variants standing in for sampled rollouts; old log-probs come from one forward-only pass, then
  ``--ppo-epochs`` updates minimise :func:`megatron_vocabstats.policy_loss` (PPO clipped
  surrogate, token mean) on those rollouts; or
* ``--rollouts sampled``: sampled autoregressively from the current policy by :func:`generate`,
  this example's own small "inference engine" (one full forward per new token, temperature
  ``--sample-temperature`` and top-p ``--sample-top-p``, at most ``--max-new-tokens``, stopping
  at EOS), which records the log-prob of every sampled token under ITS truncated distribution,
  computed in the sampler's dtype (``--sample-dtype``, default the model's) as an engine would.
  The trainer then recomputes the old log-probs twice in fp32: under the full distribution
  (``score_tokens``: what a trainer unaware of the sampler compares) and under the replayed
  sampler mask (:func:`megatron_vocabstats.vocab_parallel_sampling_logprobs` with the same
  temperature and top-p). Training uses the replayed ones, the new log-probs under the same
  mask, and the plugin's ``--rollout-correction`` (``tis``, ``mis``, ``icepop``) on the
  sampler's log-probs. Targets outside the replayed kept set (the fp32 set differs from the
  sampler's at its boundary) are left out of the loss. Reported per step, from
  :func:`megatron_vocabstats.mismatch_diagnostics`: mean |dlogprob| and k3 KL of the sampler's
  log-probs against the full-distribution ones ("before replay") and against the replayed ones
  ("after replay"), and the fraction of sampled tokens outside the replayed set.

Reported per step: mean reward, entropy, clip fraction and KL (``approx kl``: Schulman's k3
estimate of KL(pi_old || pi) over response tokens, from the last update), the policy loss, and
the margin: mean per-token log-prob of rewarded minus unrewarded responses under pi_old (it rises
as the policy learns to prefer correct answers).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time

import torch
import torch.distributed as dist

from megatron_vocabstats import (
    StatsOptions,
    mismatch_diagnostics,
    policy_loss,
    score_tokens,
    token_loss,
    vocab_parallel_sampling_logprobs,
    vocab_parallel_stats,
)
from megatron_vocabstats.megatron import settings

from . import report
from .data import Example, PackedRows, corrupted_answers, encode_gsm8k, reward, sequence_ids
from .model import Parallel, clip_grad_norm_, make_optimizer, run_schedule
from .steps import (
    gather_tokens,
    logits_forward_step,
    reduce_reports,
    shard_batch,
    shard_tokens,
    step_batch,
)

EPS = 1e-6
METRICS = ("reward", "entropy", "clip fraction", "approx kl", "policy loss", "margin")
# Sampled rollouts only: the sampler / trainer mismatch before and after replaying the sampler.
MISMATCH = ("before |dlogprob|", "before k3 kl", "after |dlogprob|", "after k3 kl",
            "outside support")
# Panels of the PNG that draw two metrics together: before and after replay.
PAIRS = {"before |dlogprob|": "after |dlogprob|", "before k3 kl": "after k3 kl"}
SAMPLE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float32": torch.float32}


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


# --------------------------------------------------------------------------- sampled rollouts


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step of a plain engine, in ``logits``' dtype: temperature, then top-p (keep
    the tokens whose more-likely mass is below ``top_p``, the most likely always kept), then
    softmax over the kept set.

    ``logits``: ``[G, V]`` over the real vocabulary. Returns ``(tokens [G] int64, logq [G] fp32)``
    with ``logq`` the log-prob of each drawn token under that truncated distribution, computed
    in the input dtype (converted to fp32 only for storage).
    """
    z = logits / temperature
    if top_p < 1.0:
        probs = torch.softmax(z, dim=-1)
        ordered, order = probs.sort(dim=-1, descending=True)
        above = ordered.cumsum(dim=-1) - ordered  # mass of the strictly more likely tokens
        keep = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, above < top_p)
        z = z.masked_fill(~keep, float("-inf"))
    logq = torch.log_softmax(z, dim=-1)
    tokens = torch.multinomial(logq.float().exp(), 1, generator=generator)
    return tokens.squeeze(-1), logq.gather(-1, tokens).squeeze(-1).float()


def _full_last_logits(model, tokens: torch.Tensor, par: Parallel, vocab_size: int, bf16: bool
                      ) -> torch.Tensor:
    """Logits ``[G, V]`` of the last position of each row of ``tokens`` ``[G, L]`` (one plain
    causal forward; the tp shards all-gathered; padding columns dropped)."""
    length = tokens.shape[1]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=par.device),
                        diagonal=1)
    positions = torch.arange(length, device=par.device)[None].expand(tokens.shape[0], -1)
    with torch.autocast(par.device.type, dtype=torch.bfloat16, enabled=bf16):
        shard = model(input_ids=tokens, position_ids=positions,
                      attention_mask=causal[None, None])[:, -1].contiguous()  # [G, V/tp]
    if par.tp > 1:
        parts = [torch.empty_like(shard) for _ in range(par.tp)]
        dist.all_gather(parts, shard, group=par.tp_group)
        shard = torch.cat(parts, dim=-1)
    return shard[:, :vocab_size]


def generate(model, prompt: list[int], group_size: int, args, par: Parallel, vocab_size: int,
             eos_id: int, generator: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
    """``group_size`` answers to ``prompt`` sampled from ``model`` (eval mode, no grad).

    Each answer ends at its first EOS (kept) or after ``--max-new-tokens`` tokens. Returns
    ``(responses, logprobs)``: token ids and the sampler's fp32 log q of each. The tensor-
    parallel ranks draw the same tokens (same logits and generator; tp rank 0's are broadcast).
    """
    dtype = SAMPLE_DTYPES.get(args.sample_dtype)
    tokens = torch.tensor([prompt] * group_size, dtype=torch.int64, device=par.device)
    done = torch.zeros(group_size, dtype=torch.bool)
    drawn, logqs = [], []
    with torch.no_grad():
        for _ in range(args.max_new_tokens):
            logits = _full_last_logits(model, tokens, par, vocab_size, args.bf16)
            tok, logq = sample_next(logits if dtype is None else logits.to(dtype),
                                    temperature=args.sample_temperature,
                                    top_p=args.sample_top_p, generator=generator)
            picked = torch.stack([tok.double(), logq.double()]).to(par.device)
            if par.tp > 1:
                dist.broadcast(picked, src=dist.get_global_rank(par.tp_group, 0),
                               group=par.tp_group)
            tok, logq = picked[0].long().cpu(), picked[1].float().cpu()
            drawn.append(tok)
            logqs.append(logq)
            done |= tok == eos_id
            if done.all():
                break
            tokens = torch.cat([tokens, tok.to(par.device)[:, None]], dim=1)
    drawn, logqs = torch.stack(drawn, dim=1).tolist(), torch.stack(logqs, dim=1).tolist()
    responses, logprobs = [], []
    for ids, lps in zip(drawn, logqs):
        end = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
        responses.append(ids[:end])
        logprobs.append(lps[:end])
    return responses, logprobs


def sampled_rollouts(model, rows: list[dict], tokenizer, args, par: Parallel, seed: int):
    """Rollouts sampled from ``model``: ``(examples, rewards, rollout_logprobs)``, the last a
    list of per-response fp32 log q lists (the sampler's)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    examples, rewards, logprobs = [], [], []
    for row in rows:
        prompt = encode_gsm8k(tokenizer, row["question"], row["answer"]).prompt
        responses, lps = generate(model, prompt, args.group_size, args, par, tokenizer.n_words,
                                  tokenizer.eos_id, generator)
        examples += [Example(prompt, r) for r in responses]
        logprobs += lps
        texts = [tokenizer.decode([t for t in r if t != tokenizer.eos_id]) for r in responses]
        rewards.append([reward(t, row["answer"]) for t in texts])
    model.train()
    return examples, torch.tensor(rewards, dtype=torch.float32), logprobs


def _rollout_per_token(rows: PackedRows, index: int, batch, logprobs: list[list[float]]
                       ) -> torch.Tensor:
    """``[1, T]`` fp32: the sampler's log-prob of each response token at its label position in
    packed row ``index`` (0 elsewhere)."""
    out = torch.zeros(batch.num_tokens, dtype=torch.float32)
    starts = batch.packed.cu_seqlens_padded.tolist()
    for k, n in enumerate(rows.groups[index]):
        ex = rows.examples[n]
        first = starts[k] + len(ex.prompt) - 1
        out[first:first + len(ex.response)] = torch.tensor(logprobs[n], dtype=torch.float32)
    return out.to(batch.labels.device).unsqueeze(0)


def _sampler_options(args) -> dict:
    return {"temperature": args.sample_temperature,
            "top_p": None if args.sample_top_p == 1.0 else args.sample_top_p}


def _sampling_logprobs(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, tp_group,
                       vocab_size: int, sampler: dict):
    """``vocab_parallel_sampling_logprobs`` at the counted positions only (the op's threshold
    search costs per row, so the prompt and padding rows are left out), scattered back into
    ``[1, T]``: ``(logprobs, outside)``, 0 / False at the other positions. Differentiable."""
    width = logits.shape[-1]
    where = mask.reshape(-1).nonzero().squeeze(-1)
    picked = vocab_parallel_sampling_logprobs(
        logits.reshape(-1, width).index_select(0, where), labels.reshape(-1)[where],
        tp_group=tp_group, vocab_size=vocab_size, **sampler)
    flat = torch.zeros(mask.numel(), dtype=picked.logprobs.dtype, device=logits.device)
    logprobs = flat.index_put((where,), picked.logprobs).reshape(mask.shape)
    outside = torch.zeros(mask.numel(), dtype=torch.bool, device=logits.device)
    outside = outside.index_put((where,), picked.outside).reshape(mask.shape)
    return logprobs, outside


def _replay_forward_step(vocab_size: int, tp_group, sampler: dict):
    """Forward-only step for sampled rollouts: per microbatch the full-distribution log-probs
    and entropy (``score_tokens``) and the replayed sampler's log-probs and outside flags."""
    stats = StatsOptions(vocab_size=vocab_size, entropy="metric")

    def forward_step(data_iterator, model, *_, **__):
        batch = next(data_iterator)
        output = model(**batch.model_inputs)

        def loss(logits):
            total, count, scores = token_loss(logits, batch.labels, batch.loss_mask,
                                              loss_fn=score_tokens, tp_group=tp_group,
                                              options=stats)
            replayed, outside = _sampling_logprobs(logits, batch.labels, batch.loss_mask != 0,
                                                   tp_group, vocab_size, sampler)
            return total, count, dict(scores, replayed=replayed.detach(), outside=outside)

        return output, loss

    return forward_step


def _sampled_policy_step(vocab_size: int, tp_group, sampler: dict, args, correction):
    """Training step for sampled rollouts: new log-probs under the replayed sampler's mask
    (differentiable, the kept set held constant), entropy of the full distribution, and
    :func:`policy_loss` with the rollout correction on the sampler's log-probs."""
    entropy = "grad" if args.entropy_coef else "metric"

    def forward_step(data_iterator, model, *_, **__):
        batch = next(data_iterator)
        output = model(**batch.model_inputs)
        inputs = batch.loss_inputs

        def loss(logits):
            lp, _ = _sampling_logprobs(logits, batch.labels, batch.loss_mask != 0, tp_group,
                                       vocab_size, sampler)
            ent = vocab_parallel_stats(logits, None, tp_group=tp_group, vocab_size=vocab_size,
                                       entropy=entropy).entropy
            return policy_loss(lp, inputs["old_logprobs"], inputs["advantages"],
                               batch.loss_mask, entropy=ent, clip_eps=args.clip_eps,
                               entropy_coef=args.entropy_coef,
                               rollout_logprobs=inputs["rollout_logprobs"],
                               rollout_correction=correction,
                               rollout_outside=inputs["outside"])

        return output, loss

    return forward_step


def _per_token(values: torch.Tensor, batch, index: int) -> torch.Tensor:
    """``[1, T]`` tensor holding ``values[first + seq(p)]`` at each packed position p."""
    seq = sequence_ids(batch.packed.cu_seqlens_padded, batch.num_tokens)
    return values[index + seq.clamp(max=batch.num_sequences - 1).cpu()].to(
        batch.labels.device).unsqueeze(0)


def grpo_step(model, optimizer, scheduler, examples, rewards, args, par: Parallel,
              alignment: int, thd: bool, vocab_size: int, rollout_logprobs=None) -> dict:
    """One GRPO step on this rank's rollouts; returns the step's metrics (all ranks reduced).

    With ``rollout_logprobs`` (sampled rollouts: the sampler's log-probs, one list per example)
    the old log-probs are replayed under the sampler's mask and the mismatch is reported
    (:func:`_sampled_step`)."""
    advantages = group_advantages(rewards).reshape(-1)
    rows = PackedRows(examples, seq_length=args.seq_length, alignment=alignment,
                      device=par.device, thd=thd)
    batches = [rows[i] for i in range(len(rows))]
    firsts = [group[0] for group in rows.groups]
    if rollout_logprobs is not None:
        return _sampled_step(model, optimizer, scheduler, rows, batches, firsts, advantages,
                             rewards, rollout_logprobs, args, par, vocab_size)
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
    return _finish(results, rewards, margin, par)


def _finish(results, rewards, margin, par: Parallel, extra: dict | None = None) -> dict:
    metrics = reduce_reports(results, ["policy loss", "clip fraction", "approx kl", "entropy"],
                             par)
    total = torch.tensor([rewards.sum().item(), rewards.numel()], dtype=torch.float64)
    if par.dp > 1:
        dist.all_reduce(total, group=par.dp_cp_group)
    metrics["reward"] = (total[0] / total[1]).item()
    metrics["margin"] = margin
    metrics.update(extra or {})
    return metrics


def _sampled_step(model, optimizer, scheduler, rows, batches, firsts, advantages, rewards,
                  rollout_logprobs, args, par: Parallel, vocab_size: int) -> dict:
    """:func:`grpo_step` for sampled rollouts (see the module docstring)."""
    sampler = _sampler_options(args)
    model.eval()
    with torch.no_grad():
        scored = run_schedule(model, _replay_forward_step(vocab_size, par.tp_group, sampler),
                              [step_batch(shard_batch(b, par)) for b in batches],
                              forward_only=True, seq_length=args.seq_length)
    model.train()
    full = [s["logprobs"] for s in scored]
    margin = _margin(batches, firsts, full, rewards.reshape(-1), par)
    items, diagnostics = [], []
    for i, (b, first, s) in enumerate(zip(batches, firsts, scored)):
        local = shard_batch(b, par)
        rollout = shard_tokens(_rollout_per_token(rows, i, b, rollout_logprobs), b, par)
        mask = local.loss_mask != 0
        before = mismatch_diagnostics(s["logprobs"], rollout, mask)
        after = mismatch_diagnostics(s["replayed"], rollout, mask, outside=s["outside"])
        diagnostics.append({"before |dlogprob|": before["rollout |dlogprob|"],
                            "before k3 kl": before["rollout k3 kl"],
                            "after |dlogprob|": after["rollout |dlogprob|"],
                            "after k3 kl": after["rollout k3 kl"],
                            "outside support": after["rollout outside support"]})
        # Targets outside the replayed set (log q = -inf) leave the loss.
        local = dataclasses.replace(local, loss_mask=local.loss_mask * (~s["outside"]).float())
        adv = shard_tokens(_per_token(advantages, b, first), b, par)
        items.append(step_batch(local, {"old_logprobs": s["replayed"], "advantages": adv,
                                        "rollout_logprobs": rollout, "outside": s["outside"]}))
    correction = settings.current().rollout_correction()
    step = _sampled_policy_step(vocab_size, par.tp_group, sampler, args, correction)
    for _ in range(args.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        results = run_schedule(model, step, items, forward_only=False,
                               seq_length=args.seq_length)
        clip_grad_norm_(model, args.clip_grad, par)
        optimizer.step()
    scheduler.step()
    extra = reduce_reports(diagnostics, MISMATCH, par)
    keys = [k for k in ("rollout weight", "rollout truncated fraction",
                        "rollout masked fraction") if k in results[0]]
    extra.update(reduce_reports(results, keys, par))
    return _finish(results, rewards, margin, par, extra)


def _mean_answer_tokens(examples, par: Parallel) -> float:
    """Mean sampled answer length (tokens, EOS included) over the step's answers and ranks."""
    total = torch.tensor([sum(len(e.response) for e in examples), len(examples)],
                         dtype=torch.float64)
    if par.dp > 1:
        dist.all_reduce(total, group=par.dp_cp_group)
    return (total[0] / total[1]).item()


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
    sampled = args.rollouts == "sampled"
    columns = METRICS + (MISMATCH + ("answer tokens",) if sampled else ())
    history = []
    bar = tqdm(range(args.steps), desc="grpo", disable=not par.is_main, dynamic_ncols=True,
               mininterval=0.5)
    for step in bar:
        first = 0 if args.repeat_batch else step * per_step
        chosen = [rows[(first + k) % len(rows)] for k in range(per_step)][par.dp_rank::par.dp]
        seed = args.seed * 1000003 + first + par.dp_rank
        start = time.perf_counter()
        rollout_logprobs = None
        if sampled:
            examples, rewards, rollout_logprobs = sampled_rollouts(
                model, chosen, tokenizer, args, par, seed * 7919 + step)
        else:
            examples, rewards = rollouts(chosen, tokenizer, args.group_size, random.Random(seed))
        sampling = time.perf_counter() - start
        metrics = grpo_step(model, optimizer, scheduler, examples, rewards, args, par,
                            alignment, thd, tokenizer.n_words, rollout_logprobs)
        metrics.update(step=step + 1, seconds=time.perf_counter() - start)
        if sampled:
            metrics.update(sample_seconds=sampling,
                           **{"answer tokens": _mean_answer_tokens(examples, par)})
        history.append(metrics)
        bar.set_postfix(reward=f"{metrics['reward']:.2f}", kl=f"{metrics['approx kl']:.1e}",
                        margin=f"{metrics['margin']:.3f}")
    bar.close()
    result = {"mode": "grpo", "config": dict(vars(args)),
              "world": {"tp": par.tp, "cp": par.cp, "dp": par.dp, "device": par.device.type},
              "steps": history}
    if par.is_main:
        kind = "sampled" if sampled else "stand-in"
        print(report.table(["step"] + list(columns),
                           [[h["step"]] + [f"{h[k]:.4g}" for k in columns] for h in history],
                           title=f"\nGRPO-style steps ({kind} rollouts)"), flush=True)
        json_path, png_path = report.report_paths(args.out, "grpo")
        report.write_outputs({json_path: report.json_writer(result),
                              png_path: (report.curves_figure(history, columns,
                                                              f"GRPO-style steps ({kind} "
                                                              "rollouts)", pairs=PAIRS), True)})
        print(f"wrote {json_path} and {png_path}", flush=True)
    return result
