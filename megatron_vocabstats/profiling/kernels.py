"""Kernel trials: a ``torch.profiler`` Chrome trace of a step, split into a device view (GPU
work) and a host view, each with its tracks' names; host-to-device flow arrows are in neither.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from contextlib import contextmanager

import torch

TRACE_FILE = "trace.json"
DEVICE_VIEW = "trace.device.json"
HOST_VIEW = "trace.host.json"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
FLOW_CATEGORIES = frozenset({"ac2g"})
COLLECTIVE_MARKERS = ("c10d::", "nccl", "gloo", "all_reduce", "allreduce", "all_gather",
                      "allgather", "reduce_scatter", "broadcast")


def is_device_event(event: Mapping) -> bool:
    """Whether a Chrome trace event is GPU work."""
    return event.get("cat", "") in DEVICE_CATEGORIES


def split_trace(trace: Mapping) -> tuple[dict, dict]:
    """``(device_view, host_view)`` of a Chrome trace dict; the input is not modified."""
    events = trace.get("traceEvents", [])
    timed = [e for e in events if e.get("ph") != "M" and e.get("cat", "") not in FLOW_CATEGORIES]
    device = [e for e in timed if is_device_event(e)]
    host = [e for e in timed if not is_device_event(e)]
    meta = [e for e in events if e.get("ph") == "M"]

    def view(chosen):
        pids = {e.get("pid") for e in chosen}
        out = {k: v for k, v in trace.items() if k != "traceEvents"}
        out["traceEvents"] = [e for e in meta if e.get("pid") in pids] + chosen
        return out

    return view(device), view(host)


def _totals(events, top: int) -> list[dict]:
    by_name: dict[str, list] = {}
    for e in events:
        entry = by_name.setdefault(e.get("name", "?"), [0, 0.0])
        entry[0] += 1
        entry[1] += float(e.get("dur", 0.0))
    rows = [{"name": n, "count": c, "total_us": round(t, 3)} for n, (c, t) in by_name.items()]
    rows.sort(key=lambda r: (-r["total_us"], r["name"]))
    return rows[:top]


def _span(events) -> float:
    if not events:
        return 0.0
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events)
    return round(end - start, 3)


def trace_stats(trace: Mapping, top: int = 15) -> dict:
    """Host and device numbers (us) of a Chrome trace's complete (``"ph": "X"``) events: counts,
    spans, device busy time (overlaps counted twice), and the ``top`` operators (inclusive time),
    collectives and kernels by total duration."""
    complete = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    device = [e for e in complete if is_device_event(e)]
    host = [e for e in complete if not is_device_event(e)]
    ops = [e for e in host if e.get("cat") == "cpu_op"]
    kernels = [e for e in device if e.get("cat") == "kernel"]
    collectives = [e for e in ops
                   if any(m in e.get("name", "").lower() for m in COLLECTIVE_MARKERS)]
    return {
        "host": {"events": len(host), "operators": len(ops), "span_us": _span(host),
                 "top_operators": _totals(ops, top),
                 "collectives": _totals(collectives, top)},
        "device": {"events": len(device), "kernels": len(kernels), "span_us": _span(device),
                   "busy_us": round(sum(float(e.get("dur", 0.0)) for e in kernels), 3),
                   "top_kernels": _totals(kernels, top)},
    }


def write_views(trial_dir: str) -> None:
    """Write the two views of ``trial_dir``'s ``trace.json`` beside it."""
    with open(os.path.join(trial_dir, TRACE_FILE)) as f:
        trace = json.load(f)
    for name, view in zip((DEVICE_VIEW, HOST_VIEW), split_trace(trace)):
        with open(os.path.join(trial_dir, name), "w") as f:
            json.dump(view, f)


@contextmanager
def kernel_step(trial_dir: str, step: int):
    """Profile one step (CPU and CUDA; shapes, but no memory or stacks, which would shift the
    kernel timeline) into ``trial_dir``'s ``trace.json`` and its views."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(trial_dir, exist_ok=True)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        with torch.profiler.record_function(f"vocabstats profile step {step}"):
            yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(trial_dir, TRACE_FILE))
    write_views(trial_dir)
