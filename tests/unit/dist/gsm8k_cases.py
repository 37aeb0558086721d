"""The GSM8K example (examples/gsm8k) at a tiny size on 2 gloo ranks (tp = 2), mode by mode.

Run by tests/unit/test_example_gsm8k.py. Each mode goes through the example's own command line
(``cli.main``) and its outputs are checked for content; the statistics are checked against a
float64 reference computed here from the full (all-gathered) logits of a model built with the
same flags and seed, with the response positions found by a plain loop over the examples.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # repo root
from _harness import Cases, main  # noqa: E402

CASES = Cases()
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "384", "--seed", "11"]
LOG_V = math.log(131072)
RTOL = 1e-5


def shared_dir() -> str:
    """A fresh temporary directory created on rank 0, its path known to every rank."""
    path = [tempfile.mkdtemp(prefix="gsm8k_case_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def run_cli(argv) -> int:
    from examples.gsm8k import cli

    code = cli.main(argv)
    codes = [None] * dist.get_world_size()
    dist.all_gather_object(codes, code)
    assert len(set(codes)) == 1, f"ranks returned different exit codes {codes}"
    return code


def read_json(path):
    with open(path) as f:
        return json.load(f)


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """float64 ``[L, V]`` logits of one unpacked sequence (plain causal mask, positions 0..L-1),
    all tp shards gathered."""
    length = len(tokens)
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        shard = model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(length)[None],
                      attention_mask=causal[None, None])[0].contiguous()  # [L, V/tp]
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard)
    return torch.cat(parts, dim=-1).double()


def reference_response_stats(model, examples):
    """Per example, alone and unpacked: float64 (logprobs, entropy) of its response tokens."""
    out = []
    for ex in examples:
        tokens = ex.prompt + ex.response
        logp = torch.log_softmax(full_logits(model, tokens), dim=-1)
        positions = torch.arange(len(ex.prompt) - 1, len(tokens) - 1)
        target = torch.tensor(ex.response)
        out.append((logp[positions, target], -(logp.exp() * logp).sum(-1)[positions]))
    return out


def build(argv):
    """The example's model and inputs for ``argv``, as its command line builds them."""
    from examples.gsm8k import cli

    args = cli.parse_args(argv)
    return args, cli.setup(args)


@CASES.register
def sft_loss_falls_and_plugin_matches_megatron(group):
    from megatron.core import tensor_parallel

    import megatron_vocabstats.ops.stats.from_hidden as fused
    from megatron_vocabstats.megatron import model as patched

    out = shared_dir()
    calls = {"fused": 0, "unfused": 0, "megatron": 0}
    originals = (fused.linear_vocab_parallel_stats, patched.vocab_parallel_stats,
                 tensor_parallel.vocab_parallel_cross_entropy)

    def spy(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    fused.linear_vocab_parallel_stats = spy("fused", originals[0])
    patched.vocab_parallel_stats = spy("unfused", originals[1])
    tensor_parallel.vocab_parallel_cross_entropy = spy("megatron", originals[2])
    try:
        code = run_cli(["sft", *TINY, "--vocab-parallel-stats", "--lm-head-chunk-size", "64",
                        "--steps", "4", "--repeat-batch", "--train-examples", "40",
                        "--test-examples", "6", "--out", out])
    finally:
        (fused.linear_vocab_parallel_stats, patched.vocab_parallel_stats,
         tensor_parallel.vocab_parallel_cross_entropy) = originals
    assert code == 0
    assert min(calls.values()) > 0, f"a loss path was not reached: {calls}"
    if dist.get_rank() != 0:
        return
    result = read_json(os.path.join(out, "sft.json"))
    assert os.path.getsize(os.path.join(out, "sft.png")) > 0
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    losses = [s["loss"] for s in result["train"]]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert result["test_nll"]["after"] < result["test_nll"]["before"]
    cmp = result["comparison"]
    names = [leg["name"] for leg in cmp["legs"]]
    assert names == ["megatron", "plugin", "plugin fused (64)"], names
    native = cmp["legs"][0]["mean_loss"]
    for leg in cmp["legs"]:
        assert leg["max_abs_loss_diff"] <= RTOL * 12, leg
        assert abs(leg["mean_loss"] - native) <= RTOL * native, leg
        assert leg["max_rel_grad_diff"] <= 1e-4, leg
        assert len(leg["peak_bytes_per_rank"]) == 2 and min(leg["peak_bytes_per_rank"]) > 0
        assert len(leg["peak_bytes_per_rank_bf16"]) == 2
    assert cmp["ok"] and cmp["logits_dtype"] == "float32"
    # With bf16 logits (what users train in) Megatron's loss first makes an fp32 copy; ours never
    # does: the plugin's region peak is below Megatron's (with fp32 logits it is not on CPU).
    bf16 = {leg["name"]: max(leg["peak_bytes_per_rank_bf16"]) for leg in cmp["legs"]}
    assert bf16["plugin"] < bf16["megatron"], bf16


@CASES.register
def test_nll_matches_float64_reference(group):
    from examples.gsm8k.data import PackedRows
    from examples.gsm8k.steps import evaluate_nll

    args, run = build(["sft", *TINY, "--vocab-parallel-stats", "--lm-head-chunk-size", "32",
                       "--train-examples", "4", "--test-examples", "5"])
    examples = run.inputs["test"]
    rows = PackedRows(examples, seq_length=args.seq_length, alignment=run.alignment,
                      device=run.par.device, thd=run.thd)
    got = evaluate_nll(run.model, [rows[i] for i in range(len(rows))], run.par, args.seq_length)
    assert max(len(g) for g in rows.groups) > 1, "the check needs rows of several examples"
    reference = reference_response_stats(run.model, examples)
    want = -sum(lp.sum().item() for lp, _ in reference) / sum(lp.numel() for lp, _ in reference)
    assert abs(got - want) <= RTOL * want, (got, want)


@CASES.register
def bf16_region_peak_counts_only_what_the_region_allocates(group):
    """The demo's bf16 rows (a bf16 copy of the fp32 model's LM-head weight) measure what a bf16
    model's own weight gives: the model's fp32 weight, which every path's output-layer call shows
    to MemTracker, is no part of the peak (it was, by one fp32 [V/tp, H], in every leg)."""
    from examples.gsm8k.data import PackedRows
    from examples.gsm8k.steps import (
        PURE_NLL,
        comparison_legs,
        plugin_settings,
        region_peak_bytes,
        shard_batch,
    )

    args, run = build(["sft", *TINY, "--train-examples", "4", "--test-examples", "2"])
    rows = PackedRows(run.inputs["test"], seq_length=args.seq_length, alignment=run.alignment,
                      device=run.par.device, thd=run.thd)
    batch = shard_batch(rows[0], run.par)
    hidden = torch.randn(batch.labels.shape[1], 1, args.hidden_size)
    legs = comparison_legs(32)
    copy = []
    for leg in legs:
        with plugin_settings(**PURE_NLL, **leg.options):
            copy.append(region_peak_bytes(run.model, hidden, batch, run.par, dtype=torch.bfloat16))
    run.model.output_layer.to(torch.bfloat16)  # now the model's own weight is the bf16 one
    for leg, got in zip(legs, copy):
        with plugin_settings(**PURE_NLL, **leg.options):
            want = region_peak_bytes(run.model, hidden.to(torch.bfloat16), batch, run.par)
        assert got == want, (leg.name, got, want)


@CASES.register
def grpo_prefers_rewarded_answers_on_a_repeated_batch(group):
    out = shared_dir()
    code = run_cli(["grpo", *TINY, "--steps", "3", "--repeat-batch", "--lr", "3e-3",
                    "--questions-per-step", "2", "--group-size", "4", "--train-examples", "8",
                    "--out", out])
    assert code == 0
    if dist.get_rank() != 0:
        return
    steps = read_json(os.path.join(out, "grpo.json"))["steps"]
    assert len(steps) == 3
    for s in steps:
        assert s["reward"] == 0.5, s  # two of the four stand-in answers keep the final number
        assert 0.0 <= s["entropy"] <= LOG_V + 1e-4, s
        assert 0.0 <= s["clip fraction"] <= 1.0 and s["approx kl"] >= 0.0, s
    margins = [s["margin"] for s in steps]
    assert all(b > a for a, b in zip(margins, margins[1:])), margins


@CASES.register
def grpo_sampled_rollouts_report_the_mismatch_before_and_after_replay(group):
    out = shared_dir()
    code = run_cli(["grpo", *TINY, "--steps", "2", "--questions-per-step", "1",
                    "--group-size", "2", "--train-examples", "4", "--rollouts", "sampled",
                    "--max-new-tokens", "4", "--sample-top-p", "0.9",
                    "--sample-dtype", "bfloat16", "--rollout-correction", "tis", "--out", out])
    assert code == 0
    if dist.get_rank() != 0:
        return
    result = read_json(os.path.join(out, "grpo.json"))
    assert result["config"]["rollouts"] == "sampled"
    steps = result["steps"]
    assert len(steps) == 2
    assert os.path.getsize(os.path.join(out, "grpo.png")) > 0
    for s in steps:
        for key in ("before |dlogprob|", "before k3 kl", "after |dlogprob|", "after k3 kl",
                    "outside support", "rollout weight", "rollout truncated fraction"):
            assert key in s and math.isfinite(s[key]), (key, s)
        assert 1 <= s["answer tokens"] <= 4, s
        assert s["before k3 kl"] >= 0.0 and s["after k3 kl"] >= 0.0, s
        # Replaying the sampler's top-p mask removes the log of the kept mass (~0.1 nats for a
        # near-uniform model); what is left is the bf16 sampler against the fp32 trainer.
        assert s["after |dlogprob|"] < s["before |dlogprob|"], s
        assert s["before |dlogprob|"] > 0.05, s
        assert 0.0 <= s["outside support"] <= 1.0 and s["reward"] in (0.0, 0.5, 1.0), s


@CASES.register
def scoring_matches_float64_reference(group):
    out = shared_dir()
    rows = [{"prompt": "Question: What is 2+3?\nAnswer: ", "response": "2+3 = 5\n#### 5"},
            {"prompt": "Hello", "response": " world"},
            {"prompt": "Question: Tom has 3 apples.\nAnswer: ", "response": "#### 3"}]
    source = os.path.join(out, "in.jsonl")
    if dist.get_rank() == 0:
        with open(source, "w") as f:
            f.write(json.dumps(rows[0]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[1:]))
    dist.barrier()
    target = os.path.join(out, "scores.jsonl")
    argv = ["score", *TINY, "--input", source, "--output", target]
    assert run_cli(argv) == 0
    args, run = build(argv)
    reference = reference_response_stats(run.model, run.inputs["examples"])
    with open(target) as f:
        scored = [json.loads(line) for line in f]
    assert len(scored) == len(rows)
    for row, got, (lp, h) in zip(rows, scored, reference):
        assert (got["prompt"], got["response"]) == (row["prompt"], row["response"])
        assert len(got["tokens"]) == len(got["logprobs"]) == len(got["entropy"]) == lp.numel()
        assert all(v <= 0.0 for v in got["logprobs"])
        assert all(0.0 <= v <= LOG_V + 1e-4 for v in got["entropy"])
        assert torch.allclose(torch.tensor(got["logprobs"], dtype=torch.float64), lp,
                              rtol=RTOL, atol=RTOL)
        assert torch.allclose(torch.tensor(got["entropy"], dtype=torch.float64), h,
                              rtol=RTOL, atol=RTOL)


@CASES.register
def bad_layout_fails_on_every_rank_before_output(group):
    out = shared_dir()
    target = os.path.join(out, "run")
    heads = run_cli(["sft", *TINY, "--num-attention-heads", "3", "--hidden-size", "48",
                     "--out", target])
    world = run_cli(["sft", *TINY, "--tp", "4", "--out", target])
    assert heads == 2 and world == 2
    assert not os.path.exists(target)


if __name__ == "__main__":
    main(CASES)
