"""The GSM8K example's distill mode (examples/gsm8k/distill.py) at a tiny size under torchrun.

Two runs on 2 gloo ranks (tp = 2) with the same seed, the teacher's top-k computed on the fly
and precomputed (stored, read back): their per-step losses must be identical, the stored top-k
must be well formed, and the loss must fall on a repeated batch. Bad flags stop the run with a
clear error before anything is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "examples.gsm8k", "distill", *TINY, "--out", out, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(out, "distill.json")) as f:
        return json.load(f)


def test_distill_mode_on_the_fly_equals_precomputed(tmp_path):
    live = _distill(str(tmp_path / "live"), "--teacher-topk", "on-the-fly", "--tail-bucket")
    stored = _distill(str(tmp_path / "stored"), "--teacher-topk", "precomputed", "--tail-bucket")
    losses = [s["distill loss"] for s in live["train"]]
    assert losses == [s["distill loss"] for s in stored["train"]]
    assert all(loss > 0 for loss in losses) and losses[-1] < losses[0], losses
    assert live["teacher"]["num_layers"] == 2  # 2 x the student's layers
    top = torch.load(tmp_path / "stored" / "teacher_topk_dp0.pt", weights_only=True)
    logprobs, indices = top[0]
    assert logprobs.shape == indices.shape and logprobs.shape[-1] == 8
    assert bool((indices >= 0).all() and (indices < 131072).all())
    assert bool((logprobs[..., :-1] >= logprobs[..., 1:]).all())  # sorted, descending
    assert not os.path.exists(tmp_path / "live" / "teacher_topk_dp0.pt")


@pytest.mark.parametrize("flags, message", [
    (["--topk", "0"], "--topk must be >= 1"),
    (["--jsd-beta", "1.5"], "--jsd-beta"),
    (["--teacher-load", "/nonexistent"], "--teacher-load: /nonexistent is not a checkpoint"),
    (["--topk", "200000"], "--topk 200000 exceeds"),
])
def test_bad_flags_stop_before_any_output(tmp_path, capsys, flags, message):
    from examples.gsm8k import cli

    out = tmp_path / "out"
    assert cli.main(["distill", *TINY, "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
