"""Distill mode: a larger teacher teaches the run's (smaller) student through its top-k.

The teacher is a deeper (``--teacher-num-layers``) and/or wider (``--teacher-hidden-size``)
``GPTModel`` over the same tokenizer, either loaded from a checkpoint of this example
(``--teacher-load``, e.g. one written by ``sft --save``) or trained on the fly with the SFT
loop for ``--teacher-steps`` steps. Its top-k per token comes from
:func:`megatron_vocabstats.vocab_parallel_topk` on its vocab-parallel logits, either computed at
each step (``--teacher-topk on-the-fly``) or computed once for every training row, stored to
``<out>/teacher_topk_dp<r>.pt`` and read back (``--teacher-topk precomputed``), or read from the
files of an earlier precomputed run (``--teacher-topk-load DIR``; checked against this run's
flags, a corrupt or mismatched file stops every rank with an error naming it). The student is
then trained with :func:`megatron_vocabstats.distillation_loss` (Megatron's loss contract) on
its vocab-parallel logits: forward/reverse KL or JSD over the teacher's top-k, optionally with
the tail bucket. Reported: per-step distillation loss and top-k masses, test NLL of the student
before and after, and the teacher's.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist

from megatron_vocabstats import TopK, distillation_loss, vocab_parallel_topk
from megatron_vocabstats.testing.megatron_cpu import cuda_factories_on_cpu

from . import report
from .data import PackedRows
from .model import (
    Parallel,
    build_model,
    check_checkpoint,
    clip_grad_norm_,
    load_checkpoint,
    make_optimizer,
    model_shape,
    run_schedule,
)
from .sft import packed_rows, train
from .steps import evaluate_nll, reduce_reports

REPORTED = ("distill loss", "teacher topk mass", "student topk mass")


def teacher_args(args) -> argparse.Namespace:
    """The flags of the teacher: the student's, with the teacher's sizes, checkpoint and steps."""
    teacher = argparse.Namespace(**vars(args))
    teacher.num_layers = args.teacher_num_layers or 2 * args.num_layers
    teacher.hidden_size = args.teacher_hidden_size or args.hidden_size
    teacher.ffn_hidden_size = 0
    teacher.load = args.teacher_load
    teacher.steps = args.teacher_steps
    return teacher


def teacher_shape(args, vocab_size: int):
    """The teacher's :class:`.model.ModelShape`; ``ValueError`` for sizes or a checkpoint that
    cannot work (checked before any process group exists)."""
    targs = teacher_args(args)
    shape = model_shape(targs, vocab_size)
    if targs.load:
        try:
            check_checkpoint(targs.load, shape)
        except ValueError as exc:  # name the flag this mode reads
            raise ValueError(str(exc).replace("--load", "--teacher-load", 1)) from None
    return shape


def build_teacher(args, shape, train_rows: PackedRows, par: Parallel):
    """The teacher, loaded or trained on the fly for ``--teacher-steps``, in eval mode."""
    targs = teacher_args(args)
    torch.manual_seed(args.seed + 1)
    teacher = build_model(shape, targs, par)
    if targs.load:
        load_checkpoint(teacher, targs.load, par)
    else:
        if par.is_main:
            print(f"distill: training the teacher ({shape.num_layers} layers, hidden "
                  f"{shape.hidden_size}) for {targs.steps} steps", flush=True)
        train(teacher, train_rows, targs, par)
    return teacher.eval()


def teacher_topk(teacher, batch, args, par: Parallel, vocab_size: int) -> TopK:
    """The teacher's top-k of one packed row: ``[1, T, k]`` log-probs and global ids."""
    with torch.no_grad(), cuda_factories_on_cpu():
        logits = teacher(**batch.model_inputs)  # [1, T, V/tp]: labels=None returns logits
        return vocab_parallel_topk(logits, args.topk, tp_group=par.tp_group,
                                   vocab_size=vocab_size, temperature=args.distill_temperature)


TOPK_FORMAT = "megatron_vocabstats.gsm8k.teacher_topk/1"
_META_FLAGS = {"topk": "--topk", "temperature": "--distill-temperature",
               "vocab_size": "the tokenizer's vocabulary size", "seq_length": "--seq-length"}


def topk_file(directory: str, dp_rank: int) -> str:
    """The stored top-k file of data-parallel rank ``dp_rank`` under ``directory``."""
    return os.path.join(directory, f"teacher_topk_dp{dp_rank}.pt")


def topk_path(directory: str, par: Parallel) -> str:
    return topk_file(directory, par.dp_rank)


def topk_meta(args, vocab_size: int) -> dict:
    """What a stored top-k depends on besides the rows: checked when it is read back."""
    return {"format": TOPK_FORMAT, "topk": args.topk, "temperature": args.distill_temperature,
            "vocab_size": vocab_size, "seq_length": args.seq_length}


def needed_rows(train_rows, args, par: Parallel) -> list[int]:
    """The training rows this dp rank reads in ``args.steps`` steps."""
    return sorted({i % len(train_rows) for step in range(args.steps)
                   for i in _row_ids(step, args, par)})


def precompute_topk(teacher, train_rows, args, par, vocab_size: int) -> str:
    """Every training row's teacher top-k (this dp rank's rows), written once by tp rank 0:
    ``{**topk_meta, "rows": {row: (logprobs fp32, indices int32)}}``; returns the path."""
    stored = {}
    for i in needed_rows(train_rows, args, par):
        top = teacher_topk(teacher, train_rows[i], args, par, vocab_size)
        stored[i] = (top.logprobs.cpu(), top.indices.to(torch.int32).cpu())
    path = topk_path(args.out, par)
    if par.tp_rank == 0:
        content = {**topk_meta(args, vocab_size), "rows": stored}
        report.atomic_write(path, lambda f: torch.save(content, f), binary=True)
    dist.barrier()
    return path


def read_topk(path: str, meta: dict, shapes: dict[int, tuple[int, ...]], device) -> dict:
    """The stored top-k of the rows ``shapes`` (row -> its tokens' leading shape) from ``path``,
    as ``{row: TopK}`` on ``device``, after checking the file: written by
    :func:`precompute_topk` with this run's ``meta`` (top-k size, temperature, vocabulary,
    sequence length), holding every row with log-probs ``[*shape, topk]`` (float, no NaN, <= 0)
    and ids in ``[0, vocab_size)``. Raises ``ValueError`` naming the file otherwise."""
    where = f"--teacher-topk-load: {path}"
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist (written by a --teacher-topk precomputed run "
                         "with the same --tp/--dp layout?)") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear error
        raise ValueError(f"{where} is not a readable top-k file ({type(exc).__name__}: "
                         f"{exc})") from None
    if not isinstance(content, dict) or content.get("format") != meta["format"]:
        raise ValueError(f"{where} is not a teacher top-k file of this example (format "
                         f"{meta['format']!r})")
    for key, value in meta.items():
        if content.get(key) != value:
            raise ValueError(f"{where} was written with {_META_FLAGS.get(key, key)} "
                             f"{content.get(key)!r}, this run has {value!r}: recompute it with "
                             "--teacher-topk precomputed")
    rows = content.get("rows")
    out = {}
    for i, shape in shapes.items():
        entry = rows.get(i) if isinstance(rows, dict) else None
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2
                and all(isinstance(t, torch.Tensor) for t in entry)):
            raise ValueError(f"{where} holds no top-k for training row {i} (written for other "
                             "--steps, --micro-batches, --train-examples or --seed?)")
        logprobs, indices = entry
        want = (*shape, meta["topk"])
        if tuple(logprobs.shape) != want or tuple(indices.shape) != want \
                or not logprobs.dtype.is_floating_point or indices.dtype.is_floating_point:
            raise ValueError(f"{where}: row {i} holds {logprobs.dtype} {tuple(logprobs.shape)} "
                             f"log-probs and {indices.dtype} {tuple(indices.shape)} ids; expected "
                             f"float and integer {want} (this row's tokens x --topk)")
        if bool(((indices < 0) | (indices >= meta["vocab_size"])).any()):
            raise ValueError(f"{where}: row {i} holds ids outside [0, {meta['vocab_size']})")
        if bool((torch.isnan(logprobs) | (logprobs > 0)).any()):
            raise ValueError(f"{where}: row {i} holds NaN or positive log-probs")
        out[i] = TopK(logprobs.to(device), indices.to(device).long())
    return out


def load_topk(path: str, train_rows, args, par: Parallel, vocab_size: int) -> dict:
    """:func:`read_topk` of this dp rank's rows; an error on any rank raises on every rank
    (one all-reduce over the world), so none is left waiting in the training collectives."""
    shapes = {i: tuple(train_rows[i].loss_mask.shape)
              for i in needed_rows(train_rows, args, par)}
    error = None
    try:
        stored = read_topk(path, topk_meta(args, vocab_size), shapes, par.device)
    except ValueError as exc:
        error = exc
    failed = torch.tensor([int(error is not None)], device=par.device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if int(failed):
        raise ValueError("another rank rejected its --teacher-topk-load file (see its error)")
    return stored


def _row_ids(step: int, args, par: Parallel) -> list[int]:
    """Row indices :func:`.sft.step_rows` takes at ``step`` (before the modulo)."""
    per_step = args.micro_batches * par.dp
    first = 0 if args.repeat_batch else step * per_step
    return list(range(first, first + per_step))[par.dp_rank::par.dp]


def distill_forward_step(args, par: Parallel, vocab_size: int, teacher_vocab: int):
    """``forward_step`` over ``(batch, TopK)`` items: student logits, then distillation_loss."""

    def forward_step(data_iterator, model, *_, **__):
        batch, top = next(data_iterator)
        logits = model(**batch.model_inputs)
        return logits, functools.partial(
            distillation_loss, teacher=top, loss_mask=batch.loss_mask, tp_group=par.tp_group,
            vocab_size=vocab_size, teacher_vocab_size=teacher_vocab, divergence=args.divergence,
            beta=args.jsd_beta, tail_bucket=args.tail_bucket,
            temperature=args.distill_temperature,
            temperature_scale=args.distill_temperature_scale)

    return forward_step


def loaded_topk(train_rows, args, par: Parallel, vocab_size: int) -> dict:
    """The ``--teacher-topk-load`` files of this run's rows, checked (before any training)."""
    path = topk_path(args.teacher_topk_load, par)
    stored = load_topk(path, train_rows, args, par, vocab_size)
    if par.is_main:
        print(f"distill: teacher top-{args.topk} of {len(stored)} rows read from {path} (no "
              "teacher is built)", flush=True)
    return stored


def train_student(student, teacher, train_rows, args, par, vocab_size, teacher_vocab,
                  stored: dict | None = None):
    """``args.steps`` distillation steps; returns per-step reports. ``stored``: the teacher's
    top-k per row index when it was loaded (then ``teacher`` is None)."""
    if stored is None and args.teacher_topk == "precomputed":
        path = precompute_topk(teacher, train_rows, args, par, vocab_size)
        stored = load_topk(path, train_rows, args, par, vocab_size)
        if par.is_main:
            print(f"distill: teacher top-{args.topk} of {len(stored)} rows stored in {path} and "
                  "read back", flush=True)
    optimizer, scheduler = make_optimizer(student, args)
    forward_step = distill_forward_step(args, par, vocab_size, teacher_vocab)
    history = []
    for step in range(args.steps):
        start = time.perf_counter()
        items = []
        for i in _row_ids(step, args, par):
            batch = train_rows[i % len(train_rows)]
            if stored is None:
                top = teacher_topk(teacher, batch, args, par, vocab_size)
            else:
                top = stored[i % len(train_rows)]
            items.append((batch, top))
        optimizer.zero_grad(set_to_none=True)
        results = run_schedule(student, forward_step, items, forward_only=False,
                               seq_length=args.seq_length)
        norm = clip_grad_norm_(student, args.clip_grad, par)
        optimizer.step()
        scheduler.step()
        metrics = reduce_reports(results, REPORTED, par)
        history.append({"step": step + 1, **metrics, "grad_norm": norm.item(),
                        "seconds": time.perf_counter() - start})
        if par.is_main:
            print(f"distill step {step + 1}: loss {metrics['distill loss']:.4g} nats/token, "
                  f"top-k mass teacher {metrics['teacher topk mass']:.4g}, student "
                  f"{metrics['student topk mass']:.4g}", flush=True)
    return history


def run(model, data: dict, args, par: Parallel, alignment: int, thd: bool) -> dict:
    """The distill demo: teacher, student NLL before, distillation, NLL after; writes JSON."""
    vocab_size = data["tokenizer"].n_words
    train_examples, train_rows, test_batches = packed_rows(data, args, par, alignment, thd)
    shape = teacher_shape(args, vocab_size)
    stored = teacher = teacher_nll = None
    if args.teacher_topk_load:
        stored = loaded_topk(train_rows, args, par, vocab_size)
    else:
        teacher = build_teacher(args, shape, train_rows, par)
        teacher_nll = evaluate_nll(teacher, test_batches, par, args.seq_length)
    nll_before = evaluate_nll(model, test_batches, par, args.seq_length)
    teacher_text = "not built" if teacher_nll is None else f"{teacher_nll:.4f}"
    if par.is_main:
        print(f"distill: teacher test NLL {teacher_text}; student before {nll_before:.4f} "
              f"nats/answer token; top-{args.topk} {args.divergence}"
              f"{' + tail bucket' if args.tail_bucket else ''}, teacher top-k "
              f"{'loaded' if args.teacher_topk_load else args.teacher_topk}", flush=True)
    history = train_student(model, teacher, train_rows, args, par, vocab_size,
                            shape.vocab_size, stored)
    nll_after = evaluate_nll(model, test_batches, par, args.seq_length)
    result = {
        "mode": "distill",
        "config": {k: v for k, v in vars(args).items() if not callable(v)},
        "teacher": {"num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
                    "loaded": args.teacher_load, "test_nll": teacher_nll},
        "train": history,
        "test_nll": {"before": nll_before, "after": nll_after,
                     "examples": len(data["test"])},
    }
    if par.is_main:
        print(f"distill: student test NLL {nll_before:.4f} -> {nll_after:.4f} (teacher "
              f"{teacher_text})", flush=True)
        (path,) = report.report_paths(args.out, "distill")
        report.write_outputs({path: report.json_writer(result)})
        print(f"wrote {path}", flush=True)
    return result
