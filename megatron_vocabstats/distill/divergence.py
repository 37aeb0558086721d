"""The per-token divergences over the teacher's top-k, their options and the per-bucket math."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..losses.inputs import _check_float, _token_mask
from ..ops.options import check_bool, check_choice, check_number

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
        check_choice("divergence", self.divergence, DIVERGENCES)
        try:
            beta = check_number("beta", self.beta, low=0.0, high=1.0, low_open=True,
                                high_open=True)
        except ValueError as exc:
            raise type(exc)(
                f"{exc}: at 0 and 1 the mixture is one of the two sides and JSD(beta) is "
                "identically 0 (TRL and Liger map beta=0 and 1 to forward and reverse KL by "
                "convention: pass divergence='forward_kl' or 'reverse_kl' for those)") from None
        object.__setattr__(self, "beta", beta)
        for name in ("tail_bucket", "renormalize"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        if self.tail_bucket and self.renormalize:
            raise ValueError("tail_bucket and renormalize exclude each other: renormalising over "
                             "the top-k leaves no mass outside it")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - e^x)`` for log-masses ``x``, stably (Maechler 2012): ``log(-expm1(x))`` above
    ``-ln 2``, ``log1p(-exp(x))`` below; -inf for ``x >= 0``. Gradients stay finite."""
    live = x < 0
    xs = torch.where(live, x, -1.0)
    near = xs > -_LN2
    # Each formula sees only its own arguments: log1p(-exp(x)) of x within 3e-8 of 0 is -inf in
    # fp32, and its derivative's 0 / 0 would reach the gradient through the unchosen branch.
    out = torch.where(near, torch.log(-torch.expm1(torch.where(near, xs, -1.0))),
                      torch.log1p(-torch.exp(torch.where(near, -1.0, xs))))
    return torch.where(live, out, -_INF)


def bregman_kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """Per-bucket ``p (r - 1 + e^{-r})`` with ``r = lp - lq`` (log-masses): >= 0, exactly 0 where
    ``lp == lq``; ``q`` where ``p = 0``, +inf where ``q = 0 < p``, NaN where an input is NaN."""
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
    """The log-masses the divergence sees: renormalised over the top-k, or with the floored tail
    ``log(1 - sum_k p)`` appended, or as they are."""
    if not (cfg.renormalize or cfg.tail_bucket):
        return logprobs
    # logsumexp's gradient over a row of -inf only is exp(-inf - -inf) = NaN: take it over zeros
    # there and select -inf (the row's top-k mass is 0).
    dead = torch.isneginf(logprobs).all(dim=-1, keepdim=True)
    live = torch.where(dead, 0.0, logprobs)
    lse = torch.logsumexp(live, dim=-1, keepdim=True)
    if cfg.renormalize:
        return torch.where(dead, logprobs, live - lse)
    floor = math.log(torch.finfo(logprobs.dtype).eps)
    tail = log1mexp(torch.where(dead, -_INF, lse)).clamp(min=floor)
    return torch.cat([logprobs, tail], dim=-1)


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
    tail ``1 - sum_k`` with ``tail_bucket``; divided by their top-k sums with ``renormalize``) and
    ``D(a || b) = sum_i [a_i log(a_i / b_i) - a_i + b_i]``:

    * ``"forward_kl"``: ``D(p || q)`` (mode-covering; Hinton et al. 2015);
    * ``"reverse_kl"``: ``D(q || p)`` (mode-seeking; Gu et al. 2024, MiniLLM);
    * ``"jsd"``: ``beta D(p || m) + (1 - beta) D(q || m)``, ``m = beta p + (1 - beta) q``, beta in
      (0, 1) weighting the teacher (Agarwal et al. 2024, GKD; TRL's ``generalized_jsd_loss``).

    ``student_logprobs``: floating ``[..., k]`` log q at the teacher's ids, normalised over the
    full vocabulary (:func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`), differentiable;
    ``teacher_logprobs``: the same for p, a constant (-inf allowed); ``loss_mask``: ``[...]``.
    Edge cases (floors, -inf, masked rows): ``docs/distillation.md``.

    Returns fp32 (float64 for float64 inputs) ``[...]``, >= 0; exactly 0 with zero gradient at
    masked positions and where both sides are equal. Raises ``ValueError``: ``loss_mask`` None or
    misshapen, non-floating or misshapen log-probs, an unknown ``divergence``, ``beta`` outside
    (0, 1), ``tail_bucket`` with ``renormalize``.
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
