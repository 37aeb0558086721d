"""NCCL side of the GPU multi-process tests: the unit harness (``tests/unit/dist/_harness.py``:
its case registry, result files and gloo default group) with one GPU per rank, every case given
an NCCL group over all ranks instead of the gloo one.

``tests/gpu/test_parity_dist.py`` launches a case script with torchrun; each rank binds
``cuda:LOCAL_RANK``, and its results go to ``<out>/rank<r>.json`` as in the unit suite.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
for path in (os.path.join(ROOT, "tests", "unit"), os.path.join(ROOT, "tests", "unit", "dist"),
             os.path.join(ROOT, "tests", "gpu")):
    if path not in sys.path:
        sys.path.insert(0, path)
import _harness  # noqa: E402
from _harness import Cases, Skip  # noqa: E402,F401  (re-exported for the case scripts)
from _suite import exit_with_launcher  # noqa: E402

# A rank stuck in a collective (another rank failed before it) is aborted by NCCL's watchdog
# after this long; the pytest side then reports the missing results.
NCCL_TIMEOUT = datetime.timedelta(seconds=60)


def device() -> torch.device:
    """This rank's GPU: ``cuda:LOCAL_RANK``."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


@functools.cache
def nccl_group() -> dist.ProcessGroup:
    """An NCCL group over all ranks, made once (by every rank, in its first case)."""
    return dist.new_group(backend="nccl", timeout=NCCL_TIMEOUT)


def on_nccl(cases: Cases) -> Cases:
    """The same cases, each called with :func:`nccl_group` in place of the harness's group."""
    return Cases({name: functools.partial(lambda fn, _group: fn(nccl_group()), fn)
                  for name, fn in cases.items()})


def main(cases: Cases) -> None:
    exit_with_launcher()
    torch.cuda.set_device(device())
    _harness.main(on_nccl(cases))
