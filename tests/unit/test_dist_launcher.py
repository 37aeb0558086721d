"""The launcher of the multi-process tests (``_ranks.launch``) against torchrun itself.

Every multi-process test starts its ranks through ``_ranks.launch``, which forks them from a
server that has imported torch and Megatron once instead of running ``torchrun``. These tests
hold it to torchrun's contract with ``dist/launcher_probe.py``: each rank sees the variables that
``torchrun --standalone`` gives it (the same names; the same values but for the port, the run id
and the error file's path), runs as ``__main__`` with its arguments and its folder first on
``sys.path``, and reaches the others over gloo through the agent's store; nothing a launch leaves
in its processes is seen by the next, while each launch reads the caller's environment of the
moment, seeds its ranks at random, gives them an empty stdin, runs their exit handlers and ends
what they left running; a rank that fails ends the launch with its traceback; a launch that
outlives its timeout is ended with its ranks, and the next one starts a new server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _ranks import LaunchError, launch, running
from conftest import HERE

PROBE = os.path.join(HERE, "dist", "launcher_probe.py")
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def _reports(out, nproc=2) -> list[dict]:
    reports = []
    for r in range(nproc):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            reports.append(json.load(f))
    return reports


def _torchrun(out) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", PROBE, "--out", str(out)],
                   check=True, capture_output=True, timeout=300, env=env)
    return _reports(out)


def test_ranks_get_what_torchrun_gives_them(tmp_path):
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "ours").mkdir()
    theirs = _torchrun(tmp_path / "torchrun")
    rc, log = launch([PROBE, "--out", str(tmp_path / "ours")], 2)
    assert rc == 0, log
    ours = _reports(tmp_path / "ours")
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a["env"].keys() == b["env"].keys()
        for name, value in b["env"].items():
            assert value is not None, f"torchrun no longer sets {name}"
            if name not in PER_LAUNCH:
                assert a["env"][name] == value, (rank, name, a["env"][name], value)
        assert a["env"]["TORCHELASTIC_RUN_ID"] == ours[0]["env"]["TORCHELASTIC_RUN_ID"]
        assert a["name"] == "__main__" and a["argv"] == [PROBE, "--out", str(tmp_path / "ours")]
        assert a["path0"] == os.path.dirname(PROBE) == b["path0"]
        assert a["sum"] == b["sum"] == 1.0  # 0 + 1 over gloo


def test_a_launch_sees_nothing_an_earlier_one_left(tmp_path, monkeypatch):
    seeds = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        monkeypatch.setenv("LAUNCHER_PROBE_VAR", str(i))  # after the server started
        rc, log = launch([PROBE, "--out", str(tmp_path / str(i)), "--leave-child"], 2)
        assert rc == 0, log
        reports = _reports(tmp_path / str(i))
        assert not any(r["mark_seen"] for r in reports)
        assert [r["var"] for r in reports] == [str(i)] * 2
        assert [r["stdin"] for r in reports] == ["", ""]
        assert all((tmp_path / str(i) / f"atexit{r}").exists() for r in range(2))
        assert not [r["sleep_pid"] for r in reports if running(r["sleep_pid"])]  # ended
        seeds += [r["seed"] for r in reports]
    assert len(set(seeds)) == 4, seeds  # as fresh processes: each rank its own random seed


def test_a_failing_rank_ends_the_launch_with_its_traceback(tmp_path):
    start = time.monotonic()
    rc, log = launch([PROBE, "--out", str(tmp_path), "--fail-rank", "1"], 2, timeout=120)
    assert rc != 0
    assert "RuntimeError: rank 1 fails on purpose" in log
    assert time.monotonic() - start < 60  # not the gloo timeout


def test_a_hung_launch_ends_at_its_timeout_with_its_ranks(tmp_path):
    with pytest.raises(LaunchError, match="took over 5 s"):
        launch([PROBE, "--out", str(tmp_path), "--hang"], 2, timeout=5)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    assert not [pid for pid in pids if running(pid)], "a hung rank outlived its launch"
    (tmp_path / "next").mkdir()
    rc, log = launch([PROBE, "--out", str(tmp_path / "next")], 2)
    assert rc == 0, log
