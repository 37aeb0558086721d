"""Shared test helpers: the launch of the multi-process (gloo) case scripts (through
``_ranks.launch``), the pinned BLAS thread count and the hypothesis profiles."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _ranks import LaunchError, launch  # noqa: E402

# One intra-op thread for every in-process test: how a reduction or a GEMM splits its work over
# threads changes its rounding, so with the machine's default the bits of a result depend on the
# machine. The bounds of _reference.py hold for any summation order, but the bitwise comparisons
# (chunked vs unchunked, fused vs unfused, batch invariance) need both sides split alike. It is
# also faster on a loaded 2-core machine (docs/numerics.md, "Test tolerances"). Launched ranks
# get OMP_NUM_THREADS=1 (_ranks.launch).
torch.set_num_threads(1)

# Hypothesis: "ci" (the default) draws a bounded number of examples from a fixed seed
# (derandomize), so a run never meets a new example and never flakes; no example database is
# written; a failure is shrunk to a small example but not "explained" (that phase reruns the
# failing example many times). "dev" searches more and at random. HYPOTHESIS_PROFILE=dev selects it.
settings.register_profile(
    "ci",
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=300, deadline=None, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def gsm8k_dir(tmp_path):
    """A GSM8K folder for the example's tests: ``train.jsonl`` with 4 rows of
    ``_gsm8k_files.ROW``, ``test.jsonl`` with 2."""
    from _gsm8k_files import ROW, write_jsonl

    d = tmp_path / "gsm8k"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [ROW] * 4)
    write_jsonl(d / "test.jsonl", [ROW] * 2)
    return d


def torchrun_results(script: str, nproc: int, env: dict | None = None) -> dict:
    """Run ``tests/unit/dist/<script>`` on ``nproc`` gloo ranks once; ``{case: [per-rank result]}``.
    ``env``: variables the ranks need before their first import (``_ranks.launch``).

    A launch that fails (a crash, a hang ended by the gloo timeout) raises its error for every
    case of the script, without launching it again for each."""
    outcome = _launch(script, nproc, tuple(sorted((env or {}).items())))
    if isinstance(outcome, AssertionError):
        raise outcome
    return outcome


@functools.cache
def _launch(script: str, nproc: int, env: tuple) -> dict | AssertionError:
    with tempfile.TemporaryDirectory() as out:
        try:
            rc, log = launch([os.path.join(HERE, "dist", script), "--out", out], nproc,
                             env=dict(env))
        except LaunchError as exc:
            return exc
        ranks = []
        for r in range(nproc):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                return AssertionError(
                    f"torchrun {script} x{nproc} exited {rc} without results from "
                    f"rank {r}:\n{log[-12000:]}"
                )
            with open(path) as f:
                ranks.append(json.load(f))
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def check_case(script: str, nproc: int, name: str, env: dict | None = None) -> None:
    """Pass, skip or fail a pytest test as case ``name`` did on every rank."""
    per_rank = torchrun_results(script, nproc, env).get(name)
    assert per_rank is not None, f"case {name} was not run by {script}"
    failures = [f"rank {r}: {res}" for r, res in enumerate(per_rank) if res.startswith("FAIL")]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    if all(res.startswith("skip") for res in per_rank):
        pytest.skip(per_rank[0][len("skip: "):])


# The test files whose outcome can change with the version of Python, torch, Triton or
# megatron-core, with the reason: every leg of scripts/test.sh runs them (`-m versioned`). The
# other files test the package's own arithmetic, checks and bookkeeping through torch operations
# whose results the float64 references bound on any torch; they run once, on the primary leg.
VERSIONED = {
    "test_versions.py": "the supported-versions table against the running versions",
    "test_env.py": "the environment report reads the running versions",
    "test_announce.py": "the log line and its out-of-range warnings name the running versions",
    "test_wheel.py": "build, install and import the wheel with the leg's Python and pip",
    "test_triton_kernels.py": "the unfused kernels under the leg's Triton's CPU interpreter",
    "test_triton_fused_kernels.py": "the fused head's kernels under the leg's Triton's interpreter",
    "test_triton_compile.py": "the sm_90 compile of every launched variant with the leg's Triton",
    "test_batch_invariant.py": "bitwise batch invariance with the leg's torch and Triton",
    "test_batch_invariant_dist.py": "bitwise batch invariance across gloo ranks",
    "test_tracing.py": "make_fx and torch.compile change with torch",
    "test_deferred_logits.py": "__torch_function__ and tensor protocol dispatch change with torch",
    "test_vocab_parallel.py": "the core op's autograd (strides of incoming gradients) per torch",
    "test_fused_linear.py": "the fused head's autograd and GEMM dtypes per torch",
    "test_extreme_logits.py": "fp16/bf16/inf edge values through the leg's torch kernels",
    "test_workspace.py": "buffer reuse relies on torch's tensor versioning and streams API",
    "test_dist_launcher.py": "the test launcher against the leg's torchrun (its variables, its "
                             "agent store)",
    "test_verl.py": "verl's real module code on the leg's torch (verl pins torch 2.11)",
    "test_verl_dist.py": "verl's real module code on gloo ranks",
    "test_nemo_rl.py": "NeMo-RL needs Python 3.13: the integration's bindings on the 3.13 leg",
    "test_nemo_rl_dist.py": "NeMo-RL needs Python 3.13: its conventions on gloo ranks there",
    "test_skyrl.py": "SkyRL's real module code on the leg's torch (skyrl 0.3.0 pins torch 2.11)",
    "test_skyrl_dist.py": "SkyRL's real module code on gloo ranks (skyrl 0.3.0 pins torch 2.11)",
    "test_megatron_import.py": "the patch's lookup of Megatron's names on the leg's Python",
    "test_megatron_patch.py": "the patch binds to Megatron's signatures (inspect per Python)",
    "test_megatron_bridge.py": "megatron-bridge 0.3.1 needs megatron-core < 0.17: the oldest leg",
    "test_megatron_bridge_dist.py": "megatron-bridge 0.3.1 needs megatron-core < 0.17: its "
                                    "forward_step on gloo ranks on the oldest leg",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in VERSIONED:
            item.add_marker(pytest.mark.versioned)
