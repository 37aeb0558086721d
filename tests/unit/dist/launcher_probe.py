"""A torchrun script that reports what its rank was given; run by tests/unit/test_dist_launcher.py.

``--out DIR``: each rank writes ``DIR/rank<r>.json`` with its torchrun variables, ``__name__``,
``sys.argv``, ``sys.path[0]``, whether a mark left by an earlier launch is visible, the sum of
the ranks over a gloo all-reduce, its torch seed, ``LAUNCHER_PROBE_VAR`` and what stdin reads;
at exit it writes ``DIR/atexit<r>``. ``--leave-child``: it also starts a ``sleep`` that it
leaves running and reports its pid. ``--fail-rank
R``: rank R raises after the process group is up, while the others wait in a barrier.
``--hang``: every rank writes its pid, then sleeps.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--leave-child", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.hang:
        with open(os.path.join(args.out, f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    dist.init_process_group("gloo")
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    dist.barrier()
    report = {
        "env": {k: os.environ.get(k) for k in TORCHRUN_VARIABLES},
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "mark_seen": hasattr(torch, "_launcher_probe_mark"),
        "sum": total.item(),
    }
    torch._launcher_probe_mark = True  # a later launch must not see it
    report["seed"] = str(torch.initial_seed())
    report["var"] = os.environ.get("LAUNCHER_PROBE_VAR")
    report["stdin"] = sys.stdin.read()
    if args.leave_child:
        report["sleep_pid"] = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL).pid
    atexit.register(lambda: open(os.path.join(args.out, f"atexit{rank}"), "w").close())
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
