"""Measurement and profiling tools: the peak-memory and collective-count helpers of the tests
and benchmarks here; the submodules record and analyse a profile run (docs/profiling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .kernels import split_trace, trace_stats
from .memory import classify_frames, replay_trace
from .postprocess import summarize
from .ranks import default_ranks, parse_ranks, parse_steps, parse_trials

__all__ = ["COLLECTIVES", "classify_frames", "count_collectives", "default_ranks",
           "parse_ranks", "parse_steps", "parse_trials", "peak_memory_bytes", "replay_trace",
           "split_trace", "summarize", "trace_stats"]

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier")


@contextmanager
def count_collectives():
    """Yield the list of ``torch.distributed`` collectives called in the block (by name; only
    calls through the module's attributes are seen)."""
    calls: list[str] = []
    saved = {}
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue
        saved[name] = original

        def wrapper(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def peak_memory_bytes(fn: Callable[[], object], *external: object, device=None) -> int:
    """Peak bytes of tensors alive while ``fn()`` runs: on CPU by ``MemTracker``, with
    ``external`` (tensors, modules, optimizers) registered; on CUDA ``max_memory_allocated``."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if external:
        tracker.track_external(*external)
    with tracker:
        fn()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])
