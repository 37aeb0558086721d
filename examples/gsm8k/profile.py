"""Profile chosen steps of the GSM8K SFT job: ``python -m examples.gsm8k.profile run ...``.

``python -m examples.gsm8k.profile run --out OUT [--ranks 0,2-4] [--profile-steps 2]
[--trials memory,kernels] [--overwrite] -- sft <example flags>`` (from the repository root,
under ``torchrun`` for several ranks), and ``python -m examples.gsm8k.profile summarize OUT``
(the same as ``python -m megatron_vocabstats.profiling summarize OUT``). The instruments and the
summaries are the plugin's :mod:`megatron_vocabstats.profiling`; this module is the part that
runs the example (it lives here so that the plugin never imports the example).

Each trial kind (``memory``, ``kernels``) is a separate training run from the same seed, so
that recording memory never disturbs the kernel timeline. In a run, the chosen ranks wrap the
chosen steps (through ``examples.gsm8k.sft.train``'s ``step_hook``); the other ranks train
alongside, unprofiled. Every check of the selection and of the output directory runs on every
rank before a process group or a model exists.

Exit status 0 on success, 2 for bad input (``error: ...`` on stderr, printed by rank 0; every
rank refuses the same input before any model is built; an ``--out`` that only some ranks cannot
write is also reported by those ranks). A failure after the checks (in training
or while writing a trial) is not bad input: it raises on the rank where it happened, with its
traceback, and torchrun stops the other ranks.
Importing this module imports neither Megatron nor the rest of the example (both lazily).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass

import torch

from megatron_vocabstats.megatron.flag_types import IntAtLeast
from megatron_vocabstats.profiling import kernels, memory, postprocess, ranks, summary
from megatron_vocabstats.profiling.cli import add_summarize_command, summarize_command

PROG = "python -m examples.gsm8k.profile"
SETTINGS_JSON = "settings.json"
SETTINGS_LOG = "settings.log"


@dataclass(frozen=True)
class Plan:
    """A checked profile request."""

    out: str
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    trials: tuple[str, ...]
    example_argv: tuple[str, ...]
    world: int
    rank: int
    max_entries: int
    overwrite: bool = False  # --overwrite found a previous profile in ``out``: rank 0 removes it


def trial_name(kind: str, step: int, rank: int) -> str:
    """The trial's directory name under ``--out``: ``<kind>-step<step>-rank<rank>``."""
    return f"{kind}-step{step}-rank{rank}"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``run``; the example's own command line follows ``--``."""
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--ranks", default=None,
                        help='ranks to profile, e.g. "0,2-4"; "" = all ranks; default: rank 0 of '
                             "each pipeline stage")
    parser.add_argument("--profile-steps", default=None,
                        help='training steps to profile (from 1), e.g. "2" or "2,4-5"; '
                             "default: step 2 (step 1 if the run has one step)")
    parser.add_argument("--trials", default="memory,kernels",
                        help="trial kinds, each a separate training run: memory, kernels")
    parser.add_argument("--max-entries", type=IntAtLeast(1), default=1_000_000,
                        help="CUDA allocator history entries kept (memory trials on GPU)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the profile already in --out (its trials, settings and "
                             "index); without it such an --out is refused")
    parser.add_argument("example", nargs=argparse.REMAINDER,
                        help="after --: the example's command line, e.g. -- sft --tp 2 --steps 3")


def previous_profile(out: str) -> list[str]:
    """The files and trial directories a profile run left in ``out`` (names, sorted)."""
    if not os.path.isdir(out):
        return []
    top = (SETTINGS_JSON, SETTINGS_LOG, postprocess.INDEX_MD)
    return sorted(name for name in os.listdir(out)
                  if name in top or os.path.isfile(os.path.join(out, name, summary.TRIAL_FILE)))


def remove_previous_profile(out: str) -> None:
    """Delete what :func:`previous_profile` lists (nothing else in ``out`` is touched)."""
    for name in previous_profile(out):
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


class OutDirError(ValueError):
    """``--out`` refused by this rank's own probe: unlike the other checks it may fail on some
    ranks only (a directory local to each node), so every rank that fails prints it."""


def _writable(out: str) -> None:
    """Create ``out`` and write/remove a probe file in it; :class:`OutDirError` naming
    ``--out``."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutDirError(f"--out {out} exists and is not a directory")
    probe = os.path.join(out, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as exc:
        raise OutDirError(f"--out {out} is not writable ({exc.strerror or exc})") from None


def plan(opts: argparse.Namespace, world: int, rank: int):
    """Check the request; returns ``(Plan, example args)``. ``ValueError`` naming the flag.

    Nothing is written but the probe of ``--out`` (which is created if missing). An ``--out``
    that already holds a profile (:func:`previous_profile`) is refused unless ``--overwrite``;
    with it, rank 0 removes that profile once every rank has passed these checks.
    """
    from . import cli
    argv = list(opts.example)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("give the example's command line after --, e.g. -- sft --tp 2")
    args = cli.parse_args(argv)
    if args.mode != "sft":
        raise ValueError(f"the example's mode {args.mode!r} is not profiled: use sft (its "
                         "training step is the one wrapped)")
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    chosen_ranks = ranks.parse_ranks(opts.ranks, world, pp)
    if opts.profile_steps is not None and not opts.profile_steps.strip():
        raise ValueError("--profile-steps '': name the steps, e.g. 2 or 2,4-5 (omit the flag "
                         "for the default)")
    steps_spec = opts.profile_steps if opts.profile_steps is not None else str(min(2, args.steps))
    steps = ranks.parse_steps(steps_spec, args.steps)
    trials = ranks.parse_trials(opts.trials)
    if "memory" in trials:
        summary.require_matplotlib()
    if opts.max_entries < 1:
        raise ValueError(f"--max-entries must be >= 1, got {opts.max_entries}")
    if "memory" in trials and not torch.cuda.is_available() and args.micro_batches > 1:
        raise ValueError(f"--trials memory on CPU needs --micro-batches 1 (got "
                         f"{args.micro_batches}): MemTracker follows one forward of the model "
                         "per step")
    if world % (args.tp * args.cp):
        raise ValueError(f"the world size {world} (torchrun --nproc-per-node x nodes) must be a "
                         f"multiple of --tp {args.tp} x --cp {args.cp}")
    cli.check_inputs(args)  # the example's own checks (data, sizes, checkpoint), before output
    _writable(opts.out)
    stale = previous_profile(opts.out)
    if stale and not opts.overwrite:
        shown = ", ".join(stale[:6]) + (", ..." if len(stale) > 6 else "")
        raise ValueError(f"--out {opts.out} already holds a profile ({shown}): its trials would "
                         "be mixed with this run's; give a new directory, or --overwrite to "
                         "replace it")
    return Plan(opts.out, tuple(chosen_ranks), tuple(steps), tuple(trials), tuple(argv), world,
                rank, opts.max_entries, bool(stale)), args


def _jsonable(value):
    plain = (str, int, float, bool, type(None), list, dict)
    return value if isinstance(value, plain) else str(value)


def write_settings(p: Plan, args) -> None:
    """``settings.json`` (everything that defines the run) and ``settings.log`` (readable)."""
    import megatron.core

    settings = {
        "command": [sys.executable, "-m", "examples.gsm8k.profile", *sys.argv[1:]],
        "plan": asdict(p),
        "example": {k: _jsonable(v) for k, v in sorted(vars(args).items())},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "megatron_core": getattr(megatron.core, "__version__", "?")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "host": platform.node(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    with open(os.path.join(p.out, SETTINGS_JSON), "w") as f:
        json.dump(settings, f, indent=1)
    lines = [f"{k}: {v}" for k, v in asdict(p).items()]
    lines += [f"example.{k}: {v}" for k, v in settings["example"].items()]
    lines += [f"{k}: {v}" for k, v in settings.items() if k not in ("plan", "example")]
    with open(os.path.join(p.out, SETTINGS_LOG), "w") as f:
        f.write("\n".join(lines) + "\n")


def log(p: Plan, line: str) -> None:
    """Append a timestamped event to ``settings.log`` (rank 0 only)."""
    if p.rank == 0:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S")
        with open(os.path.join(p.out, SETTINGS_LOG), "a") as f:
            f.write(f"[{stamp}] {line}\n")


def step_hook(p: Plan, kind: str, recorder):
    """The ``step_hook`` of ``sft.train`` for one trial kind on this rank."""

    @contextlib.contextmanager
    def hook(step, model, optimizer):
        if p.rank not in p.ranks or step not in p.steps:
            yield
            return
        trial_dir = os.path.join(p.out, trial_name(kind, step, p.rank))
        os.makedirs(trial_dir, exist_ok=True)
        with open(os.path.join(trial_dir, summary.TRIAL_FILE), "w") as f:
            json.dump({"trial": trial_name(kind, step, p.rank), "kind": kind, "rank": p.rank,
                       "step": step, "world": p.world}, f, indent=1)
        if kind == "kernels":
            measure = kernels.kernel_step(trial_dir, step)
        elif recorder is not None:
            measure = recorder.step(trial_dir)
        else:
            device = next(model.parameters()).device
            measure = memory.cpu_memory_step(trial_dir, model, optimizer, device)
        with measure:
            yield
        summary.write_trial_summary(trial_dir)

    return hook


def _train_rows(run):
    """The training rows of ``sft.run`` (the examples shuffled with the seed, then packed)."""
    from . import sft

    return sft.packed_rows(run.inputs, run.args, run.par, run.alignment, run.thd)[1]


def execute(p: Plan, args) -> list[dict]:
    """Run every trial; returns the summaries of the trials (on rank 0, all ranks' trials)."""
    import torch.distributed as dist

    from . import cli, sft

    for i, kind in enumerate(p.trials):
        recorder = None
        if kind == "memory" and torch.cuda.is_available() and p.rank in p.ranks:
            recorder = memory.CudaMemoryRecorder(p.max_entries)
            recorder.start()  # before the model exists: every block gets its stack
        try:
            run = cli.setup(args)
            if i == 0:
                # Only now, with every rank past its checks: an earlier settings.json would make
                # a slower rank refuse --out as holding a profile, and leave the ranks in
                # different collectives. setup's joining of the process group is no such point
                # when the group (and Megatron's parallel state) already exist, so a barrier
                # first; the second keeps every trial write after the removal.
                dist.barrier()
                if p.rank == 0:
                    if p.overwrite:
                        remove_previous_profile(p.out)
                    write_settings(p, args)
                dist.barrier()
            log(p, f"{kind} trial: model built; training {args.steps} step(s), profiling steps "
                   f"{list(p.steps)} on ranks {list(p.ranks)}")
            sft.train(run.model, _train_rows(run), args, run.par,
                      step_hook=step_hook(p, kind, recorder))
        finally:
            if recorder is not None:
                recorder.stop()
        del run
        dist.barrier()
        log(p, f"{kind} trial: done")
    if p.rank != 0:
        return []
    summaries = postprocess.summarize(p.out)
    log(p, f"wrote {len(summaries)} trial(s) and {postprocess.INDEX_MD}")
    return summaries


EPILOG = f"""examples:
  torchrun --standalone --nproc-per-node 2 -m examples.gsm8k.profile run --out prof \\
      --ranks "" --profile-steps 2 -- sft --vocab-parallel-stats --lm-head-chunk-size 128 --steps 3
  {PROG} summarize prof
"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of both commands (``run`` flags: :func:`add_run_arguments`)."""
    parser = argparse.ArgumentParser(
        prog=PROG, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Profile memory and kernels of chosen steps on chosen ranks of the GSM8K "
                    "example job, and summarise the traces.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(commands.add_parser(
        "run", help="train the example and profile chosen steps on chosen ranks"))
    add_summarize_command(commands)
    return parser


def main(argv=None) -> int:
    """Run the command of ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    opts = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        if opts.command == "summarize":
            return summarize_command(opts.out)
        p, args = plan(opts, int(os.environ.get("WORLD_SIZE", "1")), rank)
    except ValueError as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif isinstance(exc, OutDirError):  # may fail on this rank alone
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2
    # Past the checks, an error is not the user's input: let it raise with its traceback (an
    # error of rank 1 caught here would end that rank silently with status 2).
    summaries = execute(p, args)
    if rank == 0:
        print(f"profile: {len(summaries)} trial(s) in {p.out} (index: "
              f"{os.path.join(p.out, postprocess.INDEX_MD)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
