"""Shared test helpers: the torchrun launcher for the multi-process (gloo) cases."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


@functools.cache
def torchrun_results(script: str, nproc: int) -> dict:
    """Run ``tests/unit/dist/<script>`` on ``nproc`` gloo ranks once; ``{case: [per-rank result]}``."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", os.path.join(HERE, "dist", script), "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        ranks = []
        for r in range(nproc):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                raise AssertionError(
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
