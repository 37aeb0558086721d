"""Command line of the profiler: ``python -m megatron_vocabstats.profile {run,summarize} ...``.

Exit status 0 on success, 2 for bad input (``error: ...`` on stderr, printed by rank 0; every
rank refuses the same input before any model is built; an ``--out`` that only some ranks cannot
write is also reported by those ranks). A failure after the checks (in training
or while writing a trial) is not bad input: it raises on the rank where it happened, with its
traceback, and torchrun stops the other ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import postprocess, runner

EPILOG = """examples:
  torchrun --standalone --nproc-per-node 2 -m megatron_vocabstats.profile run --out prof \\
      --ranks "" --profile-steps 2 -- sft --vocab-parallel-stats --lm-head-chunk-size 128 --steps 3
  python -m megatron_vocabstats.profile summarize prof
"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of both commands (``run`` flags: :func:`runner.add_run_arguments`)."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_vocabstats.profile", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Profile memory and kernels of chosen steps on chosen ranks of the GSM8K "
                    "example job, and summarise the traces.")
    commands = parser.add_subparsers(dest="command", required=True)
    runner.add_run_arguments(commands.add_parser(
        "run", help="train the example and profile chosen steps on chosen ranks"))
    summarize = commands.add_parser("summarize",
                                    help="rewrite summaries, views and plots of an output dir")
    summarize.add_argument("out", help="the --out directory of a run")
    return parser


def main(argv=None) -> int:
    """Run the command of ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    opts = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if opts.command == "summarize":
            for s in postprocess.summarize(opts.out):
                print(f"{s['trial']}: {os.path.join(opts.out, s['trial'], 'summary.md')}")
            return 0
        plan, args = runner.plan(opts, int(os.environ.get("WORLD_SIZE", "1")), rank)
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif isinstance(exc, runner.OutDirError):  # may fail on this rank alone
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    # Past the checks, an error is not the user's input: let it raise with its traceback (an
    # error of rank 1 caught here would end that rank silently with status 2).
    summaries = runner.execute(plan, args)
    if rank == 0:
        print(f"profile: {len(summaries)} trial(s) in {plan.out} (index: "
              f"{os.path.join(plan.out, postprocess.INDEX_MD)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
