"""Top-k distillation losses: divergences over the teacher's top-k, in Megatron's loss contract.

Two layers, as in :mod:`megatron_vocabstats.losses`:

* :func:`topk_divergence`: a pure per-token function of the teacher's top-k log-probs and the
  student's log-probs at the same ids (forward KL, reverse KL, JSD(beta); optional tail bucket,
  optional renormalisation over the top-k).
* :func:`distillation_loss`: the student's log-probs at the teacher's ids from vocab-parallel logits
  (:func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`) or a fused LM head, then
  :func:`topk_divergence`, returned as ``(loss_sum, num_tokens, report)``.

Semantics (``docs/numerics.md``, "Top-k distillation"): both sides are normalised over the full
vocabulary unless ``renormalize=True``. Each divergence is a sum over buckets (the k ids, plus
the tail ``log(1 - sum_k p)`` when ``tail_bucket``) of the Bregman form of KL,

    D(p || q) = sum_i p_i (r_i - 1 + e^{-r_i}) = sum_i [p_i log(p_i / q_i) - p_i + q_i],
    r_i = log p_i - log q_i,

each term >= 0 and exactly 0 where ``p_i == q_i``. With the tail bucket (or ``renormalize``) both
sides sum to 1 and this is the ordinary KL; over the bare top-k it is the generalised
(I-)divergence of the two unnormalised top-k measures, which is still >= 0 and 0 only when the
student matches the teacher on every top-k id. So KL >= 0 holds numerically, and KL(p, p) is 0
bit for bit in every dtype.

The tail mass ``1 - sum_k p`` is floored at the resolution of 1 in the computation dtype (fp32:
2**-23): below it the rounded top-k log-probs do not determine it (the sum is only known to a few
ulps), and a tail that rounds to 0 would make reverse KL (teacher side) or forward KL (student
side) infinite. Both sides are floored alike, so KL(p, p) stays exactly 0.

No host synchronisation (no ``.item()``, no value-dependent shapes); collectives only in the op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .losses import LossOutput, _check_float, _count, _pair, _token_mask
from .ops._checks import (
    Field,
    bits_float,
    checked_on_every_rank,
    float_bits,
    host_checks_enabled,
    tensor_checksum,
)
from .ops._math import LOGP_MIN
from .ops.topk import TopK, vocab_parallel_topk_logprobs

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
_LN2 = math.log(2.0)
_INF = float("inf")


@dataclass(frozen=True, slots=True, kw_only=True)
class DistillConfig:
    """Options of :func:`topk_divergence`, validated on construction (meaning: see there)."""

    divergence: str = "forward_kl"
    beta: float = 0.5
    tail_bucket: bool = False
    renormalize: bool = False

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) \
                or not 0.0 < self.beta < 1.0:
            raise ValueError(
                f"beta must be a number in (0, 1), got {self.beta!r}: at 0 and 1 the mixture is "
                "one of the two sides and JSD(beta) is identically 0 (TRL and Liger map beta=0 "
                "and 1 to forward and reverse KL by convention: pass divergence='forward_kl' or "
                "'reverse_kl' for those)")
        for name in ("tail_bucket", "renormalize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.tail_bucket and self.renormalize:
            raise ValueError("tail_bucket and renormalize exclude each other: renormalising over "
                             "the top-k leaves no mass outside it")


# ---------------------------------------------------------------------------------------------
# Pure per-bucket math


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for log-masses ``x``, stably (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))"): ``log(-expm1(x))`` above ``-ln 2``, ``log1p(-exp(x))`` below; -inf for
    ``x >= 0`` (no mass left, rounding included). Gradients stay finite."""
    live = x < 0
    xs = torch.where(live, x, -1.0)
    out = torch.where(xs > -_LN2, torch.log(-torch.expm1(xs)), torch.log1p(-torch.exp(xs)))
    return torch.where(live, out, -_INF)


def bregman_kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Per-bucket ``p (r - 1 + e^{-r})`` with ``r = lp - lq`` (log-masses): >= 0, exactly 0 where
    ``lp == lq``; ``q`` where ``p = 0``, +inf where ``q = 0 < p``, NaN where an input is NaN.

    ``p (r + expm1(-r))`` for ``r > -1`` (no cancellation near 0), ``p r - p + q`` below (there
    ``q >= e p``); a clamp at 0 absorbs the last rounding, so the sum over buckets is >= 0.
    """
    finite = ~(torch.isneginf(lp) | torch.isneginf(lq))  # NaN stays NaN
    lp_s, lq_s = torch.where(finite, lp, 0.0), torch.where(finite, lq, 0.0)
    r = lp_s - lq_s
    p, q = torch.exp(lp_s), torch.exp(lq_s)
    r_near = r.clamp(min=-1.0)
    term = torch.where(r > -1.0, p * (r_near + torch.expm1(-r_near)), p * r - p + q).clamp(min=0.0)
    edge = torch.where(lp == -_INF, torch.exp(lq), _INF)
    return torch.where(finite, term, edge)


def _mixture(lp: torch.Tensor, lq: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta p + (1 - beta) q)``; exactly ``lp`` where ``lp == lq``, -inf where both are."""
    both = (lp == -_INF) & (lq == -_INF)
    a, b = torch.where(both, 0.0, lp), torch.where(both, 0.0, lq)
    mixed = torch.logaddexp(a + math.log(beta), b + math.log1p(-beta))
    return torch.where(both, -_INF, torch.where(lp == lq, lp, mixed))


def _buckets(logprobs: torch.Tensor, cfg: DistillConfig) -> torch.Tensor:
    """The ``[..., k]`` log-masses as the divergence sees them: renormalised over the top-k, or
    with the tail ``log(1 - sum_k p)`` (floored at ``log eps`` of the dtype, see the module
    docstring) appended as bucket k + 1, or as they are.

    A row with no mass on its top-k (all -inf) stays all -inf under ``renormalize`` (0/0 has no
    value; the divergence is then +inf or 0, never NaN, and its gradient finite).
    """
    if cfg.renormalize:
        dead = torch.isneginf(logprobs).all(dim=-1, keepdim=True)
        live = torch.where(dead, 0.0, logprobs)
        return torch.where(dead, logprobs, live - torch.logsumexp(live, dim=-1, keepdim=True))
    if cfg.tail_bucket:
        floor = math.log(torch.finfo(logprobs.dtype).eps)
        tail = log1mexp(torch.logsumexp(logprobs, dim=-1, keepdim=True)).clamp(min=floor)
        return torch.cat([logprobs, tail], dim=-1)
    return logprobs


def topk_divergence(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    tail_bucket: bool = False,
    renormalize: bool = False,
) -> torch.Tensor:
    """Per-token divergence between teacher and student over the teacher's top-k ids.

    With ``p`` the teacher's and ``q`` the student's probabilities at the same k ids (plus the
    tail bucket ``1 - sum_k`` with ``tail_bucket``; divided by their top-k sums with
    ``renormalize``) and the Bregman form ``D(a || b) = sum_i [a_i log(a_i / b_i) - a_i + b_i]``
    (the module docstring):

    * ``"forward_kl"``: ``D(p || q)`` (mode-covering; Hinton et al. 2015 distillation);
    * ``"reverse_kl"``: ``D(q || p)`` (mode-seeking; Gu et al. 2024, MiniLLM);
    * ``"jsd"``: ``beta D(p || m) + (1 - beta) D(q || m)`` with ``m = beta p + (1 - beta) q``:
      beta weights the teacher, in the mixture and in the sum (the generalised JSD of Agarwal
      et al. 2024, "On-Policy Distillation of Language Models" (GKD), as TRL's
      ``generalized_jsd_loss``); beta = 0.5 is the ordinary Jensen-Shannon divergence.

    Args:
        student_logprobs: floating ``[..., k]`` log q at the teacher's ids (nats; normalised over
            the full vocabulary, e.g. :func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`);
            differentiable.
        teacher_logprobs: floating ``[..., k]`` log p of the teacher's top-k (same ids, same
            order); treated as a constant. -inf allowed (zero teacher mass).
        loss_mask: ``[...]`` (the leading shape), non-zero where a token counts. Required.
        divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: in (0, 1), used by ``"jsd"`` only. JSD(beta) tends to 0 at both ends (accurate
            up to them: tested at 1e-4 and 1 - 1e-4); 0 and 1 raise (see ``DistillConfig``).
        tail_bucket: add the mass outside the top-k as one more bucket, ``log(1 - sum_k p)``
            computed with ``log1mexp`` (``log(-expm1)`` / ``log1p(-exp)``).
        renormalize: normalise both sides over the top-k instead of the full vocabulary.

    Returns:
        fp32 (float64 for float64 inputs) ``[...]``, >= 0, exactly 0 at masked positions with
        exactly zero gradient whatever the inputs hold there (NaN, -inf, duplicate ids), and
        exactly 0 where student and teacher log-probs are equal. +inf where the teacher has mass
        on a bucket the student gives none (forward KL), or the reverse.

    Raises:
        ValueError: ``loss_mask`` None or misshapen, non-floating or misshapen log-probs, an
            unknown ``divergence``, ``beta`` outside (0, 1), ``tail_bucket`` with ``renormalize``.
    """
    cfg = DistillConfig(divergence=divergence, beta=beta, tail_bucket=tail_bucket,
                        renormalize=renormalize)
    _check_float("student_logprobs", student_logprobs)
    _check_float("teacher_logprobs", teacher_logprobs)
    if student_logprobs.dim() < 1 or teacher_logprobs.shape != student_logprobs.shape:
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)} and student_logprobs "
                         f"{tuple(student_logprobs.shape)} must both be [..., k], the same shape")
    if student_logprobs.shape[-1] == 0:
        raise ValueError(f"student_logprobs and teacher_logprobs have k = 0 (shape "
                         f"{tuple(student_logprobs.shape)}): the divergence needs k >= 1")
    if teacher_logprobs.device != student_logprobs.device:
        raise ValueError(f"teacher_logprobs is on {teacher_logprobs.device} but student_logprobs "
                         f"on {student_logprobs.device}")
    mask = _token_mask(loss_mask, student_logprobs[..., 0], "student_logprobs[..., 0]")
    dtype = torch.promote_types(student_logprobs.dtype, torch.float32)
    keep = mask.unsqueeze(-1)
    # Masked rows become all-zero log-probs: every later op is finite there.
    lq = _buckets(torch.where(keep, student_logprobs.to(dtype), 0.0), cfg)
    lp = _buckets(torch.where(keep, teacher_logprobs.detach().to(dtype), 0.0), cfg)
    if cfg.divergence == "forward_kl":
        per_bucket = bregman_kl(lp, lq)
    elif cfg.divergence == "reverse_kl":
        per_bucket = bregman_kl(lq, lp)
    else:
        lm = _mixture(lp, lq, cfg.beta)
        per_bucket = cfg.beta * bregman_kl(lp, lm) + (1.0 - cfg.beta) * bregman_kl(lq, lm)
    return torch.where(mask, per_bucket.sum(dim=-1), 0.0)


# ---------------------------------------------------------------------------------------------
# Megatron loss function


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
    """``ValueError`` if a counted row of the teacher's ``[..., k]`` log-probs holds NaN, a value
    above 0, or probabilities summing above 1 (reads the host).

    Tolerance of the sum: a log-prob stored with unit roundoff u (of its dtype) moves its
    probability by at most ``p |log p| u``, and ``sum_k p |log p| <= log k`` for a mass <= 1; the
    fp32 softmax the teacher came from adds at most a few ulps per term.
    """
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
    """``ValueError`` if a counted row of ``indices`` ``[..., k]`` holds an id twice (reads the
    host; a teacher's top-k never does)."""
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

    computed without gathering the vocabulary or upcasting the logits
    (:func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`). ``functools.partial`` of it over
    everything but ``student`` is a Megatron ``loss_func``: the schedule divides ``loss_sum`` by
    ``num_tokens`` (and the number of microbatches).

    Args:
        student: this rank's student logits shard ``[..., V/tp]`` (bf16/fp16/fp32; Megatron
            ``[b, s, V/tp]``), or a callable ``fn(indices, *, tp_group, mask, vocab_size,
            temperature, chunk_size, validate) -> [..., k] log-probs``, e.g.
            ``functools.partial(linear_vocab_parallel_topk_logprobs, hidden, weight)`` (fused
            LM head).
        teacher: :class:`~megatron_vocabstats.TopK` ``(logprobs [..., k], indices [..., k])`` of
            the teacher, computed on the fly (:func:`~megatron_vocabstats.vocab_parallel_topk`
            with the same ``temperature``) or precomputed and stored (any float dtype; upcast).
        loss_mask: ``[...]`` the leading shape, non-zero where a token counts. Required: padded
            positions (often k copies of id 0) must be masked out; they then give exactly 0 and
            zero gradient.
        tp_group: the student vocabulary's tensor-parallel group; None = no tensor parallelism.
        vocab_size: the student's real vocabulary size (default: shard width x tp).
        teacher_vocab_size: the teacher's real vocabulary size, if known: must equal the
            student's (``ValueError`` otherwise; distillation over ids needs one vocabulary).
        divergence, beta, tail_bucket, renormalize: as :func:`topk_divergence`.
        temperature, chunk_size: of the student op (the logits are divided by the temperature).
        temperature_scale: multiply the loss (and so its gradient) by ``temperature ** 2``, the
            soft-target scaling of Hinton, Vinyals and Dean 2015 ("Distilling the Knowledge in a
            Neural Network", sec. 2): the gradient of a softened KL shrinks like
            ``1 / temperature ** 2``, and the factor keeps its magnitude independent of the
            temperature (e.g. when mixed with a hard-label loss). False (default): the
            divergence as it is, as TRL's GKD and Megatron's ModelOpt KD do not scale either.
        validate: the op's host-reading checks (off by default in a training step, as in
            :class:`~megatron_vocabstats.losses.StatsOptions`): teacher ids outside
            ``[0, vocab_size)`` at counted tokens, an id twice in one counted token's top-k, or
            teacher log-probs that are NaN, above 0 or whose probabilities sum above 1 (beyond
            their rounding) raise ``ValueError`` on every rank, and so do ``k``, ``indices``,
            ``loss_mask``, teacher log-probs or the divergence's options (``divergence``,
            ``beta``, ``tail_bucket``, ``renormalize``, ``temperature_scale``) that differ
            across the ranks of ``tp_group``; every check of this function then raises on every
            rank (one all-gather of a few int64 before the op's). Without it an out-of-range id
            makes the loss NaN (never a silently wrong number); a repeated id counts as a bucket
            of its own each time (the top-k measures then weigh that id twice, and with
            ``tail_bucket`` the teacher's mass may exceed 1, so the loss has no meaning).

    Returns:
        :class:`~megatron_vocabstats.LossOutput`: ``loss_sum`` fp32 scalar, ``num_tokens`` int32,
        report ``[sum, count]`` of ``"distill loss"``, ``"teacher topk mass"`` and
        ``"student topk mass"`` (mean probability mass on the top-k per counted token).

    Communication: the op's (one all-gather of ``[5 + k, T]`` fp32 under tensor parallelism).

    Raises:
        ValueError: naming the argument: ``loss_mask`` missing or misshapen, a ``teacher`` that
            is not a (logprobs, indices) pair of equal ``[..., k]`` shapes, ``teacher_vocab_size``
            different from the student's, a ``student`` of another type,
            ``temperature_scale`` not a bool, with ``validate`` repeated ids (see there), and
            what :func:`topk_divergence` and the op raise.
    """
    def local_checks():
        cfg = DistillConfig(divergence=divergence, beta=beta, tail_bucket=tail_bucket,
                            renormalize=renormalize)
        if not isinstance(temperature_scale, bool):
            raise ValueError(f"temperature_scale must be a bool, got {temperature_scale!r}")
        teacher_lp, indices = _teacher_parts(teacher)
        mask = _token_mask(loss_mask, teacher_lp[..., 0], "teacher.logprobs[..., 0]")
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
        if host_checks_enabled(validate is True, indices.device):
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
               ("temperature_scale", lambda _: int(temperature_scale), bool)),
        hint="every tensor-parallel rank must pass the same teacher top-k and loss_mask")
    kwargs = dict(tp_group=tp_group, mask=mask, vocab_size=vocab_size, temperature=temperature,
                  chunk_size=chunk_size, validate=validate)
    if isinstance(student, torch.Tensor):
        student_lp = vocab_parallel_topk_logprobs(student, indices, **kwargs)
    else:
        student_lp = student(indices, **kwargs)
    if host_checks_enabled(validate is True, indices.device):
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
