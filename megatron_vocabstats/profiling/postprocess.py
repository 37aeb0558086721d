"""``python -m megatron_vocabstats.profiling summarize OUT``: rewrite every trial's summaries
from the raw files only (a copied directory, an interrupted run, changed summary code).
"""

from __future__ import annotations

import os

from . import summary

INDEX_MD = "index.md"


def trial_dirs(out_dir: str) -> list[str]:
    """Subdirectories of ``out_dir`` holding a ``trial.json``, sorted by name."""
    return sorted(os.path.join(out_dir, d) for d in os.listdir(out_dir)
                  if os.path.isfile(os.path.join(out_dir, d, summary.TRIAL_FILE)))


def write_index(out_dir: str, summaries: list[dict]) -> None:
    """``OUT/index.md``: one row per trial with its headline number."""
    rows = []
    for s in summaries:
        if s["kind"] == "memory":
            head = f"peak {summary.mib(s['peak_bytes'])} in {s['peak_at']['phase']}"
        else:
            head = (f"{s['host']['operators']} host ops over {s['host']['span_us'] / 1000:,.1f} "
                    f"ms; {s['device']['kernels']} kernels")
        rows.append([f"[{s['trial']}]({s['trial']}/{summary.SUMMARY_MD})", s["kind"], s["rank"],
                     s["step"], head])
    text = "# Profile trials\n\n" + summary.md_table(["trial", "kind", "rank", "step", "headline"],
                                                     rows) + "\n"
    with open(os.path.join(out_dir, INDEX_MD), "w") as f:
        f.write(text)


def summarize(out_dir: str) -> list[dict]:
    """Rewrite every trial's summaries in ``out_dir`` and ``index.md``; returns the summaries.
    ``ValueError`` if it holds no trial, or (after writing the rest) naming each broken one."""
    if not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is not a directory")
    dirs = trial_dirs(out_dir)
    if not dirs:
        raise ValueError(f"{out_dir} holds no trial (no */{summary.TRIAL_FILE}); give the --out "
                         "directory of a profile run")
    summaries, broken = [], []
    for d in dirs:
        try:
            summaries.append(summary.write_trial_summary(d))
        except ValueError as exc:
            broken.append(str(exc))
    if summaries:
        write_index(out_dir, summaries)
    if broken:
        raise ValueError(f"{len(broken)} of {len(dirs)} trial(s) in {out_dir} could not be "
                         f"summarised ({len(summaries)} were, and are in {INDEX_MD}):\n  "
                         + "\n  ".join(broken))
    return summaries
