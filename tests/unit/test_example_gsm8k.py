"""The GSM8K example (examples/gsm8k): data handling, bad input, and every mode under torchrun.

The multi-process cases (``dist/gsm8k_cases.py``, one torchrun launch on 2 gloo ranks with
tp = 2) run SFT, GRPO and scoring at a tiny size through the example's command line and check
their outputs against float64 references. The tests here check the data layer, that bad
input stops the run with a clear error before anything is written, that ``--load`` supplies the
model flags and that each mode prints the settings it uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys

import pytest
import torch

from conftest import check_case

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")
pytest.importorskip("mistral_common")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _gsm8k_files import ROW, TINY, write_jsonl  # noqa: E402
from dist.gsm8k_cases import CASES  # noqa: E402
from examples.gsm8k import data, report  # noqa: E402
from examples.gsm8k.grpo import group_advantages  # noqa: E402


@pytest.mark.parametrize("name", sorted(CASES))
def test_mode_under_torchrun(name):
    check_case("gsm8k_cases.py", 2, name)


# --------------------------------------------------------------------------- data layer


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer()


def test_tokenizer_is_tekken(tokenizer):
    assert tokenizer.n_words == 131072
    ex = data.encode_gsm8k(tokenizer, ROW["question"], ROW["answer"])
    assert ex.prompt[0] == tokenizer.bos_id and ex.response[-1] == tokenizer.eos_id
    assert tokenizer.decode(ex.response[:-1]) == ROW["answer"]


@pytest.mark.parametrize("text, want", [("x\n#### 72", "72"), ("#### 1,080", "1080"),
                                        ("#### $4.50", "4.5"), ("#### -3", "-3"),
                                        ("#### 5.", "5"), ("no answer", None),
                                        ("#### many", None)])
def test_final_answer(text, want):
    assert data.final_answer(text) == want


def test_stand_in_rollouts_and_rewards():
    answers = data.corrupted_answers(ROW["answer"], 8, random.Random(0))
    assert answers[0] == ROW["answer"]
    rewards = [data.reward(a, ROW["answer"]) for a in answers]
    assert rewards == [1.0, 0.0, 1.0, 0.0] * 2
    assert data.final_answer(answers[1]) not in (None, "2")
    assert "####" not in answers[3]


def test_group_advantages_are_normalised_per_group():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1.0, 1.0, -1.0]), rtol=0, atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))
    ref = (rewards[2] - rewards[2].mean()) / rewards[2].std(unbiased=False)
    torch.testing.assert_close(adv[2], ref, rtol=0, atol=1e-5)


def test_pack_rows_is_greedy_in_order():
    assert data.pack_rows([3, 5, 2, 7, 1], 8, 1) == [[0, 1], [2], [3, 4]]
    assert data.pack_rows([3, 3, 3], 8, 4) == [[0, 1], [2]]


def test_batch_masks_response_tokens_and_blocks_attention():
    examples = [data.Example([1, 5, 6], [7, 8, 2]), data.Example([1, 9], [10, 2]),
                data.Example([1, 4, 4, 4], [11])]
    batch = data.make_batch(examples, seq_length=24, alignment=4, device=torch.device("cpu"),
                            thd=False)
    tokens = batch.model_inputs["input_ids"][0].tolist()
    mask = batch.model_inputs["attention_mask"][0, 0]
    want_loss, want_seq, want_labels, start = [0.0] * 24, [2] * 24, [0] * 24, 0
    for n, ex in enumerate(examples):
        seq = ex.prompt + ex.response
        padded = -(-len(seq) // 4) * 4
        assert tokens[start:start + len(seq)] == seq
        for p in range(len(seq) - 1):
            want_labels[start + p] = seq[p + 1]
            want_loss[start + p] = float(p + 1 >= len(ex.prompt))
        want_seq[start:start + padded] = [n] * padded
        start += padded
    assert batch.loss_mask[0].tolist() == want_loss
    assert batch.labels[0].tolist() == want_labels
    assert batch.real_tokens == sum(e.num_tokens for e in examples) and batch.num_sequences == 3
    for i in range(24):
        for j in range(24):
            assert bool(mask[i, j]) == (want_seq[i] != want_seq[j] or j > i), (i, j)


def test_write_outputs_is_all_or_nothing(tmp_path):
    good, bad = tmp_path / "a.json", tmp_path / "b.json"

    def broken(f):
        f.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        report.write_outputs({str(good): report.json_writer({"x": 1}),
                              str(bad): (broken, False)})
    assert os.listdir(tmp_path) == []
    report.write_outputs({str(good): report.json_writer({"x": float("nan")})})
    assert json.loads(good.read_text()) == {"x": None}


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def cli():
    """``examples.gsm8k.cli``, leaving the plugin's patch and settings as they were."""
    from megatron_vocabstats.megatron import settings

    module = sys.modules.get("megatron_vocabstats.patch")
    was_applied = module is not None and module.is_applied()
    before = dataclasses.asdict(settings.current())
    from examples.gsm8k import cli as module_cli

    yield module_cli
    if not was_applied:
        sys.modules["megatron_vocabstats.patch"].remove()
    settings.update(**before)


def fails(cli, capsys, argv, *needles):
    """``cli.main(argv)`` exits 2 with an ``error:`` line holding every needle."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


def test_missing_data_file(cli, capsys, tmp_path, gsm8k_dir):
    (gsm8k_dir / "test.jsonl").unlink()
    out = tmp_path / "out"
    fails(cli, capsys, ["sft", *TINY, "--data-dir", str(gsm8k_dir), "--out", str(out)],
          "--data-dir", "test.jsonl", "not found")
    assert not out.exists()


@pytest.mark.parametrize("raw, needles", [
    ('{"question": "q", "answer": "a\\n#### 1"\n', ("train.jsonl:5", "not valid JSON")),
    ('["q", "a"]\n', ("train.jsonl:5", "JSON object")),
    ('{"question": "q"}\n', ("train.jsonl:5", "'answer'")),
    ('{"question": "q", "answer": "no final number"}\n', ("row 5", "####")),
])
def test_malformed_data_file(cli, capsys, tmp_path, gsm8k_dir, raw, needles):
    write_jsonl(gsm8k_dir / "train.jsonl", [ROW] * 4, raw)
    out = tmp_path / "out"
    fails(cli, capsys, ["sft", *TINY, "--data-dir", str(gsm8k_dir), "--out", str(out)],
          "--data-dir", *needles)
    assert not out.exists()


def test_empty_scoring_file(cli, capsys, tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "scores.jsonl"
    source.write_text("\n\n")
    fails(cli, capsys, ["score", *TINY, "--input", str(source), "--output", str(target)],
          "--input", "holds no rows")
    assert not target.exists()


def test_response_with_no_tokens(cli, capsys, tmp_path):
    target = tmp_path / "scores.jsonl"
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "response": "b"},
                                                 {"prompt": "c", "response": ""}])
    fails(cli, capsys, ["score", *TINY, "--input", source, "--output", str(target)],
          "--input", "row 2", "zero tokens")
    assert not target.exists()


def test_response_longer_than_a_row(cli, capsys, tmp_path):
    target = tmp_path / "scores.jsonl"
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "response": "word " * 500}])
    fails(cli, capsys, ["score", *TINY, "--input", source, "--output", str(target)],
          "--input", "row 1", "--seq-length 384")
    assert not target.exists()


@pytest.mark.parametrize("flags, needles", [
    (["--tp", "3"], ("--tp 3", "--num-attention-heads 4")),
    (["--num-attention-heads", "6"], ("--num-attention-heads 6", "--hidden-size 64")),
    (["--cp", "2"], ("--cp 2", "CUDA")),
])
def test_layout_that_cannot_work(cli, capsys, tmp_path, gsm8k_dir, flags, needles):
    out = tmp_path / "out"
    fails(cli, capsys, ["sft", *TINY, *flags, "--data-dir", str(gsm8k_dir), "--out", str(out)],
          *needles)
    assert not out.exists()


def test_checkpoint_of_another_model(cli, capsys, tmp_path, gsm8k_dir):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"hidden_size": 128}))
    fails(cli, capsys, ["sft", *TINY, "--data-dir", str(gsm8k_dir), "--load", str(ckpt),
                        "--out", str(tmp_path / "out")], "--load", "hidden_size")


# --------------------------------------------------------------------------- sampled rollouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_scores_its_own_truncated_distribution(dtype):
    from examples.gsm8k.grpo import sample_next

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 64).to(dtype)
    tokens, logq = sample_next(logits, temperature=0.5, top_p=0.9,
                               generator=torch.Generator().manual_seed(0))
    z = logits / 0.5
    p = torch.softmax(z.float(), -1)[0]
    kept = (torch.cumsum(p, 0) - p) < 0.9  # the most likely holds 0.865 of the mass
    assert kept.tolist() == [True, True, False, False, False]
    assert set(tokens.tolist()) <= {0, 1} and len(set(tokens.tolist())) == 2
    want = torch.log_softmax(z[0, :2], -1).float()  # in the sampler's dtype
    assert logq.dtype == torch.float32
    torch.testing.assert_close(logq, want[tokens], rtol=0, atol=0)


@pytest.mark.parametrize("flags, needles", [
    (["--rollout-correction", "tis"], ("--rollout-correction tis", "--rollouts sampled")),
    (["--rollouts", "sampled", "--rollout-temperature", "0.5"],
     ("--rollout-temperature", "--sample-temperature")),
    (["--rollouts", "sampled", "--sample-top-p", "0"], ("--sample-top-p",)),
    (["--rollouts", "sampled", "--max-new-tokens", "0"], ("--max-new-tokens",)),
    (["--rollouts", "sampled", "--rollout-correction", "mis",
      "--rollout-correction-threshold", "3"],
     ("--rollout-correction-threshold applies to --rollout-correction tis",)),
])
def test_bad_rollout_flags_stop_grpo(cli, capsys, tmp_path, gsm8k_dir, flags, needles):
    out = tmp_path / "out"
    fails(cli, capsys, ["grpo", *TINY, *flags, "--data-dir", str(gsm8k_dir), "--out", str(out)],
          *needles)
    assert not out.exists()


# --------------------------------------------------------------------------- --load, settings line
# --load supplies the model flags its checkpoint records, and every mode says which settings it
# computes with (never a raw PluginSettings(...)). In-process, nothing is trained.


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
