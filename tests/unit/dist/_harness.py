"""In-process side of the multi-process tests: run registered cases on every rank, record results.

A case is ``fn(group)`` on a gloo process group spanning all ranks; it passes by returning,
skips by raising :class:`Skip`, fails by raising anything else. Each rank writes
``{case: "ok" | "skip: why" | "FAIL: traceback"}`` to ``<out>/rank<r>.json``; the pytest side
(``tests/unit/conftest.py``) launches the script with torchrun and reports case by case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

class Cases(dict):
    """A case registry for one script: ``CASES = Cases()`` then ``@CASES.register``."""

    def register(self, fn):
        self[fn.__name__] = fn
        return fn


class Skip(Exception):
    """Raised by a case that does not apply to this world size."""


def needs_tp2(group) -> tuple[int, int]:
    """``(rank, size)`` of ``group``; :class:`Skip` when it has fewer than 2 ranks."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    if tp < 2:
        raise Skip("needs tp >= 2")
    return rank, tp


def main(cases: Cases, *, timeout_s: float = 540.0) -> None:
    """Run ``cases`` on every rank (see the module docstring). ``timeout_s``: the gloo timeout of
    every collective, the bound on a hang (a script whose cases must never wait long passes a
    short one, so that a regression fails fast instead of holding CI)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    # The timeout bounds a hang (a case that fails on one rank before a collective), but must
    # not be met by a rank that is merely slow: on a loaded 2-core machine rank 0 of the profile
    # case spent over 5 minutes writing and re-rendering its summaries while rank 1 waited in
    # the barrier. Under pytest-timeout's 600 s per test (which bounds the whole launch), so that
    # a real hang still ends with the collective's traceback.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    rank = dist.get_rank()
    results = {}
    for name, fn in cases.items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(1234)
        try:
            fn(group)
            results[name] = "ok"
        except Skip as exc:
            results[name] = f"skip: {exc}"
        except Exception:  # noqa: BLE001 - every failure is reported to pytest
            results[name] = "FAIL: " + traceback.format_exc()
        dist.barrier()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
