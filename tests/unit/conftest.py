"""Shared test helpers: the torchrun launcher for the multi-process (gloo) cases, the pinned
BLAS thread count and the hypothesis profiles."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# One intra-op thread for every in-process test: how a reduction or a GEMM splits its work over
# threads changes its rounding, so with the machine's default the bits of a result depend on the
# machine. The bounds of _reference.py hold for any summation order, but the bitwise comparisons
# (chunked vs unchunked, fused vs unfused, batch invariance) need both sides split alike. It is
# also faster on a loaded 2-core machine (docs/numerics.md, "Test tolerances"). torchrun children
# get OMP_NUM_THREADS=1 (torchrun_results).
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


def torchrun_results(script: str, nproc: int) -> dict:
    """Run ``tests/unit/dist/<script>`` on ``nproc`` gloo ranks once; ``{case: [per-rank result]}``.

    A launch that fails (a crash, a hang ended by the gloo timeout) raises its error for every
    case of the script, without launching it again for each."""
    outcome = _launch(script, nproc)
    if isinstance(outcome, AssertionError):
        raise outcome
    return outcome


@functools.cache
def _launch(script: str, nproc: int) -> dict | AssertionError:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", os.path.join(HERE, "dist", script), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        ranks = []
        for r in range(nproc):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                return AssertionError(
                    f"torchrun {script} x{nproc} exited {proc.returncode} without results from "
                    f"rank {r}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
                )
            with open(path) as f:
                ranks.append(json.load(f))
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def check_case(script: str, nproc: int, name: str) -> None:
    """Pass, skip or fail a pytest test as case ``name`` did on every rank."""
    per_rank = torchrun_results(script, nproc).get(name)
    assert per_rank is not None, f"case {name} was not run by {script}"
    failures = [f"rank {r}: {res}" for r, res in enumerate(per_rank) if res.startswith("FAIL")]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    if all(res.startswith("skip") for res in per_rank):
        pytest.skip(per_rank[0][len("skip: "):])
