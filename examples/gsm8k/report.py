"""Printing and writing results: plain-text tables, atomic JSON / PNG / JSONL outputs.

Every output file is first written in full to a temporary file in its own directory and then
renamed over the target (``os.replace`` is atomic on POSIX), so an error or an interrupted run
never leaves a half-written file; :func:`write_outputs` writes several files and renames them
only once all of them are complete.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence

MIB = 1024 * 1024
# The report files each mode writes under --out (scoring writes --output instead).
REPORT_FILES = {"sft": ("sft.json", "sft.png"), "grpo": ("grpo.json", "grpo.png"),
                "distill": ("distill.json",), "score": ()}


def report_paths(out: str, mode: str) -> list[str]:
    """The paths of ``mode``'s report files under the directory ``out``."""
    return [os.path.join(out, name) for name in REPORT_FILES[mode]]


def same_path(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same file or directory: equal once symbolic links are
    resolved (also for paths not created yet), or one file under two hard links."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def output_problem(path: str, *, directory: bool = False, overwrite: bool = False) -> str | None:
    """Why ``path`` cannot be written as an output file (``directory``: a directory of files),
    or None. Refused: a file path that is a directory, a directory path that is not one, an
    existing file (or a directory holding files) unless ``overwrite``, a path whose nearest
    existing ancestor is not a directory, or one where creating a file fails (tried with a
    temporary file there, removed at once: permissions say nothing for root, nor for /proc or
    a read-only mount), and a name longer than the file system takes."""
    if directory:
        if os.path.lexists(path) and not os.path.isdir(path):
            return "exists and is not a directory"
        if os.path.isdir(path) and os.listdir(path) and not overwrite:
            return ("already holds files: give a new directory, or --overwrite to replace the "
                    "files of the same names")
    elif os.path.isdir(path):
        return "is a directory: name the file to write"
    elif os.path.lexists(path) and not overwrite:
        return "exists: give a new path, or --overwrite to replace it"
    ancestor = os.path.abspath(path if directory else os.path.dirname(os.path.abspath(path)))
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"cannot be created: {ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be written: no write permission in {ancestor}"
    return _creation_problem(ancestor, os.path.relpath(os.path.abspath(path), ancestor))


def _creation_problem(ancestor: str, rest: str) -> str | None:
    """Why ``rest`` (names below the existing directory ``ancestor``) cannot be created there,
    found by creating (and removing) a temporary file in ``ancestor``; or None."""
    try:
        longest = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    for name in rest.split(os.sep):
        if len(os.fsencode(name)) > longest:
            return f"cannot be created: the name {name[:40]}... is longer than {longest} bytes"
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=ancestor)
    except OSError as exc:
        return f"cannot be written: creating a file in {ancestor} fails ({exc.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def atomic_write(path: str, write: Callable, *, binary: bool = False) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file, then rename it into place."""
    _replace_all([(_write_temp(path, write, binary), path)])


def _write_temp(path: str, write: Callable, binary: bool) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})
                       ) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace_all(pairs: Sequence[tuple[str, str]]) -> None:
    for tmp, path in pairs:
        os.replace(tmp, path)


def write_outputs(files: Mapping[str, tuple[Callable, bool]]) -> None:
    """Write every ``path -> (write(file), binary)`` to temporary files, then rename them all.

    If any writer raises, the temporary files written so far are removed and no target changes.
    """
    done = []
    try:
        for path, (write, binary) in files.items():
            done.append((_write_temp(path, write, binary), path))
    except BaseException:
        for tmp, _ in done:
            os.unlink(tmp)
        raise
    _replace_all(done)


def json_writer(payload) -> tuple[Callable, bool]:
    """A :func:`write_outputs` entry writing ``payload`` as indented JSON (NaN as null)."""
    return (lambda f: json.dump(_finite(payload), f, indent=1, sort_keys=False), False)


def jsonl_writer(rows: Sequence[Mapping]) -> tuple[Callable, bool]:
    """A :func:`write_outputs` entry writing one JSON object per line."""

    def write(f):
        for row in rows:
            f.write(json.dumps(_finite(row)) + "\n")

    return write, False


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def table(header: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A plain-text table with aligned columns (first column left, others right)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    out = ([title] if title else []) + [line(cells[0]), rule] + [line(r) for r in cells[1:]]
    return "\n".join(out)


def mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def peak_series(comparison: Mapping) -> list[tuple[str, str]]:
    """``(label, key)`` of each peak-memory measurement of an SFT comparison's legs: the model's
    own logits dtype (``peak_bytes_per_rank``) and bf16 logits (``peak_bytes_per_rank_bf16``),
    e.g. ``[("fp32 logits", "peak_bytes_per_rank"), ("bf16 logits", ...)]``."""
    own = comparison.get("logits_dtype", "float32")
    series = [(f"{SHORT_DTYPE.get(own, own)} logits", "peak_bytes_per_rank")]
    if own != "bfloat16" and "peak_bytes_per_rank_bf16" in comparison["legs"][0]:
        series.append(("bf16 logits", "peak_bytes_per_rank_bf16"))
    return series


def _matplotlib():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    return matplotlib


def sft_figure(result: Mapping) -> Callable:
    """A PNG writer: training loss per step (test NLL before/after marked) and memory bars."""

    def write(f):
        _matplotlib()
        import matplotlib.pyplot as plt

        fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
        steps = [s["step"] for s in result["train"]]
        ax_loss.plot(steps, [s["loss"] for s in result["train"]],
                     label="train loss (answer tokens)")
        test = result["test_nll"]
        ax_loss.scatter([0, steps[-1] if steps else 0], [test["before"], test["after"]],
                        color="C3", zorder=3, label="held-out test NLL (before / after)")
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("nats / answer token")
        ax_loss.set_title("GSM8K SFT")
        ax_loss.legend()
        legs = result["comparison"]["legs"]
        ranks = len(legs[0]["peak_bytes_per_rank"])
        bars = [(label, key, r) for label, key in peak_series(result["comparison"])
                for r in range(ranks)]
        width = 0.8 / len(bars)
        for j, (label, key, r) in enumerate(bars):
            xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(legs))]
            drawn = ax_mem.bar(xs, [leg[key][r] / MIB for leg in legs], width,
                               label=f"{label}, rank {r}", color=f"C{j}")
            ax_mem.bar_label(drawn, fmt="%.0f", fontsize=7)
        ax_mem.set_xticks(range(len(legs)), [leg["name"] for leg in legs])
        ax_mem.set_ylabel("MiB")
        ax_mem.set_title("peak memory of the LM head + loss (forward + backward)")
        ax_mem.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f, format="png", dpi=110)
        plt.close(fig)

    return write


def curves_figure(rows: Sequence[Mapping], keys: Sequence[str], title: str,
                  pairs: Mapping[str, str] | None = None) -> Callable:
    """A PNG writer: one small panel per metric in ``keys`` against ``row["step"]``.

    ``pairs`` maps a key to a second key drawn in the same panel (e.g. a mismatch before and
    after a correction); the second key gets no panel of its own. With more than 6 panels they
    wrap onto rows of 6.
    """
    pairs = dict(pairs or {})
    panels = [k for k in keys if k not in pairs.values()]

    def write(f):
        _matplotlib()
        import matplotlib.pyplot as plt

        columns = min(len(panels), 6)
        lines = -(-len(panels) // columns)
        fig, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 3.2 * lines),
                                 squeeze=False)
        axes = list(axes.reshape(-1))
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes, panels):
            ax.plot(steps, [r[key] for r in rows], marker="o", label=key)
            title_of = key
            if key in pairs:
                other = pairs[key]
                ax.plot(steps, [r[other] for r in rows], marker="s", label=other)
                ax.legend(fontsize=7)
                title_of = f"{key.split(' ', 1)[1]} (before / after)"
            ax.set_title(title_of)
            ax.set_xlabel("step")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(f, format="png", dpi=110)
        plt.close(fig)

    return write
