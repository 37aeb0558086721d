"""Megatron-LM's own training loop (``megatron.training.pretrain``, mock data, a tiny model, 3
iterations, 2 gloo ranks) gives the same per-token losses and grad norms with the plugin, unfused
and fused, as plain Megatron, in the layouts where a user's run differs:

* ``tp2``: tensor parallelism; also the plugin imported without ``--vocab-parallel-stats`` (bit
  for bit Megatron's), and a ``HybridModel`` (attention layers: Mamba's kernels need CUDA),
  Megatron's and fused;
* ``pp2_tied``: two pipeline stages with tied embeddings (the output weight lives on the last
  stage and its gradient is summed with the first stage's embedding), unfused and fused;
* ``tp2_sp_mtp``: tp 2 with sequence parallelism (the hidden states arrive as sequence shards;
  Megatron's torch LayerNorm is allowed there by the test-support shim
  ``testing.megatron_cpu.tag_torch_norm_for_sequence_parallel``, which gives its parameters the
  ``sequence_parallel`` tag Apex's norm carries), one MTP depth (rolled labels and masks, the MTP
  loss and acceptance counts Megatron logs) and ``--calculate-per-token-loss`` with loss masks
  whose counts differ per micro-batch (2 per iteration); unfused and fused.

One torchrun launch per layout (``dist/megatron_training_run.py`` runs the layout's
configurations one after the other in the same processes: interpreter start and Megatron import
are most of a run's time on 2 CPU cores); every run proves the plugin ran (how often its unfused
op, fused head and fused MTP loss were called, whether ``last_vocab_stats`` and
``last_mtp_vocab_stats`` were set). fp32 throughout, so the plugin's losses and grad norms agree
with Megatron's to rounding: its chunked logsumexp sums the same terms in another order (a few
fp32 ulps, ~1e-7 relative, also after 2 SGD steps), while a wrong loss or gradient moves them by
orders of magnitude more; RTOL = 1e-5 leaves ~80 ulps between. The MTP acceptance counts are
compared exactly (a count moves only if a near tie between two logits, ~1 ulp apart, flips).
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile

import pytest
import torch

from _ranks import LaunchError, launch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist", "megatron_training_run.py")
NPROC, ITERS, MICRO_BATCH, SEQ = 2, 3, 2, 32
RTOL = 1e-5
TIMEOUT_S = 420  # per launch; a layout's launch takes 25-45 s here (2 loaded cores)

# A tiny GPT on Megatron's mock data and null tokenizer, fp32, plus what a CPU run needs
# (docs/megatron.md, "Running Megatron's training loop on CPU").
MEGATRON_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", str(MICRO_BATCH),
    "--train-iters", str(ITERS), "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "250", "--optimizer", "sgd", "--lr", "0.1", "--lr-decay-style", "constant",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--log-interval", "1",
    "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    # CPU: what each is for is in docs/megatron.md, "Running Megatron's training loop on CPU"
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--clip-grad", "0", "--rerun-mode", "disabled",
]
PLUGIN = ["--import-plugin", "--vocab-parallel-stats"]
FUSED = [*PLUGIN, "--lm-head-chunk-size", "16"]
TP2 = ["--tensor-model-parallel-size", "2"]

HYBRID = ["--hybrid", "--spec", "megatron_cpu_training", "HYBRID_CPU_SPEC",
          "--hybrid-layer-pattern", "**"]

# layout -> (flags of every run, micro-batches per iteration, MTP depths, {run: its own flags});
# a run named "<model>_..." compares with "<model>_megatron", any other with "megatron".
LAYOUTS = {
    "tp2": ([*TP2, "--global-batch-size", str(MICRO_BATCH)], 1, 0, {
        "megatron": [], "plugin_off": ["--import-plugin"], "plugin": PLUGIN, "fused": FUSED,
        "hybrid_megatron": HYBRID, "hybrid_fused": [*FUSED, *HYBRID]}),
    "pp2_tied": (["--pipeline-model-parallel-size", "2", "--global-batch-size",
                  str(2 * MICRO_BATCH)], 2, 0, {
        "megatron": [], "plugin": PLUGIN, "fused": FUSED}),
    "tp2_sp_mtp": ([*TP2, "--sequence-parallel", "--mtp-num-layers", "1",
                    "--position-embedding-type", "rope", "--no-rope-fusion",
                    "--calculate-per-token-loss", "--uneven-loss-mask",
                    "--global-batch-size", str(2 * MICRO_BATCH)], 2, 1, {
        "megatron": [], "plugin": PLUGIN, "fused": FUSED}),
}
# What the model must have been built with (checked on the runs' records).
BUILT = {
    "tp2": dict(model="GPTModel", tp=2, pp=1, sequence_parallel=False, tied=True),
    "pp2_tied": dict(model="GPTModel", tp=1, pp=2, sequence_parallel=False, tied=True),
    "tp2_sp_mtp": dict(model="GPTModel", tp=2, pp=1, sequence_parallel=True, tied=True,
                       mtp_num_layers=1, calculate_per_token_loss=True),
}


def _baseline(name: str) -> str:
    return "hybrid_megatron" if name.startswith("hybrid") else "megatron"


def _built(layout: str, name: str) -> dict:
    return dict(BUILT[layout], **({"model": "HybridModel"} if name.startswith("hybrid") else {}))


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
def _launch(layout: str) -> tuple[dict | None, str]:
    """Launch ``layout``'s runs once: ``{run: per-rank results}`` and the log of both ranks, or
    None and why not."""
    common, _, _, runs = LAYOUTS[layout]
    script_flags = {"--uneven-loss-mask", "--hybrid"}  # the run script's own, for every run
    own = [f for f in common if f in script_flags]
    megatron = [f for f in common if f not in script_flags]
    spec = json.dumps([{"name": name, "flags": [*flags, *own]} for name, flags in runs.items()])
    with tempfile.TemporaryDirectory() as out:
        try:
            rc, log = launch([SCRIPT, "--out", out, "--runs", spec, *MEGATRON_FLAGS, *megatron],
                             NPROC, cwd=out, timeout=TIMEOUT_S)
        except LaunchError as exc:
            return None, f"layout {layout}: {exc}"
        ranks = []
        for r in range(NPROC):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                return None, (f"layout {layout} exited {rc} without results from "
                              f"rank {r}:\n{log[-8000:]}")
            with open(path) as f:
                ranks.append(json.load(f))
    return {name: [rank[name] for rank in ranks] for name in runs}, log


def run(layout: str) -> dict:
    _needs_training_loop()
    results, why = _launch(layout)
    if results is None:
        pytest.fail(why, pytrace=False)
    return results


def _relative_gap(ours, theirs) -> float:
    ours = torch.tensor(ours, dtype=torch.float64)
    theirs = torch.tensor(theirs, dtype=torch.float64)
    assert ours.shape == theirs.shape
    return ((ours - theirs).abs() / theirs.abs()).max().item()


def _logs_acceptance() -> bool:
    """Whether Megatron logs MTP acceptance counts (0.19+)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    return hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")


def _last_stage(layout: str) -> list[int]:
    """The ranks holding the loss (the last pipeline stage)."""
    return [1] if layout.startswith("pp2") else list(range(NPROC))


def test_megatron_baseline_trains():
    """Plain Megatron: 3 iterations, finite losses on every token, no plugin anywhere."""
    for rank, res in enumerate(run("tp2")["megatron"]):
        assert not res["plugin_imported"]
        assert res["stats_set"] == [False] * ITERS, f"rank {rank}"
        assert len(res["lm_loss"]) == len(res["grad_norm"]) == ITERS
        assert [len(t) for t in res["token_losses"]] == [MICRO_BATCH * SEQ] * ITERS
        assert all(0 < v < 20 for t in res["token_losses"] for v in t)
        assert res["grad_norm"][0] > 0


def test_import_without_flag_is_megatron():
    """The import alone, under Megatron's parser, leaves Megatron's loss on: bit for bit."""
    results = run("tp2")
    for rank, (base, res) in enumerate(zip(results["megatron"], results["plugin_off"])):
        assert res["plugin_imported"] and res["patched"], "the import patched nothing"
        assert res["settings"]["active"] is False
        assert res["stats_set"] == [False] * ITERS, f"rank {rank}: last_vocab_stats set"
        assert res["unfused_calls"] == res["fused_calls"] == res["fused_mtp_calls"] == 0
        for key in ("token_losses", "lm_loss", "grad_norm"):
            assert res[key] == base[key], f"rank {rank}: {key} differs from plain Megatron"


CASES = [(layout, name) for layout, (_, _, _, runs) in LAYOUTS.items()
         for name in runs if name not in ("megatron", "plugin_off", "hybrid_megatron")]


@pytest.mark.parametrize("layout, name", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_plugin_matches_megatron(layout, name):
    """With --vocab-parallel-stats (and the fused head) the loss is the plugin's: its op ran
    once per head and micro-batch (the fused head's and MTP loss's, or the unfused op's, never
    both), the statistics were set on the model, and the per-token losses, lm loss, grad norm and
    Megatron's MTP log agree with plain Megatron's."""
    _, micro, depths, _ = LAYOUTS[layout]
    results = run(layout)
    fused = name.endswith("fused")
    forwards = micro * ITERS
    expected_build = _built(layout, name)
    for rank, (base, res) in enumerate(zip(results[_baseline(name)], results[name])):
        assert res["settings"] == {"active": True, "lm_head_chunk_size": 16 if fused else 0}
        built = {k: res["layout"][k] for k in expected_build}
        assert built == expected_build == {k: base["layout"][k] for k in expected_build}
        heads = rank in _last_stage(layout)
        calls = (res["fused_calls"], res["fused_mtp_calls"], res["unfused_calls"])
        expected = ((forwards, forwards if depths else 0, 0) if fused
                    else (0, 0, (1 + depths) * forwards)) if heads else (0, 0, 0)
        assert calls == expected, \
            f"rank {rank}: (fused, fused MTP, unfused) calls {calls}, not {expected}"
        assert res["stats_set"] == ([True] * forwards if heads else []), f"rank {rank}"
        assert res["mtp_stats_set"] == ([depths or -1] * forwards if heads else [])
        for key in ("token_losses", "lm_loss", "grad_norm"):
            assert len(res[key]) == len(base[key]), f"rank {rank}: {key}"
            if res[key]:
                gap = _relative_gap(res[key], base[key])
                assert gap <= RTOL, f"rank {rank}: {key} off Megatron's by {gap:.2e} relative"
        if heads:
            counts = res["mask_counts"]
            assert counts == base["mask_counts"] and len(counts) == forwards
            if "--uneven-loss-mask" in LAYOUTS[layout][0]:
                assert len(set(counts[:micro])) == micro, f"mask counts {counts} not uneven"
        assert len(res["mtp"]) == len(base["mtp"]) == (ITERS if depths else 0)
        for ours, theirs in zip(res["mtp"], base["mtp"]):
            assert ("correct_values" in theirs) == _logs_acceptance()
            gap = _relative_gap(ours["loss_values"], theirs["loss_values"])
            assert gap <= RTOL, f"rank {rank}: MTP loss off Megatron's by {gap:.2e} relative"
            for key in ("correct_values", "total_values"):
                assert ours.get(key) == theirs.get(key), f"rank {rank}: MTP {key}"


def _run_logs(log: str) -> dict[str, str]:
    """The log of each run of a launch, every rank's, cut at the ``@@run NAME rank R`` markers
    (the run script prints one on each rank before each run)."""
    parts = re.split(r"^@@run (\S+) rank \d+$", log, flags=re.M)
    logs: dict[str, str] = {}
    for name, text in zip(parts[1::2], parts[2::2]):
        logs[name] = logs.get(name, "") + text
    return logs


def test_log_says_once_that_the_plugin_is_on():
    """Megatron's log at its default level (INFO) shows one line from rank 0 saying the plugin is
    on and how, on the first loss of the run, never again (3 iterations, 2 ranks); none without
    the flag. (The launch's runs are new runs of one process: the run script re-arms the line
    between them, as a new process would.)"""
    run("tp2")
    logs = _run_logs(_launch("tp2")[1])
    for name, how in [("megatron", None), ("plugin_off", None),
                      ("plugin", "on: unfused (chunk auto)"),
                      ("fused", "on: fused LM head (chunk 16 tokens)")]:
        lines = [line for line in logs[name].splitlines()
                 if "megatron-vocabstats" in line and " on: " in line]
        if how is None:
            assert not lines, f"{name}: {lines}"
            continue
        assert len(lines) == 1, f"{name}: {len(lines)} lines, not 1: {lines}"
        assert how in lines[0] and "tp 2, cp 1, sequence parallel off" in lines[0], lines[0]
