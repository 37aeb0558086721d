"""The Megatron loss function of top-k distillation: :func:`distillation_loss`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..losses.inputs import LossOutput, _check_float, _count, _pair, _token_mask
from ..ops.agreement import (
    Field,
    bits_float,
    checked_on_every_rank,
    float_bits,
    host_checks_enabled,
    tensor_checksum,
)
from ..ops.options import FP32_MAX, LOGP_MIN, MIN_TEMPERATURE, check_bool, check_number
from ..ops.topk.from_logits import vocab_parallel_topk_logprobs
from ..ops.topk.math import TopK
from .divergence import DIVERGENCES, DistillConfig, topk_divergence

StudentFn = Callable[..., torch.Tensor]


def _teacher_parts(teacher) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(teacher, tuple) and len(teacher) == 2):
        raise ValueError(f"teacher must be a TopK (logprobs, indices) pair, got "
                         f"{type(teacher).__name__}")
    logprobs, indices = teacher
    _check_float("teacher.logprobs", logprobs)
    if not isinstance(indices, torch.Tensor) or indices.dtype.is_floating_point \
            or indices.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise ValueError("teacher.indices must be an integer tensor [..., k] of global ids")
    if logprobs.shape != indices.shape or logprobs.dim() < 1:
        raise ValueError(f"teacher.logprobs {tuple(logprobs.shape)} and teacher.indices "
                         f"{tuple(indices.shape)} must both be [..., k], the same shape")
    if logprobs.shape[-1] == 0:
        raise ValueError(f"teacher: k = 0 (teacher.logprobs {tuple(logprobs.shape)}): the top-k "
                         "needs k >= 1 ids per token")
    return logprobs, indices


def _check_teacher_values(logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """``ValueError`` if a counted row holds NaN, a log-prob above 0, or probabilities summing above
    1 beyond rounding: u moves p by ``p |log p| u``, ``sum_k p |log p| <= log k`` (host read)."""
    lp = torch.where(mask.unsqueeze(-1), logprobs.detach().double(), float("-inf"))
    rows = lp.reshape(-1, lp.shape[-1])
    k = rows.shape[-1]
    unit = torch.finfo(logprobs.dtype).eps / 2
    tol = 2 * unit * (1 + math.log(k)) + k * 2.0**-22
    mass = torch.exp(rows).sum(dim=-1)
    for bad, what in ((torch.isnan(rows).any(dim=-1), "NaN"),
                      ((rows > 0).any(dim=-1), "a log-probability above 0"),
                      (mass > 1 + tol, "probabilities summing above 1")):
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"teacher.logprobs holds {what} at the counted token at flat position {row} "
                f"(log-probs {rows[row].tolist()[:8]}, mass {float(mass[row]):.6g}): a teacher's "
                "top-k are log-probabilities normalised over its vocabulary")


def _check_distinct(indices: torch.Tensor, mask: torch.Tensor) -> None:
    """``ValueError`` if a counted row of ``indices`` holds an id twice (reads the host)."""
    ids = indices.reshape(-1, indices.shape[-1]).sort(dim=-1).values
    twice = (ids[:, 1:] == ids[:, :-1]) & mask.reshape(-1, 1)
    if bool(twice.any()):
        row, col = twice.nonzero()[0].tolist()
        value = int(ids[row, col])
        raise ValueError(f"teacher.indices holds id {value} twice in the top-k of the counted "
                         f"token at flat position {row}: the divergence needs distinct ids "
                         "(mask padded positions out with loss_mask)")


def _student_vocab(student, vocab_size, tp_group) -> int | None:
    if vocab_size is not None or not isinstance(student, torch.Tensor) or student.dim() == 0:
        return vocab_size
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    return student.shape[-1] * tp


def distillation_loss(
    student: torch.Tensor | StudentFn,
    teacher: TopK,
    loss_mask: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    tail_bucket: bool = False,
    renormalize: bool = False,
    temperature: float = 1.0,
    temperature_scale: bool = False,
    chunk_size: int | None = None,
    validate: bool = False,
) -> LossOutput:
    """Top-k distillation loss from vocab-parallel student logits, in Megatron's loss contract.

    Reference semantics (one process, full vocabulary, ``m = loss_mask != 0``)::

        lq = torch.log_softmax(student_logits.float()[..., :V] / temperature, -1)
        lq = lq.gather(-1, teacher.indices)
        per_token = topk_divergence(lq, teacher.logprobs, loss_mask, divergence=..., ...)
        loss_sum = per_token.sum() * (temperature ** 2 if temperature_scale else 1)
        num_tokens = m.sum()

    computed by :func:`~megatron_vocabstats.vocab_parallel_topk_logprobs` without gathering the
    vocabulary or upcasting the logits. Communication, report entries and ``validate``:
    ``docs/distillation.md``.

    ``student``: this rank's logits shard ``[..., V/tp]``, or a fused LM head ``fn(indices, *,
    tp_group, mask, vocab_size, temperature, chunk_size, validate)`` returning the ``[..., k]``
    log-probs at ``indices``. ``teacher``: :class:`~megatron_vocabstats.TopK` ``(logprobs,
    indices)``, both ``[..., k]``: global ids, log-probs of any float dtype at the same
    ``temperature``. ``vocab_size``: the student's real vocabulary (default: shard width x tp);
    ``teacher_vocab_size``, if given, must equal it. ``divergence``, ``beta``, ``tail_bucket``,
    ``renormalize``: as :func:`topk_divergence`; ``temperature``, ``chunk_size``: the op's.

    Raises ``ValueError`` naming the argument: ``loss_mask`` missing or misshapen; a ``teacher``
    not a (float, integer) pair of one ``[..., k]`` shape, k >= 1; a ``student`` of another
    type; a ``teacher_vocab_size`` not the student's (or with a callable student and no
    ``vocab_size``); a non-bool ``validate`` or ``temperature_scale``; with the latter, a
    ``temperature`` whose square overflows fp32; with ``validate``, on every rank: teacher ids
    out of range or repeated, log-probs NaN, above 0 or summing above 1 (counted tokens), inputs
    or options differing across ranks; and what the op and :func:`topk_divergence` raise.
    """
    def local_checks():
        cfg = DistillConfig(divergence=divergence, beta=beta, tail_bucket=tail_bucket,
                            renormalize=renormalize)
        check_bool("validate", validate)
        if check_bool("temperature_scale", temperature_scale):
            tau = check_number("temperature", temperature, low=MIN_TEMPERATURE)
            if tau * tau > FP32_MAX:  # (tau ** 2 raises OverflowError from 1.4e154 on)
                raise ValueError(
                    f"temperature={tau!r} with temperature_scale=True: the loss's factor "
                    f"temperature ** 2 = {tau * tau:g} does not fit fp32 (temperature at most "
                    f"{math.sqrt(FP32_MAX):g})")
        teacher_lp, indices = _teacher_parts(teacher)
        mask = _token_mask(loss_mask, teacher_lp[..., 0], "teacher.logprobs[..., 0]")
        check_number("teacher_vocab_size", teacher_vocab_size, integer=True, low=1, none_ok=True)
        student_vocab = _student_vocab(student, vocab_size, tp_group)
        if teacher_vocab_size is not None and student_vocab is None:
            raise ValueError(f"teacher_vocab_size={teacher_vocab_size!r} cannot be checked: with "
                             "a callable student (fused LM head) pass the student's vocab_size too")
        if teacher_vocab_size is not None and teacher_vocab_size != student_vocab:
            raise ValueError(f"teacher_vocab_size={teacher_vocab_size!r} differs from the "
                             f"student's vocabulary size {student_vocab!r}: top-k distillation "
                             "compares probabilities of the same ids, so both models need one "
                             "vocabulary")
        if not (isinstance(student, torch.Tensor) or callable(student)):
            raise ValueError(f"student must be logits or a callable returning top-k log-probs, "
                             f"got {type(student).__name__}")
        if host_checks_enabled(validate, indices.device):
            _check_teacher_values(teacher_lp, mask)
        return cfg, teacher_lp, indices, mask

    device = getattr(teacher[0], "device", None) if isinstance(teacher, tuple) and teacher \
        else None
    cfg, teacher_lp, indices, mask = checked_on_every_rank(
        local_checks, tp_group, validate=validate, device=device,
        agree=((Field("loss_mask", checksum=True), lambda checked: tensor_checksum(checked[3])),
               (Field("teacher.logprobs", checksum=True),
                lambda checked: tensor_checksum(checked[1], checked[3])),
               ("divergence", lambda checked: DIVERGENCES.index(checked[0].divergence),
                DIVERGENCES.__getitem__),
               ("beta", lambda checked: float_bits(checked[0].beta), bits_float),
               ("tail_bucket", lambda checked: int(checked[0].tail_bucket), bool),
               ("renormalize", lambda checked: int(checked[0].renormalize), bool),
               ("temperature_scale", lambda _: int(bool(temperature_scale)), bool)),
        hint="every tensor-parallel rank must pass the same teacher top-k and loss_mask")
    kwargs = dict(tp_group=tp_group, mask=mask, vocab_size=vocab_size, temperature=temperature,
                  chunk_size=chunk_size, validate=validate)
    if isinstance(student, torch.Tensor):
        student_lp = vocab_parallel_topk_logprobs(student, indices, **kwargs)
    else:
        student_lp = student(indices, **kwargs)
    if host_checks_enabled(validate, indices.device):
        # After the op: its checks made every rank agree on the ids and mask, so all raise alike.
        _check_distinct(indices, mask)
    per_token = topk_divergence(student_lp, teacher_lp, mask, divergence=cfg.divergence,
                                beta=cfg.beta, tail_bucket=cfg.tail_bucket,
                                renormalize=cfg.renormalize)
    num_tokens = _count(mask)
    loss_sum = per_token.sum()
    if temperature_scale:
        loss_sum = loss_sum * (float(temperature) ** 2)
    keep = mask.unsqueeze(-1)

    def mass(lp):
        return torch.where(keep, lp.detach().float().clamp(min=LOGP_MIN).exp(), 0.0).sum()

    report = {"distill loss": _pair(loss_sum, num_tokens),
              "teacher topk mass": _pair(mass(teacher_lp), num_tokens),
              "student topk mass": _pair(mass(student_lp), num_tokens)}
    return LossOutput(loss_sum, num_tokens, report)
