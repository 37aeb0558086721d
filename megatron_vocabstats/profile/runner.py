"""``python -m megatron_vocabstats.profile run``: profile chosen steps of the GSM8K SFT job.

Each trial kind (``memory``, ``kernels``) is a separate training run from the same seed, so
that recording memory never disturbs the kernel timeline. In a run, the chosen ranks wrap the
chosen steps (through ``examples.gsm8k.sft.train``'s ``step_hook``); the other ranks train
alongside, unprofiled. Every check of the selection and of the output directory runs on every
rank before a process group or a model exists.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import sys
from dataclasses import asdict, dataclass

import torch

from . import kernels, memory, postprocess, ranks, summary

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
    parser.add_argument("--max-entries", type=int, default=1_000_000,
                        help="CUDA allocator history entries kept (memory trials on GPU)")
    parser.add_argument("example", nargs=argparse.REMAINDER,
                        help="after --: the example's command line, e.g. -- sft --tp 2 --steps 3")


def _writable(out: str) -> None:
    """Create ``out`` and write/remove a probe file in it; ``ValueError`` naming ``--out``."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} exists and is not a directory")
    probe = os.path.join(out, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(out, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"--out {out} is not writable ({exc.strerror or exc})") from None


def plan(opts: argparse.Namespace, world: int, rank: int):
    """Check the request; returns ``(Plan, example args)``. ``ValueError`` naming the flag.

    Nothing is written but the probe of ``--out`` (which is created if missing).
    """
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # console script: examples/ lives in the repository
    try:
        from examples.gsm8k import cli
    except ImportError as exc:
        raise ValueError("the profiler runs the example job examples/gsm8k: run it from the "
                         f"repository root ({exc})") from None
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
    steps = ranks.parse_steps(opts.profile_steps or str(min(2, args.steps)), args.steps)
    trials = ranks.parse_trials(opts.trials)
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
    return Plan(opts.out, tuple(chosen_ranks), tuple(steps), tuple(trials), tuple(argv), world,
                rank, opts.max_entries), args


def _jsonable(value):
    plain = (str, int, float, bool, type(None), list, dict)
    return value if isinstance(value, plain) else str(value)


def write_settings(p: Plan, args) -> None:
    """``settings.json`` (everything that defines the run) and ``settings.log`` (readable)."""
    import megatron.core

    settings = {
        "command": [sys.executable, "-m", "megatron_vocabstats.profile", *sys.argv[1:]],
        "plan": asdict(p),
        "example": {k: _jsonable(v) for k, v in sorted(vars(args).items())},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "megatron_core": getattr(megatron.core, "__version__", "?")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "host": platform.node(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
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
    """The training rows of ``sft.run``: the examples shuffled with the seed, then packed."""
    from examples.gsm8k.data import PackedRows

    examples = list(run.inputs["train"])
    random.Random(run.args.seed).shuffle(examples)
    return PackedRows(examples, seq_length=run.args.seq_length, alignment=run.alignment,
                      device=run.par.device, thd=run.thd)


def execute(p: Plan, args) -> list[dict]:
    """Run every trial; returns the summaries of the trials (on rank 0, all ranks' trials)."""
    import torch.distributed as dist

    from examples.gsm8k import cli, sft

    if p.rank == 0:
        write_settings(p, args)
    for kind in p.trials:
        recorder = None
        if kind == "memory" and torch.cuda.is_available() and p.rank in p.ranks:
            recorder = memory.CudaMemoryRecorder(p.max_entries)
            recorder.start()  # before the model exists: every block gets its stack
        log(p, f"{kind} trial: building the model and training {args.steps} step(s); "
               f"profiling steps {list(p.steps)} on ranks {list(p.ranks)}")
        try:
            run = cli.setup(args)
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
