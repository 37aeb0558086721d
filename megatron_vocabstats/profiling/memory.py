"""Memory trials: what is alive at the peak of a training step, by kind, with a timeline. On CPU
``MemTracker`` is sampled after every operator; on CUDA the allocator's history is replayed
(:func:`replay_trace`); both write one raw record (:func:`raw_record`). docs/profiling.md.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager

import torch

RAW_FILE = "memory.raw.json"
SNAPSHOT_FILE = "snapshot.pickle"
MAX_TIMELINE_POINTS = 20000

# MemTracker's reference types, named as in the summaries.
MEMTRACKER_KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
                    "Activation": "activations", "Temp": "backward temporaries",
                    "Optstate": "optimizer state", "Other": "other"}

# Kinds of CUDA blocks, (kind, function names, path parts) matched against the allocating stack's
# Python frames by classify_frames.
KIND_RULES: tuple[tuple[str, frozenset, tuple], ...] = (
    ("logits and their gradients",
     frozenset({"_postprocess", "output_layer", "compute_language_model_loss",
                "vocab_parallel_cross_entropy"}),
     ("megatron_vocabstats/ops/", "megatron_vocabstats/megatron/model.py", "cross_entropy")),
    ("optimizer state", frozenset({"step", "_init_group"}), ("torch/optim/",)),
    ("parameters", frozenset({"build_model", "load_checkpoint", "_initialize_affine_weight_cpu"}),
     ()),
    ("gradients", frozenset({"backward", "backward_step", "finalize_grads"}),
     ("torch/autograd/",)),
    ("activations", frozenset({"forward", "forward_step"}), ()),
)
WORKSPACE = "workspace"
# A block with no Python frame: the backward of built-in operators, which the autograd engine
# runs on its own device thread (pytorch/pytorch#82146, #124784).
NO_STACK = "backward, no Python stack"
CUDA_KINDS = tuple(rule[0] for rule in KIND_RULES) + (NO_STACK, WORKSPACE)


def classify_frames(frames: Sequence[Mapping]) -> str:
    """The kind of an allocation from its stack (``[{"filename", "line", "name"}, ...]``): the
    first of :data:`KIND_RULES` a frame matches, :data:`NO_STACK` or :data:`WORKSPACE`."""
    if not frames:
        return NO_STACK
    for kind, names, paths in KIND_RULES:
        for frame in frames:
            filename = frame.get("filename", "").replace("\\", "/")
            if frame.get("name") in names or any(p in filename for p in paths):
                return kind
    return WORKSPACE


def _where(frames: Sequence[Mapping]) -> str:
    """The innermost frame outside torch itself, as ``file:line function``."""
    for frame in frames:
        filename = frame.get("filename", "").replace("\\", "/")
        if "/torch/" not in filename and not filename.startswith("??"):
            return f"{filename}:{frame.get('line', 0)} {frame.get('name', '?')}"
    return "(torch internals)" if frames else "(no stack recorded)"


def thin(n: int, keep: Iterable[int], max_points: int = MAX_TIMELINE_POINTS) -> list[int]:
    """Sorted indices of ``n`` samples: every k-th up to ~``max_points``, plus ``keep``."""
    stride = max(1, -(-n // max_points))
    return sorted(set(range(0, n, stride)) | {i for i in keep if 0 <= i < n})


def raw_record(*, backend: str, x: Sequence[float], x_label: str, phase: Sequence[str],
               by_kind: Mapping[str, Sequence[int]], largest: Sequence[Mapping] = (),
               modules: Sequence[Mapping] = (), reported_peak: int | None = None,
               extra: Mapping | None = None) -> dict:
    """The raw memory record of one trial (``memory.raw.json``). ``by_kind[k][i]``: bytes of
    kind ``k`` alive at sample ``i``; ``largest``: the blocks alive at the peak. The timeline is
    thinned keeping the last sample and each phase's maximum, so the end and peaks stay exact."""
    kinds = list(by_kind)
    total = [sum(by_kind[k][i] for k in kinds) for i in range(len(x))]
    phase_peak: dict[str, int] = {}
    for i, t in enumerate(total):
        if phase[i] not in phase_peak or t > total[phase_peak[phase[i]]]:
            phase_peak[phase[i]] = i
    keep = thin(len(total), [len(total) - 1, *phase_peak.values()])
    return {
        "backend": backend,
        "units": "bytes",
        "kinds": kinds,
        "timeline": {"x": [x[i] for i in keep], "x_label": x_label,
                     "phase": [phase[i] for i in keep], "total": [total[i] for i in keep],
                     "by_kind": {k: [by_kind[k][i] for i in keep] for k in kinds},
                     "samples": len(total)},
        "reported_peak": reported_peak,
        "largest_at_peak": list(largest),
        "modules": list(modules),
        **(dict(extra) if extra else {}),
    }


def write_raw(trial_dir: str, raw: Mapping) -> None:
    """Write ``raw`` as ``trial_dir/memory.raw.json``."""
    os.makedirs(trial_dir, exist_ok=True)
    with open(os.path.join(trial_dir, RAW_FILE), "w") as f:
        json.dump(raw, f)


def _memtracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class TimelineMemTracker(MemTracker):
        """``MemTracker`` sampling ``(phase, {kind: bytes})`` on entry and after each operator,
        so that its peak is the samples' maximum."""

        def __init__(self, device: torch.device):
            super().__init__()
            self.device = device
            self.samples: list[tuple[str, dict[str, int]]] = []

        def _phase(self) -> str:
            if self._in_opt:
                return "optimizer"
            if self._mod_tracker.is_bw:
                return "backward"
            return "forward" if set(self._mod_tracker.parents) - {"Global"} else "outside modules"

        def _sample(self, phase: str) -> None:
            snap = self._curr_mem_snap.get(self.device, {})
            self.samples.append((phase, {getattr(k, "value", k): v for k, v in snap.items()
                                         if getattr(k, "value", k) in MEMTRACKER_KINDS}))

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            self._sample(self._phase())

        def __enter__(self):
            first = self._depth == 0
            out = super().__enter__()
            if first:
                self._sample("start")
            return out

    return TimelineMemTracker


def _snapshot_total(snaps: Sequence[Mapping], device: torch.device) -> int:
    """Largest ``Total`` of a module's snapshots on ``device``; 0 if none."""
    return max((int(s.get(device, {}).get("Total", 0)) for s in snaps), default=0)


def memtracker_modules(tracker, device: torch.device) -> list[dict]:
    """Per-module rows of a MemTracker in call order: parameter, buffer, input and output bytes,
    and the device total at its forward and backward peaks."""
    from torch.distributed._tools.mem_tracker import _ModState

    rows = []
    for stats in tracker.memory_tracking.values():
        rows.append({
            "name": stats.mod_fqn,
            "parameters": int(getattr(stats, "parameter_mem", 0)),
            "buffers": int(getattr(stats, "buffer_mem", 0)),
            "inputs": int(getattr(stats, "input_mem", 0)),
            "outputs": int(getattr(stats, "output_mem", 0)),
            "peak_forward": _snapshot_total(stats.snapshots.get(_ModState.PEAK_FW, []), device),
            "peak_backward": _snapshot_total(stats.snapshots.get(_ModState.PEAK_BW, []), device),
        })
    return rows


def memtracker_raw(tracker, device: torch.device) -> dict:
    """The raw record (:func:`raw_record`) of a finished :class:`TimelineMemTracker`."""
    kinds = list(MEMTRACKER_KINDS)
    by_kind = {MEMTRACKER_KINDS[k]: [s.get(k, 0) for _, s in tracker.samples] for k in kinds}
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    return raw_record(backend="memtracker", x=list(range(len(tracker.samples))),
                      x_label="operator", phase=[p for p, _ in tracker.samples],
                      by_kind=by_kind, modules=memtracker_modules(tracker, device),
                      reported_peak=int(peak.get("Total", 0)),
                      extra={"device": str(device)})


@contextmanager
def cpu_memory_step(trial_dir: str, model, optimizer, device: torch.device):
    """Track one step under MemTracker and write the raw record; of the tensors older than the
    step it sees the model, the optimizer and the ops' cached chunk buffers only."""
    from ..ops.workspace import WORKSPACE

    tracker = _memtracker_class()(device)
    tracker.track_external(model, optimizer, *WORKSPACE.free_buffers())
    with tracker, warnings.catch_warnings():
        # ModTracker's notice for backward hooks of modules already collected; harmless here.
        warnings.filterwarnings("ignore", message="Module is None")
        yield
    write_raw(trial_dir, memtracker_raw(tracker, device))


def live_blocks(snapshot: Mapping, device: int) -> list[dict]:
    """``[{"addr", "size", "frames"}]`` of the blocks in use on ``device`` in a ``_snapshot()``."""
    out = []
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                out.append({"addr": block["address"], "size": block["size"],
                            "frames": block.get("frames", [])})
    return out


def events_after(before: Mapping, after: Mapping, device: int) -> list[dict]:
    """The allocator actions of ``after``'s trace later than ``before``'s last."""
    old = before.get("device_traces", [[]] * (device + 1))[device]
    new = after.get("device_traces", [[]] * (device + 1))[device]
    if old and all("time_us" in e for e in old[-1:]) and all("time_us" in e for e in new):
        last = old[-1]["time_us"]
        return [e for e in new if e["time_us"] > last]
    return list(new[len(old):])


def history_wrapped(before: Mapping, after: Mapping, device: int) -> bool:
    """Whether the ring buffer lost actions taken after ``before``; False without ``time_us``."""
    old = before.get("device_traces", [[]] * (device + 1))[device]
    new = after.get("device_traces", [[]] * (device + 1))[device]
    if not old or not new or "time_us" not in old[-1] or "time_us" not in new[0]:
        return False
    return new[0]["time_us"] > old[-1]["time_us"]


def replay_trace(baseline: Sequence[Mapping], events: Sequence[Mapping]) -> dict:
    """The raw record from the blocks alive at the start and the trace entries after: ``alloc``
    adds a block, ``free_completed`` (not ``free_requested``: a block used on another stream is
    in use until then) removes it. ``x``: us since the first action (else its index)."""
    live: dict[int, tuple[int, str, list]] = {}
    sums = dict.fromkeys(CUDA_KINDS, 0)
    for block in baseline:
        kind = classify_frames(block["frames"])
        live[block["addr"]] = (block["size"], kind, block["frames"])
        sums[kind] += block["size"]
    series = {k: [v] for k, v in sums.items()}
    x, phase = [0.0], ["start"]
    t0 = float(events[0].get("time_us", 0)) if events else 0.0
    best, best_live, unmatched = sum(sums.values()), dict(live), 0
    for i, entry in enumerate(events):
        action = entry.get("action")
        if action == "alloc":
            kind = classify_frames(entry.get("frames", []))
            live[entry["addr"]] = (entry["size"], kind, entry.get("frames", []))
            sums[kind] += entry["size"]
        elif action == "free_completed":
            if entry["addr"] not in live:
                unmatched += 1
                continue
            size, kind, _ = live.pop(entry["addr"])
            sums[kind] -= size
        else:
            continue
        for k, v in sums.items():
            series[k].append(v)
        x.append(float(entry["time_us"]) - t0 if "time_us" in entry else float(i + 1))
        phase.append("step")
        total = sum(sums.values())
        if total > best:
            best, best_live = total, dict(live)
    largest = sorted(({"bytes": size, "kind": kind, "where": _where(frames)}
                      for size, kind, frames in best_live.values()),
                     key=lambda item: -item["bytes"])
    return raw_record(backend="cuda_snapshot", x=x,
                      x_label="time since the step's first allocator action (us)"
                      if events and "time_us" in events[0] else "allocator action",
                      phase=phase, by_kind=series, largest=largest[:50],
                      extra={"unmatched_frees": unmatched, "live_at_peak": len(best_live)})


class CudaMemoryRecorder:
    """One rank's CUDA allocator history: :meth:`start`, :meth:`step` per step, :meth:`stop`."""

    def __init__(self, max_entries: int = 1_000_000):
        self.max_entries = max_entries

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    @contextmanager
    def step(self, trial_dir: str):
        """Around one step: write ``snapshot.pickle`` and ``memory.raw.json``."""
        device = torch.cuda.current_device()
        torch.cuda.synchronize()
        before = torch.cuda.memory._snapshot()
        yield
        torch.cuda.synchronize()
        os.makedirs(trial_dir, exist_ok=True)
        path = os.path.join(trial_dir, SNAPSHOT_FILE)
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            after = pickle.load(f)
        raw = replay_trace(live_blocks(before, device), events_after(before, after, device))
        raw["history_wrapped"] = history_wrapped(before, after, device)
        raw["device"] = f"cuda:{device}"
        raw["allocated_after_step"] = torch.cuda.memory_allocated()
        write_raw(trial_dir, raw)
