"""The GSM8K example's command line (examples/gsm8k/cli.py, report.py, model.py) on bad input.

Bad flags are refused at parse time, outputs that exist (without ``--overwrite``) or that are
inputs are refused, and bad input files are named, all with exit status 2 and before any
process group or model exists (``init_parallel`` and ``build_model`` are replaced by functions
that fail the test). A checkpoint interrupted while being replaced is refused, never mixed.
Nothing here trains a model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import types

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")
pytest.importorskip("mistral_common")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from _gsm8k_files import ROW, TINY, write_jsonl  # noqa: E402


@pytest.fixture
def cli(monkeypatch):
    """``examples.gsm8k.cli`` with process groups and models forbidden; the plugin's patch and
    settings are restored afterwards."""
    from megatron_vocabstats.megatron import settings

    module = sys.modules.get("megatron_vocabstats.patch")
    was_applied = module is not None and module.is_applied()
    before = dataclasses.asdict(settings.current())
    from examples.gsm8k import cli as module_cli
    from examples.gsm8k import model

    def forbidden(*_, **__):
        raise AssertionError("a process group or model was built before the input was refused")

    monkeypatch.setattr(model, "init_parallel", forbidden)
    monkeypatch.setattr(model, "build_model", forbidden)
    yield module_cli
    if not was_applied:
        sys.modules["megatron_vocabstats.patch"].remove()
    settings.update(**before)


def fails(cli, capsys, argv, *needles) -> str:
    """``cli.main(argv)`` returns 2 and prints an ``error:`` line holding every needle."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: "), err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def scoring(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "response": "b"}])


# --------------------------------------------------------------------- flags, at parse time

BAD_FLAGS = [
    ("sft", "--train-examples", "-1"), ("sft", "--steps", "0"), ("sft", "--steps", "-2"),
    ("sft", "--micro-batches", "0"), ("sft", "--seq-length", "0"), ("sft", "--tp", "0"),
    ("sft", "--cp", "-1"), ("sft", "--num-layers", "0"), ("sft", "--hidden-size", "-64"),
    ("sft", "--num-attention-heads", "0"), ("sft", "--ffn-hidden-size", "-1"),
    ("sft", "--warmup-steps", "-1"), ("sft", "--test-examples", "0"),
    ("sft", "--compare-batches", "0"), ("sft", "--compare-chunk", "0"), ("sft", "--seed", "-1"),
    ("sft", "--steps", "1.5"), ("sft", "--lr", "nan"), ("sft", "--lr", "0"),
    ("sft", "--lr", "-0.001"), ("sft", "--lr", "inf"), ("sft", "--weight-decay", "-0.1"),
    ("sft", "--weight-decay", "nan"), ("sft", "--clip-grad", "-1"), ("sft", "--clip-grad", "inf"),
    ("sft", "--dropout", "1"), ("sft", "--dropout", "-0.1"), ("sft", "--lm-head-chunk-size", "-1"),
    ("sft", "--logprobs-chunk-size", "-8"), ("sft", "--entropy-coef", "nan"),
    ("sft", "--vocab-stats-label-smoothing", "1"), ("grpo", "--group-size", "1"),
    ("grpo", "--questions-per-step", "0"), ("grpo", "--ppo-epochs", "0"),
    ("grpo", "--clip-eps", "0"), ("grpo", "--clip-eps", "1"), ("grpo", "--clip-eps", "nan"),
    ("distill", "--topk", "0"), ("distill", "--teacher-steps", "0"),
    ("distill", "--teacher-num-layers", "-1"), ("distill", "--teacher-hidden-size", "-1"),
    ("distill", "--jsd-beta", "0"), ("distill", "--jsd-beta", "nan"),
    ("distill", "--distill-temperature", "0"), ("distill", "--distill-temperature", "inf"),
    ("distill", "--test-examples", "-1"), ("score", "--seq-length", "-384"),
]


@pytest.mark.parametrize("mode, flag, value", BAD_FLAGS)
def test_bad_number_is_refused_at_parse_time(cli, capsys, tmp_path, scoring, mode, flag, value):
    extra = ["--input", scoring, "--output", str(tmp_path / "o.jsonl")] if mode == "score" else []
    with pytest.raises(cli.UsageError, match=f"argument {flag}: must be"):
        cli.build_parser().parse_args([mode, flag, value, *extra])
    fails(cli, capsys, [mode, flag, value, *extra, "--out", str(tmp_path / "out")],
          f"argument {flag}: must be", repr(value) if value == "1.5" else "")
    assert not (tmp_path / "out").exists()


def test_good_numbers_still_parse(cli):
    args = cli.build_parser().parse_args(["grpo", "--train-examples", "0", "--lr", "3e-4",
                                          "--clip-grad", "0", "--group-size", "2",
                                          "--clip-eps", "0.3", "--entropy-coef", "-0.01"])
    assert (args.train_examples, args.lr, args.clip_grad, args.group_size) == (0, 3e-4, 0.0, 2)
    assert args.clip_eps == 0.3 and args.entropy_coef == -0.01


# --------------------------------------------------------------------- outputs


def test_score_refuses_to_overwrite_its_input(cli, capsys, scoring):
    before = open(scoring).read()
    for extra in ([], ["--overwrite"]):
        fails(cli, capsys, ["score", "--input", scoring, "--output", scoring, *extra],
              f"--output {scoring} is the same path as the input --input", "--overwrite")
    assert open(scoring).read() == before


@pytest.mark.parametrize("link", ["symlink", "hardlink", "dotted"])
def test_output_naming_the_input_another_way_is_refused(cli, capsys, tmp_path, scoring, link):
    target = tmp_path / "alias.jsonl"
    if link == "symlink":
        target.symlink_to(scoring)
    elif link == "hardlink":
        os.link(scoring, target)
    else:
        target = tmp_path / "sub" / ".." / "in.jsonl"
    fails(cli, capsys, ["score", "--input", scoring, "--output", str(target), "--overwrite"],
          "is the same path as the input --input")


def test_save_over_the_loaded_checkpoint_is_refused(cli, capsys, tmp_path, gsm8k_dir):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fails(cli, capsys, ["sft", "--data-dir", str(gsm8k_dir), "--load", str(ckpt), "--save",
                        str(ckpt), "--overwrite", "--out", str(tmp_path / "out")],
          f"--save {ckpt} is the same path as the input --load")


def test_outputs_over_data_or_each_other_are_refused(cli, capsys, tmp_path, gsm8k_dir):
    data = gsm8k_dir / "train.jsonl"
    fails(cli, capsys, ["grpo", "--data-dir", str(gsm8k_dir), "--save", str(data), "--overwrite",
                        "--out", str(tmp_path / "out")],
          f"--save {data} is the same path as the input --data-dir")
    fails(cli, capsys, ["sft", "--data-dir", str(gsm8k_dir), "--out", str(tmp_path),
                        "--save", str(tmp_path / "sft.json")],
          f"--save {tmp_path / 'sft.json'} is the same path as the output --out")


def _existing(mode, tmp_path, scoring):
    """(argv, the existing output it would replace) per mode."""
    out = tmp_path / "out"
    out.mkdir()
    if mode == "score":
        target = tmp_path / "scores.jsonl"
        return ["score", "--input", scoring, "--output", str(target)], target, "--output"
    if mode == "save":
        (tmp_path / "ckpt").mkdir()
        target = tmp_path / "ckpt" / "meta.json"
        return ["sft", "--save", str(tmp_path / "ckpt"), "--out", str(out)], target, "--save"
    if mode == "topk":
        target = out / "teacher_topk_dp0.pt"
        return ["distill", "--teacher-topk", "precomputed", "--out", str(out)], target, "--out"
    target = out / {"sft": "sft.png", "grpo": "grpo.json", "distill": "distill.json"}[mode]
    return [mode, "--out", str(out)], target, "--out"


@pytest.mark.parametrize("mode", ["sft", "grpo", "distill", "score", "save", "topk"])
def test_existing_output_needs_overwrite(cli, capsys, tmp_path, scoring, mode):
    argv, target, flag = _existing(mode, tmp_path, scoring)
    target.write_text("earlier run")
    fails(cli, capsys, argv, flag, "--overwrite")
    assert target.read_text() == "earlier run"
    cli.check_outputs(cli.parse_args([*argv, "--overwrite"]))  # accepted with the flag


def test_fresh_outputs_are_accepted(cli, tmp_path, scoring):
    argv, _, _ = _existing("topk", tmp_path, scoring)
    cli.check_outputs(cli.parse_args([*argv, "--save", str(tmp_path / "new" / "ckpt")]))
    cli.check_outputs(cli.parse_args(["score", "--input", scoring, "--output",
                                      str(tmp_path / "deeper" / "scores.jsonl")]))


def test_output_that_cannot_be_written(cli, capsys, tmp_path, scoring):
    blocker = tmp_path / "file"
    blocker.write_text("")
    fails(cli, capsys, ["score", "--input", scoring, "--output", str(blocker / "s.jsonl")],
          "--output", f"{blocker} is not a directory")
    fails(cli, capsys, ["score", "--input", scoring, "--output", str(tmp_path)],
          f"--output {tmp_path} is a directory")
    fails(cli, capsys, ["sft", "--save", str(blocker), "--out", str(tmp_path / "o")],
          f"--save {blocker} exists and is not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_output_directory_without_write_permission(cli, capsys, tmp_path, scoring):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        fails(cli, capsys, ["score", "--input", scoring, "--output", str(locked / "s.jsonl")],
              "--output", "no write permission")
    finally:
        locked.chmod(0o700)


def test_interrupted_write_keeps_the_earlier_file(tmp_path):
    from examples.gsm8k import report

    target = tmp_path / "scores.jsonl"
    target.write_text("earlier run\n")

    def interrupted(f):
        f.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        report.atomic_write(str(target), interrupted)
    assert target.read_text() == "earlier run\n" and os.listdir(tmp_path) == ["scores.jsonl"]


def test_checkpoint_interrupted_while_replaced_is_refused_not_mixed(tmp_path, monkeypatch):
    """Two tp ranks replace a checkpoint; rank 1 dies before writing its shard. What is left
    must be refused by ``check_checkpoint``, not taken as a checkpoint (rank 0's new shard with
    rank 1's old one)."""
    import torch

    from examples.gsm8k import model as model_lib

    shape = model_lib.ModelShape(1, 8, 2, 32, 100, 128, 16, "learned_absolute", False, 2)
    barrier = threading.Barrier(2, timeout=30)
    monkeypatch.setattr(model_lib, "dist", types.SimpleNamespace(barrier=barrier.wait))

    class Dies(torch.nn.Linear):
        def state_dict(self, *a, **k):
            raise RuntimeError("rank 1 killed")

    def save(tp_rank, module, errors):
        par = types.SimpleNamespace(tp_rank=tp_rank, cp_rank=0, dp_rank=0)
        try:
            model_lib.save_checkpoint(module, str(tmp_path), shape, par)
        except BaseException as exc:  # noqa: BLE001 - recorded; the other rank is released
            errors.append(exc)
            barrier.abort()

    def both(modules):
        barrier.reset()
        errors = []
        threads = [threading.Thread(target=save, args=(r, m, errors))
                   for r, m in enumerate(modules)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors

    assert both([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]) == []
    model_lib.check_checkpoint(str(tmp_path), shape)  # complete
    errors = both([torch.nn.Linear(2, 2), Dies(2, 2)])
    assert any("rank 1 killed" in str(e) for e in errors)
    with pytest.raises(ValueError, match="--load"):
        model_lib.check_checkpoint(str(tmp_path), shape)


# --------------------------------------------------------------------- inputs


def test_input_that_is_a_directory(cli, capsys, tmp_path):
    fails(cli, capsys, ["score", *TINY, "--input", str(tmp_path), "--output",
                        str(tmp_path / "s.jsonl")], f"--input: {tmp_path} is a directory")


@pytest.mark.parametrize("meta", ["{not json", "[1, 2]"])
def test_malformed_checkpoint_description(cli, capsys, tmp_path, gsm8k_dir, meta):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(meta)
    fails(cli, capsys, ["sft", *TINY, "--data-dir", str(gsm8k_dir), "--load", str(ckpt),
                        "--out", str(tmp_path / "out")], "--load", str(ckpt / "meta.json"))


@pytest.mark.parametrize("final", ["nan", "inf", "1e400"])
def test_non_finite_final_answer(cli, capsys, tmp_path, gsm8k_dir, final):
    write_jsonl(gsm8k_dir / "train.jsonl", [ROW, {"question": "q", "answer": f"x\n#### {final}"}])
    fails(cli, capsys, ["grpo", *TINY, "--data-dir", str(gsm8k_dir),
                        "--out", str(tmp_path / "out")], "--data-dir", "row 2", "####")


def test_stored_topk_missing_is_refused_before_any_model(cli, capsys, tmp_path, gsm8k_dir):
    stored = tmp_path / "stored"
    stored.mkdir()
    fails(cli, capsys, ["distill", *TINY, "--tp", "1", "--data-dir", str(gsm8k_dir),
                        "--teacher-topk-load", str(stored), "--out", str(tmp_path / "out")],
          f"--teacher-topk-load: {stored / 'teacher_topk_dp0.pt'} does not exist")


def test_output_refused_on_another_rank_is_printed_there(cli, capsys, monkeypatch, scoring):
    # Output directories may be local to a node: a rank other than 0 that refuses one says so
    # (other errors, the same on every rank, are printed by rank 0 alone).
    monkeypatch.setenv("RANK", "1")
    fails_on_1 = ["score", "--input", scoring, "--output", scoring]
    assert cli.main(fails_on_1) == 2
    assert capsys.readouterr().err.startswith("error (rank 1): --output")
    assert cli.main(["sft", "--steps", "0"]) == 2
    assert capsys.readouterr().err == ""


def test_output_that_no_file_can_be_created_in(cli, capsys, tmp_path, scoring):
    """An --output where creating a file fails although permissions (root) say it
    may (/proc), or whose name is too long, is refused by the output check, before the model is
    built (was: the check passed, the run died with a traceback at the end)."""
    fails(cli, capsys, ["score", "--input", scoring, "--output", "/proc/h24/scores.jsonl"],
          "--output", "creating a file in /proc fails")
    before = sorted(tmp_path.iterdir())
    long_name = tmp_path / ("s" * 300 + ".jsonl")
    fails(cli, capsys, ["score", "--input", scoring, "--output", str(long_name)],
          "--output", "is longer than")
    cli.check_outputs(cli.parse_args(["score", "--input", scoring, "--output",
                                      str(tmp_path / "fine.jsonl")]))
    assert sorted(tmp_path.iterdir()) == before  # the check leaves nothing behind
