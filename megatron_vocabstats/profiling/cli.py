"""Command line of the trace analysis: ``python -m megatron_vocabstats.profiling summarize OUT``
(docs/profiling.md); exit status 0, or 2 with ``error: ...`` on stderr for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..version_check import is_rank0
from . import postprocess

PROG = "python -m megatron_vocabstats.profiling"
CONSOLE_PROG = "vocabstats-profile"  # the console script of pyproject.toml
RUN_MOVED = ("the run command moved out of the plugin to the example it profiles: from the "
             "repository root, python -m examples.gsm8k.profile run --out OUT ... -- sft ... "
             "(docs/profiling.md)")


def add_summarize_command(commands) -> None:
    """Add ``summarize OUT`` to the sub-parsers ``commands`` (of ``add_subparsers``)."""
    summarize = commands.add_parser("summarize",
                                    help="rewrite summaries, views and plots of an output dir")
    summarize.add_argument("out", help="the --out directory of a run")


def summarize_command(out: str) -> int:
    """Rewrite the summaries of ``out``, one line printed per trial."""
    for s in postprocess.summarize(out):
        print(f"{s['trial']}: {os.path.join(out, s['trial'], 'summary.md')}")
    return 0


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of ``summarize`` (``run`` is listed only to say where it moved)."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Summarise the traces of a profile output directory.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_summarize_command(commands)
    commands.add_parser("run", help="moved: python -m examples.gsm8k.profile run (from the "
                                    "repository root)")
    return parser


def main(argv=None, prog: str = PROG) -> int:
    """Run the command of ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        if is_rank0():
            print(f"error: {RUN_MOVED}", file=sys.stderr, flush=True)
        return 2
    opts = build_parser(prog).parse_args(argv)
    try:
        return summarize_command(opts.out)
    except ValueError as exc:
        if is_rank0():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2


def console_main() -> int:
    """The ``vocabstats-profile`` console script."""
    return main(prog=CONSOLE_PROG)
