"""Randomised property cases under tensor parallelism; run by tests/unit/test_properties_dist.py.

Hypothesis cannot run under torchrun (every rank would have to draw and shrink alike), so these
draw a fixed number of examples from a fixed seed, the same on every rank: shapes, a padded
vocabulary (whole shards of padding included), dtype, chunk size, ignored rows, -inf columns,
temperature, label smoothing and entropy mode. Values and this rank's gradient shard are compared
with the float64 reference on the full vocabulary within the bounds of ``_reference.py`` (with
``parts=tp``: the shards' statistics merged across ranks).
"""

from __future__ import annotations

import os
import random
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main  # noqa: E402

from _reference import (  # noqa: E402
    assert_within,
    picked_grad_bound,
    reference_stats,
    smoothed_logprob_bound,
    stats_bounds,
    stats_grad_bound,
    temperature_dz,
)
from megatron_vocabstats import vocab_parallel_stats, vocab_parallel_topk_logprobs  # noqa: E402

CASES = Cases()
EXAMPLES = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _example(seed: int, tp: int):
    """One drawn example, equal on every rank: ``(full logits [T, W*tp], vocab, options, gen)``."""
    rng = random.Random(seed)
    tokens = rng.choice([0, 1, 5, 12])
    width = rng.randint(1, 40)
    vocab = rng.choice([width * tp, rng.randint(1, width * tp)])
    dtype = rng.choice(DTYPES)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width * tp, generator=gen, dtype=torch.float64) * rng.choice(
        [0.1, 3.0, 30.0]) + rng.choice([0.0, 200.0])
    masked = torch.rand(tokens, width * tp, generator=gen) < rng.choice([0.0, 0.5])
    masked.scatter_(1, torch.randint(0, vocab, (tokens, 1), generator=gen), False)
    x = torch.where(masked, float("-inf"), x)
    # Finite padding: a padding-only shard whose first row is all -inf, next to a shard whose
    # first row holds a -inf, is taken for replicated full logits by the op's check (same sum).
    x[:, vocab:] = 0.5
    options = dict(
        temperature=rng.choice([1.0, rng.uniform(0.1, 5.0)]),
        chunk_size=rng.choice([None, 1, 3, tokens + 2]),
    )
    return x.to(dtype), vocab, options, gen, rng


def _shard(full, group):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    width = full.shape[-1] // tp
    return full[:, rank * width:(rank + 1) * width], rank * width


@CASES.register
def stats_match_float64_within_derived_bounds(group):
    tp = dist.get_world_size(group)
    for seed in range(EXAMPLES):
        full, vocab, options, gen, rng = _example(1000 + seed, tp)
        tokens, width = full.shape[0], full.shape[1] // tp
        eps = rng.choice([0.0, 0.1])
        mode = rng.choice(["off", "metric", "grad"])
        target = torch.randint(0, vocab, (tokens,), generator=gen)
        valid = torch.rand(tokens, generator=gen) < 0.8
        target = torch.where(valid, target, -100)
        shard, start = _shard(full, group)
        leaf = shard.clone().requires_grad_()
        out = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=vocab, entropy=mode,
                                   label_smoothing=eps, **options)
        tau = options["temperature"]
        ref_leaf = full.double().requires_grad_()
        ref = reference_stats(ref_leaf, target, vocab_size=vocab, temperature=tau,
                              label_smoothing=eps)
        z = full.double()[:, :vocab] / tau
        b = stats_bounds(z, dz=temperature_dz(z, tau), width=width, parts=tp)
        what = f"example {seed} ({full.dtype}, V={vocab}, tp={tp}, {options}, eps={eps})"
        assert_within(out.logsumexp, ref[2], b.logsumexp, f"logsumexp, {what}")
        safe = torch.where(valid, target, 0)
        assert_within(out.logprobs[valid], ref[0][valid],
                      smoothed_logprob_bound(b, safe, eps)[valid], f"logprobs, {what}")
        if mode != "off":
            assert_within(out.entropy[valid], ref[1][valid], b.entropy[valid],
                          f"entropy, {what}")
        w_lp, w_h = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
        loss, ref_loss = (out.logprobs * w_lp).sum(), (ref[0] * w_lp.double()).sum()
        if mode == "grad":
            loss = loss + (out.entropy * w_h).sum()
            ref_loss = ref_loss + (ref[1] * w_h.double()).sum()
        loss.backward()
        ref_loss.backward()
        keep = valid.double() / tau
        bound = stats_grad_bound(b, ref_leaf.grad[:, :vocab], c_lp=w_lp.double() * keep,
                                 c_h=w_h.double() * keep if mode == "grad" else None,
                                 target=safe, eps=eps, scaled=tau != 1.0, dtype=full.dtype)
        cols = slice(start, min(start + width, vocab))
        local = cols.stop - cols.start if cols.stop > cols.start else 0
        assert_within(leaf.grad[:, :local], ref_leaf.grad[:, cols], bound[:, cols],
                      f"gradient, {what}")
        assert bool((leaf.grad[:, local:] == 0).all()), f"gradient at padding, {what}"


@CASES.register
def topk_logprobs_match_float64_within_derived_bounds(group):
    tp = dist.get_world_size(group)
    for seed in range(EXAMPLES):
        full, vocab, options, gen, rng = _example(2000 + seed, tp)
        tokens, width = full.shape[0], full.shape[1] // tp
        k = rng.randint(1, 4)
        indices = torch.randint(0, vocab, (tokens, k), generator=gen)
        mask = torch.rand(tokens, generator=gen) < 0.8
        shard, start = _shard(full, group)
        leaf = shard.clone().requires_grad_()
        lp = vocab_parallel_topk_logprobs(leaf, indices, tp_group=group, mask=mask,
                                          vocab_size=vocab, **options)
        g = torch.randn(tokens, k, generator=gen)
        (lp * g).sum().backward()
        tau = options["temperature"]
        ref_leaf = full.double().requires_grad_()
        ref = torch.log_softmax(ref_leaf[:, :vocab] / tau, -1).gather(-1, indices)
        ref = torch.where(mask.unsqueeze(1), ref, 0.0)
        (ref * g.double()).sum().backward()
        z = full.double()[:, :vocab] / tau
        b = stats_bounds(z, dz=temperature_dz(z, tau), width=width, parts=tp)
        what = f"example {seed} ({full.dtype}, V={vocab}, tp={tp}, {options}, k={k})"
        assert_within(lp[mask], ref[mask], b.logp.gather(-1, indices)[mask],
                      f"log-probs, {what}")
        g_rows = torch.where(mask.unsqueeze(1), g.double(), 0.0) / tau
        bound = picked_grad_bound(b, ref_leaf.grad[:, :vocab], g=g_rows, indices=indices,
                                  scaled=tau != 1.0, dtype=full.dtype)
        cols = slice(start, min(start + width, vocab))
        local = cols.stop - cols.start if cols.stop > cols.start else 0
        assert_within(leaf.grad[:, :local], ref_leaf.grad[:, cols], bound[:, cols],
                      f"gradient, {what}")


if __name__ == "__main__":
    main(CASES)
