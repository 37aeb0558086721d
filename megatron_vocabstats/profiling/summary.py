"""Per-trial ``summary.json`` / ``summary.md`` (and ``timeline.png`` for memory trials), from the
trial directory's raw files only and without timestamps: regenerating them gives identical bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from . import kernels, memory

TRIAL_FILE = "trial.json"
TRIAL_KEYS = ("trial", "kind", "rank", "step")
RAW_FILES = {"memory": memory.RAW_FILE, "kernels": kernels.TRACE_FILE}
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
TIMELINE_PNG = "timeline.png"
MODULE_DEPTH = 3  # module rows shown in summary.md: names with at most this many dots
TOP = 15
MIB = 1024 * 1024


def _load(path: str):
    """The JSON in ``path``; ``ValueError`` naming the file if it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); was the run interrupted while "
                         "writing it?") from None


def mib(n: float) -> str:
    """Bytes as ``"1,234.56 MiB"``."""
    return f"{n / MIB:,.2f} MiB"


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(map(str, header)) + " |",
             "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_summary(meta: Mapping, raw: Mapping) -> dict:
    """The summary of a memory trial: the peak, what is alive at it, phase peaks, modules."""
    tl = raw["timeline"]
    total = tl["total"]
    lengths = {"x": len(tl["x"]), "total": len(total), "phase": len(tl["phase"]),
               **{f"by_kind[{k!r}]": len(tl["by_kind"][k]) for k in raw["kinds"]}}
    if len(set(lengths.values())) != 1 or not total:
        raise ValueError(f"the timeline's lists differ in length (or are empty): {lengths}")
    i = max(range(len(total)), key=total.__getitem__)
    by_kind = sorted(({"kind": k, "bytes": tl["by_kind"][k][i]} for k in raw["kinds"]),
                     key=lambda r: (-r["bytes"], r["kind"]))
    phases: dict[str, int] = {}
    for p, t in zip(tl["phase"], total):
        phases[p] = max(phases.get(p, 0), t)
    return {
        **dict(meta),
        "backend": raw["backend"],
        "device": raw.get("device"),
        "peak_bytes": total[i],
        "peak_at": {"x": tl["x"][i], "x_label": tl["x_label"], "phase": tl["phase"][i]},
        "instrument_peak_bytes": raw.get("reported_peak"),
        "start_bytes": total[0],
        "end_bytes": total[-1],
        "timeline_samples": tl["samples"],
        "at_peak_by_kind": by_kind,
        "largest_at_peak": raw.get("largest_at_peak", [])[:TOP],
        "phase_peak_bytes": phases,
        "modules": raw.get("modules", []),
        "history_wrapped": bool(raw.get("history_wrapped", False)),
        "unmatched_frees": raw.get("unmatched_frees", 0),
    }


def memory_markdown(s: Mapping) -> str:
    at = s["peak_at"]
    out = [f"# {s['trial']}: memory of step {s['step']} on rank {s['rank']}", "",
           f"Backend: {s['backend']} ({s.get('device')}). Peak **{mib(s['peak_bytes'])}** "
           f"({s['peak_bytes']} bytes) in {at['phase']} at {at['x_label']} {at['x']}; "
           f"{mib(s['start_bytes'])} at the start of the step, {mib(s['end_bytes'])} at its end "
           f"({s['timeline_samples']} timeline samples).", ""]
    if s["history_wrapped"]:
        out += [f"**Incomplete**: the allocator history wrapped during the step, so its first "
                f"actions are missing ({s['unmatched_frees']} frees of unseen blocks): rerun "
                "with a larger --max-entries.", ""]
    out += ["## Alive at the peak, by kind", "",
            md_table(["kind", "MiB", "share"],
                     [[r["kind"], f"{r['bytes'] / MIB:,.2f}",
                       f"{100 * r['bytes'] / max(s['peak_bytes'], 1):.1f}%"]
                      for r in s["at_peak_by_kind"]])]
    if s["largest_at_peak"]:
        out += ["", "## Largest blocks alive at the peak", "",
                md_table(["MiB", "kind", "allocated at"],
                         [[f"{r['bytes'] / MIB:,.2f}", r["kind"], f"`{r['where']}`"]
                          for r in s["largest_at_peak"]])]
    out += ["", "## Peak by phase", "",
            md_table(["phase", "peak MiB"], [[p, f"{v / MIB:,.2f}"]
                                             for p, v in s["phase_peak_bytes"].items()])]
    modules = [m for m in s["modules"] if m["name"].count(".") <= MODULE_DEPTH]
    if modules:
        out += ["", f"## Modules (MemTracker, depth <= {MODULE_DEPTH}; total alive at the "
                "module's forward/backward peak, and what it holds or exchanges)", "",
                md_table(["module", "peak fwd MiB", "peak bwd MiB", "params MiB", "inputs MiB",
                          "outputs MiB"],
                         [[f"`{m['name']}`", f"{m['peak_forward'] / MIB:,.2f}",
                           f"{m['peak_backward'] / MIB:,.2f}", f"{m['parameters'] / MIB:,.2f}",
                           f"{m['inputs'] / MIB:,.2f}", f"{m['outputs'] / MIB:,.2f}"]
                          for m in modules])]
    return "\n".join(out) + "\n"


PHASE_COLOURS = {"forward": "#e8f0fb", "backward": "#fbeee8", "optimizer": "#eefbe8"}


def _runs(x: Sequence[float], phase: Sequence[str]) -> list[tuple[float, float, str]]:
    """``(first x, last x, phase)`` of each run of samples in a shaded phase."""
    runs, first = [], 0
    for i in range(1, len(phase) + 1):
        if i == len(phase) or phase[i] != phase[first]:
            if phase[first] in PHASE_COLOURS:
                runs.append((x[first], x[i - 1], phase[first]))
            first = i
    return runs


def require_matplotlib():
    """The ``matplotlib`` module; ``ValueError`` if it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the memory timeline (timeline.png) needs matplotlib: pip install "
                         "matplotlib (or the package's [examples] extra)") from None
    return matplotlib


def timeline_figure(raw: Mapping, s: Mapping, path: str) -> None:
    """Write to ``path`` the memory by kind over the step, phases shaded, the peak marked."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = raw["timeline"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for start, end, phase in _runs(tl["x"], tl["phase"]):
        ax.axvspan(start, end, color=PHASE_COLOURS.get(phase, "white"), alpha=0.5, linewidth=0)
        ax.text((start + end) / 2, 1.0, phase, transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7)
    ax.stackplot(tl["x"], *[[v / MIB for v in tl["by_kind"][k]] for k in raw["kinds"]],
                 labels=raw["kinds"], alpha=0.85)
    ax.plot(tl["x"], [v / MIB for v in tl["total"]], color="black", linewidth=0.8, label="total")
    ax.axhline(s["peak_bytes"] / MIB, color="red", linestyle="--", linewidth=0.8,
               label=f"peak {mib(s['peak_bytes'])}")
    ax.set_xlabel(tl["x_label"])
    ax.set_ylabel("MiB alive")
    ax.set_title(f"{s['trial']}: step {s['step']}, rank {s['rank']} ({s['backend']})", pad=14)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def kernel_summary(meta: Mapping, trace: Mapping) -> dict:
    return {**dict(meta), **kernels.trace_stats(trace, TOP)}


def kernel_markdown(s: Mapping) -> str:
    host, device = s["host"], s["device"]

    def rows(items):
        return [[f"`{r['name']}`", r["count"], f"{r['total_us'] / 1000:,.3f}"] for r in items]

    out = [f"# {s['trial']}: kernels of step {s['step']} on rank {s['rank']}", "",
           f"Host: {host['operators']} operators, {host['events']} events over "
           f"{host['span_us'] / 1000:,.3f} ms. Device: {device['kernels']} kernels, busy "
           f"{device['busy_us'] / 1000:,.3f} ms over {device['span_us'] / 1000:,.3f} ms.", "",
           f"Open `{kernels.TRACE_FILE}` (or `{kernels.DEVICE_VIEW}`, `{kernels.HOST_VIEW}`) in "
           "https://ui.perfetto.dev.", "",
           "## Top host operators (inclusive time)", "",
           md_table(["operator", "calls", "total ms"], rows(host["top_operators"]))]
    if host["collectives"]:
        out += ["", "## Collectives", "",
                md_table(["operator", "calls", "total ms"], rows(host["collectives"]))]
    if device["top_kernels"]:
        out += ["", "## Top device kernels", "",
                md_table(["kernel", "launches", "total ms"], rows(device["top_kernels"]))]
    return "\n".join(out) + "\n"


def _is_trial_record(meta) -> bool:
    """Whether ``trial.json`` holds a trial record."""
    return (isinstance(meta, dict) and all(k in meta for k in TRIAL_KEYS)
            and isinstance(meta["trial"], str) and isinstance(meta["kind"], str)
            and meta["kind"] in RAW_FILES
            and all(isinstance(meta[k], int) and not isinstance(meta[k], bool)
                    for k in ("rank", "step")))


def write_trial_summary(trial_dir: str) -> dict:
    """(Re)write a trial's summaries, ``timeline.png`` or the trace views; returns the summary.
    ``ValueError`` naming the file if ``trial.json`` or the raw file is missing or malformed."""
    meta_path = os.path.join(trial_dir, TRIAL_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{trial_dir} is not a trial directory ({TRIAL_FILE} missing)")
    meta = _load(meta_path)
    if not _is_trial_record(meta):
        raise ValueError(f"{meta_path}: not a trial record (needs {', '.join(TRIAL_KEYS)}, "
                         f"kind one of {', '.join(RAW_FILES)}, trial a name, rank and step ints)")
    raw_name = RAW_FILES[meta["kind"]]
    raw_path = os.path.join(trial_dir, raw_name)
    if not os.path.isfile(raw_path):
        raise ValueError(f"{trial_dir}: {raw_name} missing (the trial did not finish)")
    raw = _load(raw_path)
    try:
        if meta["kind"] == "memory":
            s = memory_summary(meta, raw)
            text = memory_markdown(s)
            timeline_figure(raw, s, os.path.join(trial_dir, TIMELINE_PNG))
        else:
            s = kernel_summary(meta, raw)
            text = kernel_markdown(s)
            kernels.write_views(trial_dir)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        if "matplotlib" in str(exc):  # (require_matplotlib's: not about the file)
            raise
        raise ValueError(f"{raw_path} does not have the layout of a {meta['kind']} trial "
                         f"({type(exc).__name__}: {exc})") from None
    with open(os.path.join(trial_dir, SUMMARY_JSON), "w") as f:
        json.dump(s, f, indent=1)
    with open(os.path.join(trial_dir, SUMMARY_MD), "w") as f:
        f.write(text)
    return s
