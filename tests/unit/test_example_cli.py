"""The GSM8K example's command line: ``--load`` supplies the model flags its checkpoint records,
and every mode says which settings it computes with (never a raw ``PluginSettings(...)``).
In-process, nothing is trained."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")
pytest.importorskip("mistral_common")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def cli():
    """``examples.gsm8k.cli``; the plugin's settings (and patch) are restored afterwards."""
    from megatron_vocabstats.megatron import settings

    module = sys.modules.get("megatron_vocabstats.patch")
    was_applied = module is not None and module.is_applied()
    before = dataclasses.asdict(settings.current())
    from examples.gsm8k import cli as module_cli

    yield module_cli
    if not was_applied:
        sys.modules["megatron_vocabstats.patch"].remove()
    settings.update(**before)


def _checkpoint(path, **sizes):
    from examples.gsm8k.model import CHECKPOINT_META, ModelShape

    shape = dict(num_layers=3, hidden_size=96, num_attention_heads=6, ffn_hidden_size=192,
                 vocab_size=131072, padded_vocab_size=131072, seq_length=512,
                 position_embedding="learned_absolute", tie_embeddings=True, tp=2)
    shape.update(sizes)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CHECKPOINT_META), "w") as f:
        json.dump(dataclasses.asdict(ModelShape(**shape)), f)
    for rank in range(shape["tp"]):
        open(os.path.join(path, f"model_tp_rank{rank:02d}.pt"), "wb").close()
    return shape


def test_load_supplies_the_model_flags(cli, tmp_path):
    from examples.gsm8k.model import check_checkpoint, model_shape

    ckpt = str(tmp_path / "ckpt")
    saved = _checkpoint(ckpt)
    io = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    args = cli.parse_args(["score", "--load", ckpt, *io])
    for name in cli.MODEL_DEFAULTS:
        assert getattr(args, name) == saved[name], name
    assert sorted(args.model_flags_from_load) == sorted(
        "--" + n.replace("_", "-") for n in cli.MODEL_DEFAULTS)
    check_checkpoint(ckpt, model_shape(args, saved["vocab_size"]))  # accepted as it is
    # A flag given wins (the checkpoint check then names the difference); no --load: defaults.
    args = cli.parse_args(["score", "--load", ckpt, "--num-layers", "5", *io])
    assert args.num_layers == 5 and "--num-layers" not in args.model_flags_from_load
    with pytest.raises(ValueError, match="num_layers: run 5, checkpoint 3"):
        check_checkpoint(ckpt, model_shape(args, saved["vocab_size"]))
    args = cli.parse_args(["score", *io])
    assert {n: getattr(args, n) for n in cli.MODEL_DEFAULTS} == cli.MODEL_DEFAULTS
    assert args.model_flags_from_load == []
    # A value of the wrong type in meta.json is not taken (the check names it later).
    bad = str(tmp_path / "bad")
    _checkpoint(bad, num_layers="three")
    assert cli.parse_args(["score", "--load", bad, *io]).num_layers == 4


@pytest.mark.parametrize("argv, needles", [
    (["sft", "--vocab-parallel-stats", "--lm-head-chunk-size", "128"],
     ["labels path (training, evaluation): plugin on: fused LM head (chunk 128 tokens)",
      "comparison: Megatron's loss, the plugin unfused and fused (chunk 128), fp32 and bf16"]),
    (["sft"], ["plugin off (the patched call sites run Megatron's own loss)", "(chunk 256)"]),
    (["grpo", "--vocab-parallel-stats"],
     ["policy_loss (clip 0.2, entropy coef 0.0, token mean)", "rollouts: stand-in answers",
      "rollout correction: none"]),
    (["grpo", "--rollouts", "sampled", "--rollout-correction", "tis"],
     ["sampled (temperature 1.0, top-p 0.9, model softmax, at most 24 new tokens)",
      "rollout correction: RolloutCorrection(mode='tis', level='token', threshold=2.0"]),
    (["score", "--input", "x.jsonl", "--output", "y.jsonl"],
     ["score_tokens on the logits (vocab_parallel_stats, entropy metric"]),
    (["distill", "--vocab-parallel-stats", "--tail-bucket"],
     ["distillation_loss (forward_kl, top-16, tail bucket, temperature 1.0)",
      "labels path (teacher training, evaluation): plugin on: unfused (chunk auto)"]),
])
def test_each_mode_says_its_settings(cli, argv, needles):
    line = cli.mode_settings(cli.parse_args(argv), torch.device("cpu"))
    assert line.startswith("settings: ") and "PluginSettings(" not in line, line
    for needle in needles:
        assert needle in line, (needle, line)
