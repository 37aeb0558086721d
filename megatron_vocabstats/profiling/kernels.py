"""Kernel trials: a ``torch.profiler`` Chrome trace of a step, split into device and host views.

``trace.json`` is what ``torch.profiler.profile.export_chrome_trace`` writes (Kineto's Chrome
trace format: ``{"traceEvents": [...], ...}``); the views keep the same format, so each opens in
Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``:

- ``trace.device.json``: GPU work only (categories in :data:`DEVICE_CATEGORIES`: kernels,
  memcpy/memset, and the GPU side of ``record_function`` ranges) and the process/thread names
  of the tracks they sit on;
- ``trace.host.json``: everything else (operators, Python functions, CUDA runtime calls,
  annotations) with its track names; the host-to-device flow arrows (category ``ac2g``) are in
  neither view, since their ends lie in different views.
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
    """Whether a Chrome trace event is GPU work (its ``cat`` in :data:`DEVICE_CATEGORIES`)."""
    return event.get("cat", "") in DEVICE_CATEGORIES


def split_trace(trace: Mapping) -> tuple[dict, dict]:
    """``(device_view, host_view)`` of a Chrome trace dict; see the module docstring.

    Timed and instant events go to one view by category; metadata events (``"ph": "M"``:
    process and thread names) go to each view that has events on that process. Top-level keys
    other than ``traceEvents`` are copied to both. The input is not modified.
    """
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
    """Summary numbers of a Chrome trace, from complete (``"ph": "X"``) events.

    Host: operator count, the span from first to last event (us), the ``top`` operators
    (category ``cpu_op``) by total inclusive duration (nested operators count in their parents
    too), and the collectives among them. Device: kernel count, busy time (sum of durations,
    overlaps counted twice), span, and the ``top`` kernels by total duration.
    """
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
    """Write ``trace.device.json`` and ``trace.host.json`` from ``trace.json`` in ``trial_dir``."""
    with open(os.path.join(trial_dir, TRACE_FILE)) as f:
        trace = json.load(f)
    for name, view in zip((DEVICE_VIEW, HOST_VIEW), split_trace(trace)):
        with open(os.path.join(trial_dir, name), "w") as f:
            json.dump(view, f)


@contextmanager
def kernel_step(trial_dir: str, step: int):
    """Profile one step with ``torch.profiler`` (CPU, plus CUDA when available) and export
    ``trace.json`` and its views into ``trial_dir``. Shapes are recorded; memory and stacks
    are not (they would slow the step and shift the kernel timeline)."""
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
