"""The GSM8K example's distill mode (examples/gsm8k/distill.py) at a tiny size under torchrun.

Two runs on 2 gloo ranks (tp = 2) with the same seed, the teacher's top-k computed on the fly
and precomputed (stored, read back): their per-step losses must be identical, the stored top-k
must be well formed, and the loss must fall on a repeated batch. Bad flags stop the run with a
clear error before anything is written.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from _ranks import launch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")
pytest.importorskip("mistral_common")
pytest.importorskip("tqdm")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TINY = ["--tp", "2", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "384", "--train-examples", "8", "--test-examples", "4", "--steps", "3",
        "--teacher-steps", "2", "--topk", "8", "--repeat-batch", "--lr", "3e-3",
        "--vocab-parallel-stats", "--seed", "5"]


def _distill(out: str, *flags: str) -> dict:
    rc, log = launch(["-m", "examples.gsm8k", "distill", *TINY, "--out", out, *flags], 2,
                     cwd=ROOT, timeout=180)  # three launches in pytest-timeout's 600 s
    assert rc == 0, log[-9000:]
    with open(os.path.join(out, "distill.json")) as f:
        return json.load(f)


def test_distill_mode_on_the_fly_equals_precomputed(tmp_path):
    live = _distill(str(tmp_path / "live"), "--teacher-topk", "on-the-fly", "--tail-bucket")
    stored = _distill(str(tmp_path / "stored"), "--teacher-topk", "precomputed", "--tail-bucket")
    reused = _distill(str(tmp_path / "reused"), "--teacher-topk-load", str(tmp_path / "stored"),
                      "--tail-bucket")
    losses = [s["distill loss"] for s in live["train"]]
    assert losses == [s["distill loss"] for s in stored["train"]]
    assert losses == [s["distill loss"] for s in reused["train"]]
    assert all(loss > 0 for loss in losses) and losses[-1] < losses[0], losses
    assert live["teacher"]["num_layers"] == 2  # 2 x the student's layers
    assert live["teacher"]["test_nll"] > 0 and reused["teacher"]["test_nll"] is None  # not built
    top = torch.load(tmp_path / "stored" / "teacher_topk_dp0.pt", weights_only=True)
    assert top["topk"] == 8 and top["seq_length"] == 384
    logprobs, indices = top["rows"][0]
    assert logprobs.shape == indices.shape and logprobs.shape[-1] == 8
    assert bool((indices >= 0).all() and (indices < 131072).all())
    assert bool((logprobs[..., :-1] >= logprobs[..., 1:]).all())  # sorted, descending
    assert not os.path.exists(tmp_path / "live" / "teacher_topk_dp0.pt")


@pytest.mark.parametrize("flags, message", [
    (["--topk", "0"], "argument --topk: must be an int in [1, 2**63 - 1], got 0"),
    (["--jsd-beta", "1.5"], "--jsd-beta"),
    (["--teacher-load", "/nonexistent"], "--teacher-load: /nonexistent is not a checkpoint"),
    (["--topk", "200000"], "--topk 200000 exceeds"),
    (["--teacher-topk-load", "/nonexistent"], "--teacher-topk-load /nonexistent is not a dir"),
])
def test_bad_flags_stop_before_any_output(tmp_path, capsys, flags, message):
    from examples.gsm8k import cli

    out = tmp_path / "out"
    assert cli.main(["distill", *TINY, "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def _stored_file(path, **changes):
    from examples.gsm8k.distill import TOPK_FORMAT

    rows = {0: (torch.log_softmax(torch.randn(1, 6, 8), -1)[..., :3].sort(-1, True).values,
                torch.randint(0, 100, (1, 6, 3), dtype=torch.int32))}
    content = {"format": TOPK_FORMAT, "topk": 3, "temperature": 1.0, "vocab_size": 100,
               "seq_length": 6, "rows": rows, **changes}
    torch.save(content, path)
    return content


META = dict(topk=3, temperature=1.0, vocab_size=100, seq_length=6)


def test_stored_topk_is_read_back(tmp_path):
    from examples.gsm8k.distill import TOPK_FORMAT, read_topk

    content = _stored_file(tmp_path / "t.pt")
    got = read_topk(str(tmp_path / "t.pt"), {"format": TOPK_FORMAT, **META}, {0: (1, 6)}, "cpu")
    assert torch.equal(got[0].logprobs, content["rows"][0][0])
    assert got[0].indices.dtype == torch.int64


@pytest.mark.parametrize("change, message", [
    ("corrupt", "is not a readable top-k file"),
    ("missing", "does not exist"),
    (dict(format="other"), "is not a teacher top-k file"),
    (dict(topk=4), "--topk 4, this run has 3"),
    (dict(temperature=2.0), "--distill-temperature 2.0"),
    (dict(rows={1: None}), "no top-k for training row 0"),
    (dict(rows={0: (torch.zeros(1, 5, 3), torch.zeros(1, 5, 3, dtype=torch.int32))}),
     "expected float and integer (1, 6, 3)"),
    (dict(rows={0: (torch.zeros(1, 6, 3), torch.full((1, 6, 3), 100))}), "outside [0, 100)"),
    (dict(rows={0: (torch.full((1, 6, 3), float("nan")), torch.zeros(1, 6, 3, dtype=torch.int32))}),
     "NaN or positive"),
])
def test_corrupt_or_mismatched_stored_topk_names_the_file(tmp_path, change, message):
    from examples.gsm8k.distill import TOPK_FORMAT, read_topk

    path = tmp_path / "teacher_topk_dp0.pt"
    if change == "corrupt":
        path.write_bytes(b"not a torch file")
    elif isinstance(change, dict):
        _stored_file(path, **change)
    with pytest.raises(ValueError) as info:
        read_topk(str(path), {"format": TOPK_FORMAT, **META}, {0: (1, 6)}, "cpu")
    assert str(path) in str(info.value) and message in str(info.value), str(info.value)
