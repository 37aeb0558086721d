"""Megatron-LM's own training loop (``megatron.training.pretrain``, mock data, a tiny GPT, tp = 2
on gloo, 3 iterations) gives the same losses with the plugin, unfused and fused, as without it.

Four torchrun launches of ``dist/megatron_training_run.py`` (about 15 s each on 2 cores): plain
Megatron; ``import megatron_vocabstats.patch`` without the flag; with ``--vocab-parallel-stats``;
with ``--vocab-parallel-stats --lm-head-chunk-size 16`` (fused LM head). fp32 throughout, so the
plugin's losses and grad norms agree with Megatron's to rounding: its chunked logsumexp sums the
same terms in another order (a few fp32 ulps, ~1e-7 relative, also after 2 SGD steps), while a wrong
loss or gradient moves them by orders of magnitude more; RTOL = 1e-5 leaves ~80 ulps between.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist", "megatron_training_run.py")
NPROC, ITERS, MICRO_BATCH, SEQ = 2, 3, 2, 32
RTOL = 1e-5
TIMEOUT_S = 240  # per launch; a run takes ~15 s here

# A tiny GPT on Megatron's mock data and null tokenizer, fp32, plus what a CPU run needs
# (docs/megatron.md, "Running Megatron's training loop on CPU").
MEGATRON_FLAGS = [
    "--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size", str(MICRO_BATCH),
    "--train-iters", str(ITERS), "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "250", "--optimizer", "sgd", "--lr", "0.1", "--lr-decay-style", "constant",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    # CPU: what each is for is in docs/megatron.md, "Running Megatron's training loop on CPU"
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--clip-grad", "0", "--rerun-mode", "disabled",
]

RUNS = {
    "megatron": [],
    "plugin_off": ["--import-plugin"],
    "plugin": ["--import-plugin", "--vocab-parallel-stats"],
    "fused": ["--import-plugin", "--vocab-parallel-stats", "--lm-head-chunk-size", "16"],
}

pytestmark = pytest.mark.megatron


def _needs_training_loop():
    pytest.importorskip(
        "megatron.training",
        reason="megatron.training (Megatron-LM's training loop) is not importable: megatron-core "
               "0.16 wheels do not ship it")
    from megatron.training import argument_utils

    if not hasattr(argument_utils, "pretrain_cfg_container_from_args"):
        pytest.skip("the run script drives the pretrain(cfg_container, ...) API of megatron-core "
                    "0.19+; this megatron.training predates it")
    if torch.cuda.is_available():
        pytest.skip("a CPU (gloo) test of the training loop; its shims are off where CUDA is")


@functools.cache
def _launch(name: str) -> tuple[tuple[dict, ...] | None, str]:
    """Launch configuration ``name`` once: its per-rank results and the log of both ranks, or
    None and why not."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={NPROC}", SCRIPT, "--out", out, *RUNS[name], *MEGATRON_FLAGS]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        # A session of its own, so that a timeout ends torchrun's ranks too.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=out, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            return None, f"run {name} took over {TIMEOUT_S} s:\n{log[-6000:]}"
        ranks = []
        for r in range(NPROC):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                return None, (f"run {name} exited {proc.returncode} without results from rank "
                              f"{r}:\n{log[-8000:]}")
            with open(path) as f:
                ranks.append(json.load(f))
    return tuple(ranks), log


def run(name: str) -> tuple[dict, ...]:
    ranks, why = _launch(name)
    if ranks is None:
        pytest.fail(why, pytrace=False)
    return ranks


def _relative_gap(ours, theirs) -> float:
    ours = torch.tensor(ours, dtype=torch.float64)
    theirs = torch.tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape
    return ((ours - theirs).abs() / theirs.abs()).max().item()


def test_megatron_baseline_trains():
    """Plain Megatron: 3 iterations, finite losses on every token, no plugin anywhere."""
    _needs_training_loop()
    for rank, res in enumerate(run("megatron")):
        assert not res["plugin_imported"]
        assert res["stats_set"] == [False] * ITERS, f"rank {rank}"
        assert len(res["lm_loss"]) == len(res["grad_norm"]) == ITERS
        assert [len(t) for t in res["token_losses"]] == [MICRO_BATCH * SEQ] * ITERS
        assert all(0 < v < 20 for t in res["token_losses"] for v in t)
        assert res["grad_norm"][0] > 0


def test_import_without_flag_is_megatron():
    """The import alone, under Megatron's parser, leaves Megatron's loss on: bit for bit."""
    _needs_training_loop()
    for rank, (base, res) in enumerate(zip(run("megatron"), run("plugin_off"))):
        assert res["plugin_imported"] and res["patched"], "the import patched nothing"
        assert res["settings"]["active"] is False
        assert res["stats_set"] == [False] * ITERS, f"rank {rank}: last_vocab_stats set"
        assert res["unfused_calls"] == res["fused_calls"] == 0
        for key in ("token_losses", "lm_loss", "grad_norm"):
            assert res[key] == base[key], f"rank {rank}: {key} differs from plain Megatron"


@pytest.mark.parametrize("name", ["plugin", "fused"])
def test_plugin_matches_megatron(name):
    """With --vocab-parallel-stats (and the fused head) the loss is the plugin's, set on the model
    as last_vocab_stats, and per-token losses, lm loss and grad norm agree with Megatron's."""
    _needs_training_loop()
    fused = name == "fused"
    for rank, (base, res) in enumerate(zip(run("megatron"), run(name))):
        assert res["settings"] == {"active": True, "lm_head_chunk_size": 16 if fused else 0}
        assert res["stats_set"] == [True] * ITERS, f"rank {rank}: last_vocab_stats not set"
        calls = (res["fused_calls"], res["unfused_calls"])
        expected = (ITERS, 0) if fused else (0, ITERS)
        assert calls == expected, f"rank {rank}: (fused, unfused) calls {calls}, not {expected}"
        for key in ("token_losses", "lm_loss", "grad_norm"):
            gap = _relative_gap(res[key], base[key])
            assert gap <= RTOL, f"rank {rank}: {key} off Megatron's by {gap:.2e} relative"


def test_log_says_once_that_the_plugin_is_on():
    """Megatron's log at its default level (INFO) shows one line from rank 0 saying the plugin is
    on and how, on the first loss of the run, never again (3 iterations, 2 ranks); none without
    the flag."""
    _needs_training_loop()
    for name, how in [("megatron", None), ("plugin_off", None),
                      ("plugin", "on: unfused (chunk auto)"),
                      ("fused", "on: fused LM head (chunk 16 tokens)")]:
        run(name)
        lines = [line for line in _launch(name)[1].splitlines()
                 if "megatron-vocabstats" in line and " on: " in line]
        if how is None:
            assert not lines, f"{name}: {lines}"
            continue
        assert len(lines) == 1, f"{name}: {len(lines)} lines, not 1: {lines}"
        assert how in lines[0] and "tp 2, cp 1, sequence parallel off" in lines[0], lines[0]
