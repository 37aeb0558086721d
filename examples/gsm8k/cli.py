"""Command line of the GSM8K example: ``python -m examples.gsm8k MODE [flags]``, MODE one of
``sft``, ``grpo``, ``score``, ``distill``.

The plugin comes in as a user adds it to a script with its own argument parser: the one-line
``import megatron_vocabstats.patch``, the flag family from
``megatron_vocabstats.megatron.arguments.extra_args_provider`` and, after parsing,
``config_hook(args)``, which turns the plugin on with ``--vocab-parallel-stats`` (off without).

Every check of the flags (at parse time: counts, sizes and finite numbers), of the outputs (no
output is an input; an existing one is replaced only with ``--overwrite``; its directory is
writable) and of the input (data files, sizes, tp against heads, world size) runs before any
model is built or output written; errors are ``ValueError`` with the flag named, printed as
``error: ...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from dataclasses import dataclass

# Notices of torch/Megatron that do not apply to this example (no CUDA, apex or
# transformer-engine; CUDA-graph and CUDA_DEVICE_MAX_CONNECTIONS advice; GPTModel's deprecation
# in favour of HybridModel, which the plugin patches alike).
warnings.filterwarnings("ignore", message=".*([Tt]ransformer[ -][Ee]ngine|Apex|absl).*")
warnings.filterwarnings("ignore", message=".*(full scope is deprecated|CUDA_DEVICE_MAX_CONN).*")
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)

import megatron_vocabstats.patch  # noqa: E402,F401 - the one line that brings the plugin in
from megatron_vocabstats.megatron.flag_types import FloatIn, IntAtLeast  # noqa: E402

DESCRIPTION = "Train / score a Megatron-Core GPT on GSM8K with megatron-vocabstats."

# argparse types: a value they refuse stops the run at parse time, naming the flag (exit 2).
POSITIVE, NON_NEGATIVE = IntAtLeast(1), IntAtLeast(0)
POSITIVE_REAL, NON_NEGATIVE_REAL = FloatIn(0.0, open_low=True), FloatIn(0.0)


class UsageError(ValueError):
    """A command line the parser refuses; :func:`main` prints it as ``error: ...`` (exit 2)."""


class OutputError(ValueError):
    """An output refused by :func:`check_outputs`; unlike the other checks it may fail on some
    ranks only (a directory local to each node), so every rank that fails prints it."""


class _Parser(argparse.ArgumentParser):
    """Raises :class:`UsageError` instead of exiting, so that :func:`main` (and the profiler,
    which parses the example's flags) report it like every other bad input, once."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def _common(parser: argparse.ArgumentParser) -> None:
    from megatron_vocabstats.megatron.arguments import extra_args_provider

    from .data import DEFAULT_DATA_DIR

    g = parser.add_argument_group(
        "model and parallelism", "With --load, the model flags not given (marked *) are the "
        "checkpoint's (its meta.json); otherwise their defaults.")
    g.add_argument("--tp", type=POSITIVE, default=None, help="* tensor-parallel size (default 2)")
    g.add_argument("--cp", type=POSITIVE, default=1,
                   help="context-parallel size (needs CUDA + transformer-engine)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism (needs transformer-engine or apex norms)")
    g.add_argument("--num-layers", type=POSITIVE, default=None,
                   help="* transformer layers (default 4)")
    g.add_argument("--hidden-size", type=POSITIVE, default=None, help="* model width (default 512)")
    g.add_argument("--num-attention-heads", type=POSITIVE, default=None,
                   help="* attention heads, a multiple of --tp (default 8)")
    g.add_argument("--ffn-hidden-size", type=NON_NEGATIVE, default=None,
                   help="* MLP width; 0 = 4 x hidden (default 0)")
    g.add_argument("--seq-length", type=POSITIVE, default=1024,
                   help="tokens per packed row (one microbatch)")
    g.add_argument("--position-embedding", choices=("learned_absolute", "rope"), default=None,
                   help="* learned_absolute (default) or rope (needs CUDA: Megatron builds its "
                        "frequencies there)")
    g.add_argument("--tie-embeddings", action="store_true", default=None,
                   help="* share the input embedding and the LM head weight")
    g.add_argument("--dropout", type=FloatIn(0.0, 1.0, open_high=True), default=0.0,
                   help="hidden and attention dropout (0 keeps the comparison exact)")
    g.add_argument("--bf16", action="store_true", help="bf16 autocast (CUDA only)")
    g.add_argument("--seed", type=NON_NEGATIVE, default=1234,
                   help="initialisation, data order and rollouts")
    g.add_argument("--load", default=None, help="checkpoint directory to start from")
    g.add_argument("--save", default=None, help="write a checkpoint here at the end")
    g.add_argument("--tokenizer", default=None,
                   help="Tekken tokenizer JSON (default: the one in the mistral-common wheel)")
    g = parser.add_argument_group("data and output")
    g.add_argument("--data-dir", default=DEFAULT_DATA_DIR,
                   help="directory with GSM8K train.jsonl and test.jsonl")
    g.add_argument("--out", default="outputs/gsm8k", help="directory for reports")
    g.add_argument("--overwrite", action="store_true",
                   help="replace outputs that already exist (the mode's reports in --out, "
                        "--output, --save, stored top-k files); without it they are refused. "
                        "An output that is also an input is always refused")
    extra_args_provider(parser)


def _training(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--steps", type=POSITIVE, default=20, help="optimizer steps")
    g.add_argument("--micro-batches", type=POSITIVE, default=1,
                   help="packed rows per step per data-parallel rank")
    g.add_argument("--lr", type=POSITIVE_REAL, default=1e-3, help="peak AdamW learning rate")
    g.add_argument("--warmup-steps", type=NON_NEGATIVE, default=3,
                   help="linear warmup, then cosine decay to 10%% of --lr")
    g.add_argument("--weight-decay", type=NON_NEGATIVE_REAL, default=0.1,
                   help="AdamW weight decay of the matrices")
    g.add_argument("--clip-grad", type=NON_NEGATIVE_REAL, default=1.0, help="0 = no clipping")
    g.add_argument("--train-examples", type=NON_NEGATIVE, default=0, help="0 = all")
    g.add_argument("--repeat-batch", action="store_true",
                   help="train on the first step's rows every step (a check that loss falls)")


# The model flags (default None on the command line): parse_args fills those not given from the
# --load checkpoint's meta.json, else from these defaults.
MODEL_DEFAULTS = {"tp": 2, "num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                  "ffn_hidden_size": 0, "position_embedding": "learned_absolute",
                  "tie_embeddings": False}


def _model_flags(args) -> None:
    """Fill the model flags not given: from ``--load``'s checkpoint when it records them, else
    :data:`MODEL_DEFAULTS`; ``args.model_flags_from_load`` lists the flags taken from it."""
    from .model import saved_shape

    saved = saved_shape(args.load) if args.load else {}
    args.model_flags_from_load = []
    for name, default in MODEL_DEFAULTS.items():
        if getattr(args, name) is not None:
            continue
        if name in saved:
            setattr(args, name, saved[name])
            args.model_flags_from_load.append("--" + name.replace("_", "-"))
        else:
            setattr(args, name, default)


# Mode-specific flags: (flag, type, default, help).
SFT_FLAGS = [
    ("--test-examples", POSITIVE, 32, "held-out test questions for the NLL before/after"),
    ("--compare-batches", POSITIVE, 1, "packed rows on which the loss paths are compared"),
    ("--compare-chunk", POSITIVE, 256,
     "fused LM-head chunk of the comparison when --lm-head-chunk-size is 0"),
]
GRPO_FLAGS = [
    ("--questions-per-step", POSITIVE, 4, "questions per step per data-parallel rank"),
    ("--group-size", IntAtLeast(2), 4,
     "answers per question (>= 2: advantages are normalised within a group)"),
    ("--ppo-epochs", POSITIVE, 2, "policy updates per batch of rollouts"),
    ("--clip-eps", FloatIn(0.0, 1.0, open_low=True, open_high=True), 0.2,
     "PPO ratio clip, in (0, 1); the entropy bonus is --entropy-coef (with "
     "--vocab-stats-entropy grad)"),
    ("--sample-temperature", POSITIVE_REAL, 1.0,
     "--rollouts sampled: the sampler's temperature (> 0), replayed by the trainer"),
    ("--sample-top-p", FloatIn(0.0, 1.0, open_low=True), 0.9,
     "--rollouts sampled: the sampler's top-p, in (0, 1] (1 = off), replayed by the trainer"),
    ("--max-new-tokens", POSITIVE, 24,
     "--rollouts sampled: answer tokens sampled at most (stops earlier at EOS)"),
]
# The plugin's sampler flags describe an external engine; the example's sampler has its own.
PLUGIN_SAMPLER_FLAGS = {"rollout_temperature": 1.0, "rollout_top_k": None, "rollout_top_p": 1.0,
                        "rollout_min_p": 0.0}

DISTILL_FLAGS = [
    ("--topk", POSITIVE, 16, "teacher ids per token the student is distilled on"),
    ("--teacher-steps", POSITIVE, 20,
     "SFT steps of the teacher trained on the fly (no --teacher-load)"),
    ("--teacher-num-layers", NON_NEGATIVE, 0, "teacher layers (0 = 2 x --num-layers)"),
    ("--teacher-hidden-size", NON_NEGATIVE, 0, "teacher width (0 = --hidden-size)"),
    ("--jsd-beta", FloatIn(0.0, 1.0, open_low=True, open_high=True), 0.5,
     "JSD: weight of the teacher in the mixture, in (0, 1)"),
    ("--distill-temperature", POSITIVE_REAL, 1.0, "softmax temperature of teacher and student"),
]


def _distill_flags(parser: argparse.ArgumentParser) -> None:
    g = _flags(parser, "distillation", DISTILL_FLAGS)
    g.add_argument("--teacher-load", default=None,
                   help="teacher checkpoint of this example (e.g. from sft --save with the "
                        "teacher's sizes); default: train one on the fly")
    g.add_argument("--teacher-topk", choices=("on-the-fly", "precomputed"), default="on-the-fly",
                   help="compute the teacher's top-k at each step, or once for every training "
                        "row, stored under --out and read back")
    g.add_argument("--divergence", choices=("forward_kl", "reverse_kl", "jsd"),
                   default="forward_kl", help="divergence over the teacher's top-k")
    g.add_argument("--tail-bucket", action="store_true",
                   help="add the probability mass outside the top-k as one more bucket")
    g.add_argument("--teacher-topk-load", default=None, metavar="DIR",
                   help="read the teacher's top-k from the teacher_topk_dp<r>.pt files of an "
                        "earlier --teacher-topk precomputed run (same data, layout, --topk, "
                        "--distill-temperature; checked) instead of computing it")
    g.add_argument("--distill-temperature-scale", action="store_true",
                   help="multiply the loss by --distill-temperature squared (Hinton et al. "
                        "2015), so gradients keep their size as the temperature changes")


def _flags(parser: argparse.ArgumentParser, title: str, flags):
    group = parser.add_argument_group(title)
    for flag, kind, default, text in flags:
        group.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    return group


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m examples.gsm8k", description=DESCRIPTION)
    modes = parser.add_subparsers(dest="mode", required=True)
    sft = modes.add_parser("sft", help="supervised fine-tuning on answers + report")
    grpo = modes.add_parser("grpo", help="GRPO-style policy steps on stand-in or sampled "
                            "rollouts")
    score = modes.add_parser("score", help="per-token logprobs and entropy of a JSONL file")
    distill = modes.add_parser("distill", help="top-k distillation from a larger teacher")
    for mode in (sft, grpo, score, distill):
        _common(mode)
    for mode in (sft, grpo, distill):
        _training(mode)
    _distill_flags(distill)
    distill.add_argument("--test-examples", type=POSITIVE, default=32,
                         help="held-out test questions for the NLL before/after")
    _flags(sft, "evaluation and comparison", SFT_FLAGS)
    g = _flags(grpo, "policy", GRPO_FLAGS)
    g.add_argument("--rollouts", choices=("standin", "sampled"), default="standin",
                   help="standin: corrupted reference answers; sampled: answers sampled from "
                        "the current policy by the example's own sampler, with the sampler's "
                        "log-probs replayed and corrected (--rollout-correction) by the trainer "
                        "(default: %(default)s)")
    g.add_argument("--sample-dtype", choices=("model", "bfloat16", "float16", "float32"),
                   default="model",
                   help="--rollouts sampled: dtype of the sampler's softmax (model = the "
                        "logits' dtype; bfloat16 on CPU emulates a bf16 engine) "
                        "(default: %(default)s)")
    g = score.add_argument_group("scoring")
    g.add_argument("--input", required=True, help='JSONL of {"prompt": ..., "response": ...}')
    g.add_argument("--output", required=True, help="JSONL written with per-token results")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse ``argv`` and apply the plugin's config hook.

    Raises ``ValueError`` naming the flag: :class:`UsageError` for what the parser refuses (an
    unknown flag, a count below its minimum, a NaN, infinite or out-of-range number), plain
    ``ValueError`` for combinations that cannot run. Outputs are checked by
    :func:`check_outputs`, inputs by :func:`check_inputs`.
    """
    from megatron_vocabstats.megatron.arguments import config_hook

    args = build_parser().parse_args(argv)
    _model_flags(args)
    config_hook(args)
    if args.bf16 and not _cuda():
        raise ValueError("--bf16 needs CUDA (Megatron's schedule autocasts on 'cuda'); drop it "
                         "on CPU")
    if args.position_embedding == "rope" and not _cuda():
        raise ValueError("--position-embedding rope needs CUDA (Megatron's rotary embedding "
                         "moves its frequencies to the GPU); use learned_absolute on CPU")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} exists and is not a directory")
    if args.mode == "grpo":
        _check_rollouts(args)
    if args.mode == "distill":
        if args.cp > 1:
            raise ValueError("distill runs with --cp 1 (the teacher's top-k is per packed row)")
        if args.teacher_topk_load and not os.path.isdir(args.teacher_topk_load):
            raise ValueError(f"--teacher-topk-load {args.teacher_topk_load} is not a directory "
                             "(the --out of a --teacher-topk precomputed run)")
    return args


def _check_rollouts(args) -> None:
    """GRPO: the rollout flags that cannot combine, named."""
    for name, default in PLUGIN_SAMPLER_FLAGS.items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} describes an external rollout engine; this example samples "
                             "itself: use --rollouts sampled with --sample-temperature / "
                             "--sample-top-p")
    if args.rollouts == "standin":
        if args.rollout_correction != "none":
            raise ValueError(f"--rollout-correction {args.rollout_correction} needs the "
                             "sampler's log-probs: add --rollouts sampled")
        return
    if args.cp > 1 or args.sequence_parallel:
        raise ValueError("--rollouts sampled runs with --cp 1 and without --sequence-parallel "
                         "(the sampler's forward is a plain unpacked one)")


def _dp_size(args) -> int:
    """Data-parallel size of this launch (``WORLD_SIZE`` / (tp x cp); 1 when they disagree,
    which :func:`.model.init_parallel` refuses later)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return max(1, world // (args.tp * args.cp)) if world % (args.tp * args.cp) == 0 else 1


def planned_outputs(args) -> list[tuple[str, str]]:
    """``(flag, path)`` of every file the run writes, and ``("--save", dir)`` for a checkpoint."""
    from . import distill, report

    out = [("--out", path) for path in report.report_paths(args.out, args.mode)]
    if args.mode == "distill" and args.teacher_topk == "precomputed" \
            and not args.teacher_topk_load:
        out += [("--out", distill.topk_file(args.out, r)) for r in range(_dp_size(args))]
    if args.mode == "score":
        out.append(("--output", args.output))
    if args.save:
        out.append(("--save", args.save))
    return out


def read_paths(args) -> list[tuple[str, str]]:
    """``(flag, path)`` of every file or directory the run reads."""
    if args.mode == "score":
        paths = [("--input", args.input)]
    else:
        names = ("train.jsonl",) + (("test.jsonl",) if args.mode in ("sft", "distill") else ())
        paths = [("--data-dir", os.path.join(args.data_dir, n)) for n in names]
    for flag in ("--tokenizer", "--load", "--teacher-load", "--teacher-topk-load"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value:
            paths.append((flag, value))
    return paths


def check_outputs(args) -> None:
    """Refuse outputs that would destroy something, before any input is read or model built.

    Raises :class:`OutputError` (a ``ValueError``) naming the flag and the path: an output that
    is one of the run's inputs (resolved through symbolic and hard links; also with
    ``--overwrite``), two outputs on the same path, an output file that is a directory, an
    existing output file (or a ``--save`` directory holding files) without ``--overwrite``, or
    an output whose directory cannot be created or written.
    """
    from .report import output_problem, same_path

    outputs, inputs = planned_outputs(args), read_paths(args)
    for i, (flag, path) in enumerate(outputs):
        for other_flag, other in inputs + outputs[:i]:
            if same_path(path, other):
                kind = "input" if (other_flag, other) in inputs else "output"
                raise OutputError(f"{flag} {path} is the same path as the {kind} {other_flag} "
                                  f"{other}: give another path (--overwrite does not allow this)")
        problem = output_problem(path, directory=flag == "--save", overwrite=args.overwrite)
        if problem:
            raise OutputError(f"{flag} {path} {problem}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load_inputs(args) -> dict:
    """Tokenizer and tokenised examples of the mode; every data error raises here."""
    from .data import encode_gsm8k, encode_scoring_rows, load_gsm8k, load_tokenizer, read_jsonl

    tokenizer = load_tokenizer(args.tokenizer)
    out = {"tokenizer": tokenizer}
    if args.mode == "score":
        rows = read_jsonl(args.input, ("prompt", "response"), what="--input")
        out["rows"] = rows
        out["examples"] = encode_scoring_rows(tokenizer, rows, what="--input")
        return out
    train = load_gsm8k(os.path.join(args.data_dir, "train.jsonl"), what="--data-dir",
                       limit=args.train_examples or None)
    out["train_rows"] = train
    out["train"] = [encode_gsm8k(tokenizer, r["question"], r["answer"]) for r in train]
    if args.mode in ("sft", "distill"):
        test = load_gsm8k(os.path.join(args.data_dir, "test.jsonl"), what="--data-dir",
                          limit=args.test_examples)
        out["test"] = [encode_gsm8k(tokenizer, r["question"], r["answer"]) for r in test]
    return out


def _fits(examples, seq_length: int, alignment: int, slack: int = 0) -> list[bool]:
    """Whether each example (plus ``slack`` tokens) fits one row of ``seq_length`` tokens."""
    return [-(-(e.num_tokens + slack) // alignment) * alignment <= seq_length for e in examples]


def main(argv=None) -> int:
    """Run one mode; returns the process exit code (2 for bad input, 1 for a failed check)."""
    try:
        args = parse_args(argv)
        check_outputs(args)
        return _run(args)
    except ValueError as exc:
        # Every rank raises the same error; one copy is enough. Output paths may be local to a
        # node, so a rank other than 0 that refuses one says so.
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif isinstance(exc, OutputError):
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return 2


@dataclass
class Setup:
    """Everything a mode needs, built by :func:`setup`."""

    args: argparse.Namespace
    inputs: dict
    shape: object
    alignment: int
    thd: bool
    par: object
    model: object


def check_inputs(args) -> tuple[dict, object, int]:
    """All input checks that need no process group: data, tokenizer, sizes, checkpoint.

    Returns ``(inputs, shape, alignment)``; raises ``ValueError`` naming the flag.
    """
    from megatron_vocabstats.packing import sequence_alignment

    from . import model as model_lib

    inputs = load_inputs(args)
    shape = model_lib.model_shape(args, inputs["tokenizer"].n_words)
    alignment = sequence_alignment(args.cp, args.tp, args.sequence_parallel)
    if args.seq_length % alignment:
        raise ValueError(f"--seq-length {args.seq_length} must be a multiple of {alignment} "
                         f"(the per-sequence alignment for --tp {args.tp} --cp {args.cp}"
                         f"{' with --sequence-parallel' if args.sequence_parallel else ''})")
    if args.load:
        model_lib.check_checkpoint(args.load, shape)
    if args.mode == "distill":
        from .distill import teacher_shape, topk_file

        teacher = teacher_shape(args, inputs["tokenizer"].n_words)
        if args.topk > teacher.vocab_size:
            raise ValueError(f"--topk {args.topk} exceeds the vocabulary ({teacher.vocab_size})")
        if args.teacher_topk_load:  # contents are checked once the rows are packed
            for r in range(_dp_size(args)):
                if not os.path.isfile(topk_file(args.teacher_topk_load, r)):
                    raise ValueError(f"--teacher-topk-load: {topk_file(args.teacher_topk_load, r)}"
                                     " does not exist (written by a --teacher-topk precomputed "
                                     "run with the same --tp/--dp layout?)")
    if "examples" in inputs:  # scoring: every row must fit
        fits = _fits(inputs["examples"], args.seq_length, alignment)
        if not all(fits):
            first = fits.index(False)
            raise ValueError(f"--input: row {first + 1} has {inputs['examples'][first].num_tokens} "
                             f"tokens, more than --seq-length {args.seq_length}")
    # Training data: examples longer than a row are left out. GRPO's stand-in answers may be a
    # few tokens longer than the reference (a changed final number), hence the slack.
    for key, rows_key in (("train", "train_rows"), ("test", None)):
        if key not in inputs:
            continue
        if args.mode == "grpo" and args.rollouts == "sampled":  # prompt + sampled answer
            fits = _fits([type(e)(e.prompt, []) for e in inputs[key]], args.seq_length,
                         alignment, args.max_new_tokens)
        else:
            fits = _fits(inputs[key], args.seq_length, alignment,
                         8 if args.mode == "grpo" else 0)
        if not any(fits):
            raise ValueError(f"--data-dir: no {key} example fits --seq-length {args.seq_length}")
        inputs[key] = [e for e, ok in zip(inputs[key], fits) if ok]
        if rows_key:
            inputs[rows_key] = [r for r, ok in zip(inputs[rows_key], fits) if ok]
    return inputs, shape, alignment


def setup(args) -> Setup:
    """Check the inputs, then join the process group and build (and load) the model."""
    from . import model as model_lib

    inputs, shape, alignment = check_inputs(args)
    par = model_lib.init_parallel(args.tp, args.cp, args.seed)
    gpt = model_lib.build_model(shape, args, par)
    if args.load:
        model_lib.load_checkpoint(gpt, args.load, par)
    return Setup(args, inputs, shape, alignment, model_lib.thd_attention_available(), par, gpt)


def mode_settings(args, device) -> str:
    """What the mode computes its statistics and loss with, in one line (printed at the start)."""
    from megatron_vocabstats.megatron import announce, settings

    used_for = {"sft": "training, evaluation", "distill": "teacher training, evaluation"}
    labels = (f"labels path ({used_for.get(args.mode)}): plugin "
              + announce.describe(settings.current(), device=device))
    if args.mode == "sft":
        chunk = args.lm_head_chunk_size or args.compare_chunk
        return (f"settings: {labels}; comparison: Megatron's loss, the plugin unfused and fused "
                f"(chunk {chunk}), fp32 and bf16 logits")
    if args.mode == "score":
        return ("settings: score_tokens on the logits (vocab_parallel_stats, entropy metric, "
                "the tokenizer's vocabulary), forward only")
    if args.mode == "grpo":
        rollouts = "stand-in answers" if args.rollouts == "standin" else (
            f"sampled (temperature {args.sample_temperature}, top-p {args.sample_top_p}, "
            f"{args.sample_dtype} softmax, at most {args.max_new_tokens} new tokens), replayed "
            f"by vocab_parallel_sampling_logprobs")
        correction = settings.current().rollout_correction()
        return (f"settings: policy_loss (clip {args.clip_eps}, entropy coef {args.entropy_coef}, "
                "token mean) on log-probs from the logits (vocab_parallel_stats, entropy "
                f"{'grad' if args.entropy_coef else 'metric'}); rollouts: {rollouts}; rollout "
                f"correction: {correction or 'none'}")
    return (f"settings: distillation_loss ({args.divergence}, top-{args.topk}"
            f"{', tail bucket' if args.tail_bucket else ''}, temperature "
            f"{args.distill_temperature}) on the student's logits; teacher top-k "
            f"{args.teacher_topk}; {labels}")


def _describe(run: Setup) -> str:
    shape, par, args = run.shape, run.par, run.args
    n = sum(p.numel() for p in run.model.parameters())
    text = (f"GPTModel: {shape.num_layers} layers, hidden {shape.hidden_size}, "
            f"{shape.num_attention_heads} heads, vocab {shape.vocab_size} (padded "
            f"{shape.padded_vocab_size}); {n / 1e6:.1f}M parameters per rank; tp {par.tp} "
            f"cp {par.cp} dp {par.dp} on {par.device.type} "
            f"({'nccl' if par.device.type == 'cuda' else 'gloo'})")
    if getattr(args, "model_flags_from_load", None):
        text += f"\nmodel flags from --load {args.load}: {' '.join(args.model_flags_from_load)}"
    return f"{text}\n{mode_settings(args, par.device)}"


def _run(args) -> int:
    from . import distill, grpo, score, sft
    from .model import save_checkpoint

    run = setup(args)
    if run.par.is_main:
        print(_describe(run), flush=True)
    mode = {"sft": sft, "grpo": grpo, "score": score, "distill": distill}[args.mode]
    result = mode.run(run.model, run.inputs, args, run.par, run.alignment, run.thd)
    code = 1 if args.mode == "sft" and not result["comparison"]["ok"] else 0
    if args.save:
        save_checkpoint(run.model, args.save, run.shape, run.par)
    return code
