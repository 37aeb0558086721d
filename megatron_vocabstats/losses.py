"""Loss functions with Megatron's ``(loss_sum, num_tokens, report)`` contract, and a forward_step.

Two layers, kept apart:

* **Per-token losses** (pure functions of per-token tensors, no process groups, no mutation of
  inputs): :func:`nll_loss` (SFT), :func:`policy_loss` (PPO / GRPO), :func:`score_tokens`
  (forward-only scoring). Each takes ``logprobs`` first and ``loss_mask`` / ``entropy`` as
  keywords, so any of them can be handed to :func:`token_loss` or :func:`make_forward_step`.
* **Where the per-token statistics come from**: :func:`token_stats` turns a model output into
  :class:`~megatron_vocabstats.VocabStats`: vocab-parallel logits (unfused, through
  :func:`~megatron_vocabstats.vocab_parallel_stats`), an already computed ``VocabStats`` (a fused
  LM head that returns them), or a callable with ``vocab_parallel_stats``'s keywords (for example
  ``functools.partial(linear_vocab_parallel_stats, hidden, weight)``).
  :func:`token_loss` composes the two; :func:`sft_loss` and :func:`logprobs_step` are it with
  :func:`nll_loss` and :func:`score_tokens`.

Megatron's loss contract (``megatron.core.pipeline_parallel.schedules.forward_step_calc_loss``):
the schedule divides ``loss_sum`` by ``max(num_tokens, 1)`` and by the number of microbatches,
unless ``calculate_per_token_loss`` is set, in which case the sums over microbatches and
data-parallel ranks are divided by the summed ``num_tokens``. Report values are 2-element
``[sum, count]`` tensors, summed over microbatches and data-parallel ranks, then divided.

Nothing here synchronises with the host: no ``.item()``, no branch on tensor values, no
data-dependent shape; token counts stay on the device. (The op's own ``validate`` checks do read
the host; they are off by default here, see :class:`StatsOptions`.) Communication: only the op's
(one all-gather of ``[5, T]`` fp32 in forward under tensor parallelism), none in the losses.
"""

from __future__ import annotations

import functools
import inspect
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .megatron.compat import tp_group_of
from .ops import VocabStats, vocab_parallel_stats
from .ops._checks import Field, checked_on_every_rank, tensor_checksum
from .rollout import RolloutCorrection, correction_weights, mismatch_diagnostics

IGNORE_INDEX = -100
AGGREGATIONS = ("token-mean", "sequence-mean")
KL_ESTIMATORS = ("k1", "k3")
# Log-ratios are clamped to +-LOG_RATIO_LIMIT before exp: ratios beyond e^20 (5e8) mean the
# rollout came from another policy; the clamp keeps exp finite so that the backward pass of a
# clipped token (0 * ratio) stays 0 instead of 0 * inf = NaN.
LOG_RATIO_LIMIT = 20.0
# tp_group value of make_forward_step meaning "read the tensor-parallel group from the model".
FROM_MODEL = "model"


class LossOutput(NamedTuple):
    """Megatron's loss-function result; unpacks as ``loss_sum, num_tokens, report``.

    ``loss_sum``: scalar fp32 (float64 for float64 inputs), the sum to be divided by
    ``num_tokens``. ``num_tokens``: scalar int32 on the inputs' device. ``report``: name ->
    fp32 ``[sum, count]`` (except in :func:`score_tokens`, see there).
    """

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    report: dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Input checks (shapes, dtypes, devices and options only: never tensor values)

_EVERY_RANK_HINT = ("every tensor-parallel rank must pass the same labels, loss_mask and "
                    "per-token inputs")



def _check_float(name: str, tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if like is not None:
        if tensor.shape != like.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but logprobs has {tuple(like.shape)}; "
                "every per-token tensor must have the same shape"
            )
        if tensor.device != like.device:
            raise ValueError(f"{name} is on {tensor.device} but logprobs on {like.device}")


def _token_mask(loss_mask, like: torch.Tensor, like_name: str = "logprobs") -> torch.Tensor:
    """``loss_mask != 0`` as bool, after checking it is present and shaped like ``like``."""
    if loss_mask is None:
        raise ValueError(
            "loss_mask is required (a tensor shaped like the tokens, non-zero where a token "
            "counts); pass torch.ones_like(...) to count every token"
        )
    if not isinstance(loss_mask, torch.Tensor):
        raise ValueError(f"loss_mask must be a tensor, got {type(loss_mask).__name__}")
    if loss_mask.shape != like.shape:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)} but {like_name} has "
            f"{tuple(like.shape)}"
        )
    if loss_mask.device != like.device:
        raise ValueError(f"loss_mask is on {loss_mask.device} but {like_name} on {like.device}")
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _per_token_inputs(logprobs, loss_mask, **optional) -> torch.Tensor:
    """Check ``logprobs``, the mask and the other per-token tensors; return the bool mask."""
    _check_float("logprobs", logprobs)
    if logprobs.dim() == 0:
        raise ValueError("logprobs must have at least one (token) dimension, got a scalar")
    mask = _token_mask(loss_mask, logprobs)
    for name, tensor in optional.items():
        if tensor is not None:
            _check_float(name, tensor, like=logprobs)
    return mask


def _check_number(name: str, value, *, low: float | None = None, low_open: bool = False,
                  allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (float("-inf") < value < float("inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Small pure helpers


def _compute_dtype(logprobs: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logprobs.dtype, torch.float32)


def _masked(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype`` with masked-out positions set to 0 (NaN or inf there included)."""
    return torch.where(mask, values.to(dtype), 0.0)


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dtype=torch.int32)


def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A detached fp32 ``[sum, count]`` report entry: a copy, since the schedule divides the loss
    in place."""
    return torch.stack([total.detach().float(), count.float()])


# ---------------------------------------------------------------------------------------------
# Per-token losses


def nll_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
             entropy: torch.Tensor | None = None) -> LossOutput:
    """Masked token cross-entropy (SFT) from per-token log-probs, in Megatron's loss contract.

    Reference semantics (plain PyTorch, ``m = loss_mask != 0``)::

        loss_sum = -(logprobs * m).sum();  num_tokens = m.sum()

    so Megatron's division gives the token-mean cross-entropy in nats. Label smoothing, if any,
    is already in ``logprobs`` (``vocab_parallel_stats(label_smoothing=eps)`` returns
    ``sum_j q_j log p_j``).

    Args:
        logprobs: ``[...]`` floating, log p(target) per token (nats), any shape.
        loss_mask: shaped like ``logprobs``, any dtype; a token counts where it is non-zero
            (fractional weights are not applied: 0.5 counts as 1). Required.
        entropy: optional per-token entropy shaped like ``logprobs``, only reported.

    Returns:
        :class:`LossOutput`; report ``{"lm loss": [sum nll, n]}`` and, with ``entropy``,
        ``"entropy": [sum H, n]``. Masked positions contribute exactly 0 to values and
        gradients, whatever they hold (NaN included).

    Raises:
        ValueError: ``loss_mask`` None, a non-floating ``logprobs``/``entropy``, shapes or
            devices that differ, or a scalar ``logprobs``.
    """
    mask = _per_token_inputs(logprobs, loss_mask, entropy=entropy)
    dtype = _compute_dtype(logprobs)
    num_tokens = _count(mask)
    loss_sum = -_masked(logprobs, mask, dtype).sum()
    report = {"lm loss": _pair(loss_sum, num_tokens)}
    if entropy is not None:
        report["entropy"] = _pair(_masked(entropy, mask, dtype).sum(), num_tokens)
    return LossOutput(loss_sum, num_tokens, report)


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyLossConfig:
    """Options of :func:`policy_loss`, validated on construction (see there for their meaning)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"

    def __post_init__(self):
        _check_number("clip_eps", self.clip_eps, low=0.0, low_open=True)
        if self.clip_eps >= 1.0:
            raise ValueError(f"clip_eps must be < 1 (the ratio floor is 1 - clip_eps), "
                             f"got {self.clip_eps!r}")
        _check_number("clip_eps_high", self.clip_eps_high, low=0.0, low_open=True,
                      allow_none=True)
        _check_number("dual_clip", self.dual_clip, low=1.0, low_open=True, allow_none=True)
        _check_number("kl_coef", self.kl_coef, low=0.0)
        _check_number("entropy_coef", self.entropy_coef)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, "
                             f"got {self.kl_estimator!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, "
                             f"got {self.aggregation!r}")


def _kl_to_reference(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from ``log_ratio = log ref - log pi`` (samples of pi).

    Schulman, "Approximating KL divergence" (2020), with r = ref / pi: k1 = -log r,
    k3 = (r - 1) - log r (unbiased, >= 0).
    """
    if estimator == "k1":
        return -log_ratio
    return torch.expm1(log_ratio) - log_ratio


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str):
    """``(loss_sum, num_units)``: tokens for token-mean, non-empty rows for sequence-mean."""
    if aggregation == "token-mean":
        return per_token.sum(), _count(mask)
    row_tokens = mask.sum(dim=-1)
    row_means = per_token.sum(dim=-1) / row_tokens.clamp(min=1).to(per_token.dtype)
    return row_means.sum(), _count(row_tokens > 0)


def _policy_terms(lp, old, adv, mask, entropy, ref, cfg: PolicyLossConfig, weights=None):
    """Per-token loss (0 where masked) and the per-token metrics (detached) of the policy loss.

    The inputs are already 0 at masked positions, so everything there is finite (ratio 1).
    ``weights`` (detached rollout-correction weights, or None) multiply the clipped surrogate
    only, not the KL and entropy terms.
    """
    log_ratio = (lp - old).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_eps, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip fraction": clipped > unclipped}
    if cfg.dual_clip is not None:
        bound = -cfg.dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual clip fraction"] = dual
    if weights is not None:
        loss = loss * weights
    # Schulman's k3 for KL(pi_old || pi) on samples of pi_old: r = pi / pi_old.
    lr = log_ratio.detach()
    metrics["approx kl"] = torch.expm1(lr) - lr
    metrics["logprob"] = lp.detach()
    if ref is not None:
        ref_log_ratio = (ref - lp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        kl = _kl_to_reference(ref_log_ratio, cfg.kl_estimator)
        if cfg.kl_coef != 0.0:
            loss = loss + cfg.kl_coef * kl
        metrics["ref kl"] = kl.detach()
    if entropy is not None:
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * entropy
        metrics["entropy"] = entropy.detach()
    return torch.where(mask, loss, 0.0), metrics


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    aggregation: str = "token-mean",
    rollout_logprobs: torch.Tensor | None = None,
    rollout_correction: RolloutCorrection | None = None,
    rollout_outside: torch.Tensor | None = None,
) -> LossOutput:
    """PPO / GRPO clipped-surrogate policy loss in Megatron's loss contract.

    Per token t with ``r = exp(logprobs - old_logprobs)`` (log-ratio clamped to +-20) and
    advantage A (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7)::

        pg = max(-A r, -A clip(r, 1 - clip_eps, 1 + clip_eps_high))
        pg = min(pg, -dual_clip * A)  where A < 0     # dual clip, Ye et al. 2020 (AAAI), eq. 5
        loss_t = w_t * pg + kl_coef * KL_t - entropy_coef * entropy_t

    ``KL_t`` estimates KL(pi || pi_ref) from ``d = ref_logprobs - logprobs``: ``"k1"`` is ``-d``,
    ``"k3"`` is ``exp(d) - d - 1`` (Schulman 2020, "Approximating KL divergence"; k3 is GRPO's
    penalty, Shao et al. 2024, "DeepSeekMath", eq. 4). Gradients flow into ``logprobs`` (through
    r and the KL term) and ``entropy``; ``old_logprobs``, ``advantages`` and ``ref_logprobs``
    are treated as constants.

    Rollout correction: ``w_t = 1`` unless ``rollout_correction`` is given; then ``w_t`` is the
    detached weight of :func:`~megatron_vocabstats.rollout.correction_weights` from
    ``old_logprobs`` (the trainer's recomputation) and ``rollout_logprobs`` (the engine's):
    truncated IS (``"tis"``, Yao et al. 2025), masked IS (``"mis"``, verl) or IcePop
    (``"icepop"``, arXiv:2510.18855), per token or per sequence, see
    :class:`~megatron_vocabstats.rollout.RolloutCorrection`. It multiplies the clipped surrogate
    only, as verl and TRL apply it; the KL and entropy terms are not weighted. Tokens that the
    correction drops (weight 0) still count in ``num_tokens`` (their KL and entropy terms still
    apply); verl's rejection sampling, which also removes them from the denominator, is
    ``loss_mask & ~flags`` with the flags of ``correction_weights``. Without
    ``rollout_correction`` the loss, its gradient and the other report entries are bit for bit
    those of the call without the rollout arguments (which only add report entries).

    Aggregation, with ``m = loss_mask != 0`` and ``n_i`` the tokens of row i:

    * ``"token-mean"``: ``loss_sum = sum_t m_t loss_t``, ``num_tokens = sum_t m_t``; Megatron's
      division gives the mean over tokens (over the global batch with
      ``calculate_per_token_loss``).
    * ``"sequence-mean"`` (GRPO's ``1/G sum_i 1/|o_i| sum_t``): ``loss_sum = sum_i (sum_t
      m_it loss_it) / n_i`` over rows with ``n_i > 0``, and ``num_tokens`` counts those
      **rows**, not tokens, so the same division gives the mean over sequences of their token
      means. Rows are dim 0 of a 2-D ``[b, s]`` input; a row with no token contributes 0 to both.

    Args:
        logprobs: ``[b, s]`` (any shape for token-mean) floating log pi(token) in nats, usually
            fp32 from :func:`vocab_parallel_stats`; differentiable.
        old_logprobs: log pi_old of the same tokens (the rollout policy), same shape.
        advantages: per-token advantages, same shape (broadcast a per-sequence advantage first).
        loss_mask: same shape, any dtype; a token counts where non-zero. Required.
        entropy: per-token entropy (nats), same shape; needed when ``entropy_coef != 0`` and then
            differentiable (``vocab_parallel_stats(entropy="grad")``); reported when given.
        ref_logprobs: log pi_ref, same shape; needed when ``kl_coef > 0``; reported when given.
        clip_eps: in (0, 1); the ratio floor is ``1 - clip_eps``.
        clip_eps_high: > 0, the ratio ceiling is ``1 + clip_eps_high`` (DAPO's "clip-higher");
            None means ``clip_eps``.
        dual_clip: None (off) or c > 1: the loss of a token with A < 0 is at most ``-c A``.
        kl_coef: >= 0, weight of the KL penalty to the reference policy.
        kl_estimator: ``"k1"`` or ``"k3"``.
        entropy_coef: weight of the entropy bonus (positive favours higher entropy).
        aggregation: ``"token-mean"`` or ``"sequence-mean"``.
        rollout_logprobs: the rollout engine's log-probs of the same tokens (nats), same shape,
            treated as a constant; given alone it only adds the mismatch diagnostics to the
            report.
        rollout_correction: a :class:`~megatron_vocabstats.rollout.RolloutCorrection`, or None
            (no weighting); needs ``rollout_logprobs``, and ``[b, s]`` inputs at
            ``level="sequence"``.
        rollout_outside: optional bool tensor, same shape: True where the target lies outside the
            rollout sampler's kept set (top-k / top-p); only reported, not excluded.

    Returns:
        :class:`LossOutput`; ``loss_sum`` fp32 (float64 for float64 ``logprobs``), ``num_tokens``
        int32 (tokens, or rows for sequence-mean). Report, as ``[sum, count]``: ``"policy
        loss"`` = ``[loss_sum, num_tokens]``; token means (count = masked tokens) of ``"clip
        fraction"`` (tokens whose clipped term was taken), ``"approx kl"`` (k3 of
        KL(pi_old || pi)), ``"logprob"``, and when they apply ``"dual clip fraction"``,
        ``"ref kl"`` (the chosen estimator), ``"entropy"``. With ``rollout_logprobs``, the
        entries of :func:`~megatron_vocabstats.rollout.mismatch_diagnostics` computed from
        ``old_logprobs``: ``"rollout |dlogprob|"``, ``"rollout k3 kl"`` (KL(rollout ||
        trainer)), ``"rollout ratio p50"``/``"p90"``/``"p99"``/``"max"`` (per-microbatch
        quantiles as ``[value, 1]``: Megatron's reduction averages them over microbatches),
        and with ``rollout_correction`` ``"rollout weight"`` and ``"rollout truncated
        fraction"`` (``"tis"``) or ``"rollout masked fraction"``; with ``rollout_outside``,
        ``"rollout outside support"`` ``[count, num_tokens]``. The keys depend only on the
        options and on which optional inputs are given. Masked positions contribute exactly 0
        to values and gradients, whatever they hold.

    Raises:
        ValueError: naming the argument: ``loss_mask`` None; shapes, dtypes or devices that
            differ; ``sequence-mean`` on a tensor that is not 2-D; options out of range; an
            unknown ``aggregation`` or ``kl_estimator``; ``kl_coef > 0`` without
            ``ref_logprobs``; ``entropy_coef != 0`` without ``entropy``, or with an ``entropy``
            that has no gradient while ``logprobs`` has one; ``rollout_correction`` that is not a
            ``RolloutCorrection`` or comes without ``rollout_logprobs``; a misshapen
            ``rollout_logprobs``/``rollout_outside`` or a non-bool ``rollout_outside``;
            ``level="sequence"`` on inputs that are not 2-D.
    """
    cfg = PolicyLossConfig(clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
                           kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
                           aggregation=aggregation)
    _check_float("old_logprobs", old_logprobs)
    _check_float("advantages", advantages)
    mask = _per_token_inputs(logprobs, loss_mask, old_logprobs=old_logprobs,
                             advantages=advantages, entropy=entropy, ref_logprobs=ref_logprobs,
                             rollout_logprobs=rollout_logprobs)
    _check_rollout_inputs(logprobs, rollout_logprobs, rollout_correction, rollout_outside)
    if cfg.aggregation == "sequence-mean" and logprobs.dim() != 2:
        raise ValueError(f"aggregation='sequence-mean' needs [b, s] logprobs (rows are "
                         f"sequences), got shape {tuple(logprobs.shape)}")
    if cfg.kl_coef > 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the reference policy)")
    if cfg.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy (per-token, differentiable)")
        if logprobs.requires_grad and not entropy.requires_grad:
            raise ValueError("entropy_coef != 0 but entropy has no gradient: compute it with "
                             "vocab_parallel_stats(entropy='grad'), not 'metric'")

    dtype = _compute_dtype(logprobs)
    as_data = functools.partial(_masked, mask=mask, dtype=dtype)
    old = as_data(old_logprobs.detach())
    weights = flags = None
    if rollout_correction is not None:
        weights, flags = correction_weights(old, as_data(rollout_logprobs.detach()), mask,
                                            rollout_correction)
    per_token, metrics = _policy_terms(
        as_data(logprobs), old, as_data(advantages.detach()), mask,
        as_data(entropy) if entropy is not None else None,
        as_data(ref_logprobs.detach()) if ref_logprobs is not None else None,
        cfg, weights,
    )
    loss_sum, num_units = _aggregate(per_token, mask, cfg.aggregation)
    num_tokens = _count(mask)
    report = {"policy loss": _pair(loss_sum, num_units)}
    for name, values in metrics.items():
        report[name] = _pair(_masked(values, mask, dtype).sum(), num_tokens)
    if rollout_logprobs is not None:
        report.update(mismatch_diagnostics(
            old, rollout_logprobs, mask, weights, flags, outside=rollout_outside,
            flag_name=("truncated" if rollout_correction is None
                       else rollout_correction.flag_name)))
    elif rollout_outside is not None:
        report["rollout outside support"] = _pair((rollout_outside & mask).sum(), num_tokens)
    return LossOutput(loss_sum, num_units, report)


def _check_rollout_inputs(logprobs, rollout_logprobs, rollout_correction, rollout_outside):
    """The rollout arguments of :func:`policy_loss` (``rollout_logprobs``' shape is checked
    with the other per-token inputs)."""
    if rollout_correction is not None:
        if not isinstance(rollout_correction, RolloutCorrection):
            raise ValueError(f"rollout_correction must be a RolloutCorrection or None, got "
                             f"{type(rollout_correction).__name__}")
        if rollout_logprobs is None:
            raise ValueError("rollout_correction needs rollout_logprobs (the rollout engine's "
                             "log-probs of the sampled tokens)")
        if rollout_correction.level == "sequence" and logprobs.dim() != 2:
            raise ValueError(f"rollout_correction.level='sequence' needs [b, s] logprobs (rows "
                             f"are sequences), got shape {tuple(logprobs.shape)}")
    if rollout_outside is not None:
        if not isinstance(rollout_outside, torch.Tensor) or rollout_outside.dtype != torch.bool:
            got = (rollout_outside.dtype if isinstance(rollout_outside, torch.Tensor)
                   else type(rollout_outside).__name__)
            raise ValueError(f"rollout_outside must be a bool tensor, got {got}")
        if rollout_outside.shape != logprobs.shape:
            raise ValueError(f"rollout_outside has shape {tuple(rollout_outside.shape)} but "
                             f"logprobs has {tuple(logprobs.shape)}")
        if rollout_outside.device != logprobs.device:
            raise ValueError(f"rollout_outside is on {rollout_outside.device} but logprobs on "
                             f"{logprobs.device}")


def score_tokens(logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                 entropy: torch.Tensor | None = None, non_loss_data: bool = False):
    """Forward-only scoring: per-token log-probs (and entropy) in a loss-contract shell.

    Args:
        logprobs: ``[...]`` floating log p(token) in nats; ``loss_mask`` shaped alike (non-zero =
            scored, required); ``entropy`` optional, shaped alike.
        non_loss_data: what Megatron passes when ``collect_non_loss_data=True``.

    Returns:
        With ``non_loss_data``: the dict ``{"logprobs": ..., "entropy": ...}`` (entropy only when
        given) of detached tensors shaped like ``logprobs``, 0 at unscored positions. Otherwise
        :class:`LossOutput` ``(0.0, num_tokens, that dict)``: with ``forward_only=True`` the
        schedule returns one such dict per microbatch, so
        ``torch.cat([d["logprobs"] for d in result])`` reassembles the batch. These report values
        are per-token tensors, not ``[sum, count]`` pairs: use this for scoring loops, not with
        Megatron's ``train_step`` or ``evaluate``. Run it under ``torch.no_grad()``.

    Raises:
        ValueError: as :func:`nll_loss`.
    """
    mask = _per_token_inputs(logprobs, loss_mask, entropy=entropy)
    dtype = _compute_dtype(logprobs)
    scores = {"logprobs": _masked(logprobs.detach(), mask, dtype)}
    if entropy is not None:
        scores["entropy"] = _masked(entropy.detach(), mask, dtype)
    if non_loss_data:
        return scores
    return LossOutput(logprobs.new_zeros((), dtype=dtype), _count(mask), scores)


# ---------------------------------------------------------------------------------------------
# Where per-token statistics come from


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsOptions:
    """How per-token statistics are computed from a model output (see :func:`token_stats`).

    The fields are :func:`~megatron_vocabstats.vocab_parallel_stats`'s keywords of the same name
    and are validated there. ``validate`` defaults to False here (unlike the op): its checks read
    tensor values on the host once per call, which a training step should not pay; turn it on
    while debugging a data pipeline. ``batch_invariant`` (False, True or ``"tp"``) is passed to a
    statistics callable only when set, so callables that predate it keep working.
    """

    vocab_size: int | None = None
    chunk_size: int | None = None
    temperature: float = 1.0
    entropy: str = "off"
    label_smoothing: float = 0.0
    validate: bool = False
    batch_invariant: bool | str = False


StatsFn = Callable[..., VocabStats]


def selected_tokens(labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool mask of the tokens that count: ``(loss_mask != 0) & (labels != -100)``.

    ``labels``: int ``[...]`` token ids (``-100`` = ignored, Hugging Face style); ``loss_mask``
    shaped alike, required. Raises ``ValueError`` for a missing or misshapen mask or
    non-integer labels.
    """
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be an int64 tensor, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids (int64), got {labels.dtype}")
    return _token_mask(loss_mask, labels, like_name="labels") & (labels != IGNORE_INDEX)


def token_stats(
    output: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    selected: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    options: StatsOptions | None = None,
) -> VocabStats:
    """Per-token statistics of ``labels`` from a model output, whatever its form.

    Args:
        output: one of
            * this rank's logits shard ``[..., V/tp]`` (Megatron's ``GPTModel`` called with
              ``labels=None`` returns ``[b, s, V/tp]``): computed by
              :func:`~megatron_vocabstats.vocab_parallel_stats`;
            * a :class:`~megatron_vocabstats.VocabStats` already computed (a fused LM head):
              returned as is, after a shape check;
            * a callable ``fn(target, *, tp_group, vocab_size, chunk_size, entropy, temperature,
              ignore_index, label_smoothing, validate[, batch_invariant]) -> VocabStats``, i.e.
              ``vocab_parallel_stats``'s keywords (for example a partial of
              :func:`~megatron_vocabstats.ops.fused_linear.linear_vocab_parallel_stats` over its
              hidden states and weight). It receives ``target`` shaped like ``labels`` and must
              return statistics shaped like ``labels``: over Megatron's ``[s, b, H]`` hidden
              states, transpose the target to ``[s, b]`` and the results back to ``[b, s]``.
        labels: int64 ``[...]`` target ids, the leading shape of the logits.
        selected: bool, shaped like ``labels``: the tokens that count (:func:`selected_tokens`);
            the others are passed to the op as ``ignore_index=-100`` (logprob and entropy 0,
            gradient exactly 0, any label value allowed there).
        tp_group: the tensor-parallel group of the vocabulary shards; None = no parallelism.
        options: :class:`StatsOptions`; default ``StatsOptions()``.

    Returns:
        :class:`~megatron_vocabstats.VocabStats` with ``logprobs`` (fp32, shaped like ``labels``)
        and ``entropy`` (None when ``options.entropy == "off"``).

    Raises:
        ValueError: an ``output`` of another type, statistics whose shape is not ``labels``'s,
            a missing ``entropy`` that ``options`` asks for, and everything
            :func:`~megatron_vocabstats.vocab_parallel_stats` raises.
    """
    options = options or StatsOptions()
    if isinstance(output, VocabStats):
        stats = output
    elif isinstance(output, torch.Tensor) or callable(output):
        target = torch.where(selected, labels, IGNORE_INDEX)
        kwargs = dict(tp_group=tp_group, vocab_size=options.vocab_size,
                      chunk_size=options.chunk_size, entropy=options.entropy,
                      temperature=options.temperature, ignore_index=IGNORE_INDEX,
                      label_smoothing=options.label_smoothing, validate=options.validate)
        if options.batch_invariant is not False:
            kwargs["batch_invariant"] = options.batch_invariant
        if isinstance(output, torch.Tensor):
            stats = vocab_parallel_stats(output, target, **kwargs)
        else:
            stats = output(target, **kwargs)
        if not isinstance(stats, VocabStats):
            raise ValueError(f"output: the statistics callable returned "
                             f"{type(stats).__name__}, not VocabStats")
    else:
        raise ValueError(f"output must be logits, VocabStats or a callable returning VocabStats, "
                         f"got {type(output).__name__}")
    if stats.logprobs is None or stats.logprobs.shape != labels.shape:
        got = None if stats.logprobs is None else tuple(stats.logprobs.shape)
        raise ValueError(f"output: statistics need logprobs shaped like labels "
                         f"{tuple(labels.shape)}, got {got}")
    if options.entropy != "off" and stats.entropy is None:
        raise ValueError(f"output: options.entropy={options.entropy!r} but the statistics "
                         "carry no entropy")
    return stats


PerTokenLoss = Callable[..., Any]


def token_loss(
    output: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_fn: PerTokenLoss,
    loss_inputs: Mapping[str, Any] | None = None,
    tp_group: dist.ProcessGroup | None = None,
    options: StatsOptions | None = None,
    non_loss_data: bool = False,
):
    """``loss_fn`` applied to the per-token statistics of a model output.

    Equals ``loss_fn(stats.logprobs, loss_mask=sel, entropy=stats.entropy, **loss_inputs)``
    with ``sel = selected_tokens(labels, loss_mask)`` and
    ``stats = token_stats(output, labels, sel, tp_group=tp_group, options=options)``.
    ``functools.partial(token_loss, labels=..., loss_mask=..., loss_fn=...)`` is a Megatron
    loss function (what :func:`make_forward_step` returns).

    Args:
        output, labels, tp_group, options: as in :func:`token_stats`.
        loss_mask: shaped like ``labels``, non-zero where a token counts. Required.
        loss_fn: a per-token loss: :func:`nll_loss`, :func:`policy_loss` (a ``functools.partial``
            fixing its options), :func:`score_tokens`, or any callable with that signature.
        loss_inputs: further keyword arguments of ``loss_fn`` (``old_logprobs``,
            ``advantages``, ``ref_logprobs``), shaped like ``labels``.
        non_loss_data: passed on to ``loss_fn`` only when True (Megatron's
            ``collect_non_loss_data``).

    Returns:
        what ``loss_fn`` returns (:class:`LossOutput` for the losses here).

    Raises:
        ValueError: ``loss_inputs`` naming ``loss_mask`` or ``entropy``, and what
            :func:`selected_tokens`, :func:`token_stats` and ``loss_fn`` raise. With
            ``options.validate`` under tensor parallelism these raise on every rank, and so do
            tensors of ``loss_inputs`` that differ across the ranks at counted tokens: two more
            all-gathers of a few int64, one before the op's collectives (``labels``,
            ``loss_mask``) and one around ``loss_fn``, so that a rank's bad input never leaves
            the others blocked. Without ``validate`` there is no exchange (no host sync), and
            such an error raises on its own rank only.
    """
    loss_inputs = dict(loss_inputs or {})
    clash = sorted({"loss_mask", "entropy", "non_loss_data"} & loss_inputs.keys())
    if clash:
        raise ValueError(f"loss_inputs must not set {clash}: token_loss passes them")
    options = options or StatsOptions()

    device = labels.device if isinstance(labels, torch.Tensor) else None
    every_rank = dict(validate=options.validate, device=device, hint=_EVERY_RANK_HINT)
    # Before the op's collectives, and again around loss_fn (its own checks and the per-token
    # inputs, which must agree across the ranks): with validate no rank raises alone.
    selected = checked_on_every_rank(lambda: selected_tokens(labels, loss_mask), tp_group,
                                     **every_rank)
    stats = token_stats(output, labels, selected, tp_group=tp_group, options=options)
    if non_loss_data:
        loss_inputs["non_loss_data"] = True
    return checked_on_every_rank(
        lambda: loss_fn(stats.logprobs, loss_mask=selected, entropy=stats.entropy, **loss_inputs),
        tp_group, agree=((Field("loss_inputs", checksum=True),
                          lambda _: _inputs_checksum(loss_inputs, selected)),), **every_rank)


def _inputs_checksum(inputs: Mapping[str, Any], selected: torch.Tensor) -> int:
    """One checksum of the names and the values (at selected tokens) of the tensors of
    ``inputs`` (reads the host)."""
    total = 0
    for name in sorted(inputs):
        if isinstance(inputs[name], torch.Tensor):
            part = zlib.crc32(name.encode()) + tensor_checksum(inputs[name], selected)
            total = (total * 1_000_003 + part) % (2**61 - 1)
    return total


def sft_loss(
    logits: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    temperature: float = 1.0,
    entropy: str = "off",
    validate: bool = False,
    batch_invariant: bool | str = False,
) -> LossOutput:
    """Masked token cross-entropy from vocab-parallel logits, in Megatron's loss contract.

    Reference semantics (one process, full vocabulary ``V``, ``m = (loss_mask != 0) & (labels !=
    -100)``)::

        nll = F.cross_entropy(logits.float().flatten(0, -2) / temperature, labels.flatten(),
                              reduction="none", label_smoothing=label_smoothing)
        loss_sum = (nll * m.flatten()).sum();  num_tokens = m.sum()

    computed by :func:`~megatron_vocabstats.vocab_parallel_stats` without gathering the
    vocabulary (label smoothing over the ``vocab_size`` real columns, ``docs/numerics.md``).
    It is :func:`token_loss` with :func:`nll_loss`.

    Args:
        logits: this rank's shard ``[..., V/tp]`` (bf16/fp16/fp32; Megatron ``[b, s, V/tp]``), or
            precomputed statistics / a statistics callable (see :func:`token_stats`).
        labels: int64 target ids shaped like ``logits.shape[:-1]``; -100 = ignored.
        loss_mask: shaped like ``labels``, non-zero where a token counts. Required.
        tp_group: the vocabulary's tensor-parallel group; None = no tensor parallelism.
        vocab_size, chunk_size, label_smoothing, temperature, entropy, validate,
            batch_invariant: as in :func:`~megatron_vocabstats.vocab_parallel_stats`
            (``validate`` off by default, see :class:`StatsOptions`); with ``entropy`` other than
            ``"off"`` the entropy is reported.

    Returns:
        :class:`LossOutput`; report ``"lm loss"`` (and ``"entropy"``), as in :func:`nll_loss`.

    Raises:
        ValueError: as :func:`token_stats` and :func:`nll_loss`.
    """
    options = StatsOptions(vocab_size=vocab_size, chunk_size=chunk_size, temperature=temperature,
                           entropy=entropy, label_smoothing=label_smoothing, validate=validate,
                           batch_invariant=batch_invariant)
    return token_loss(logits, labels, loss_mask, loss_fn=nll_loss, tp_group=tp_group,
                      options=options)


def logprobs_step(
    logits: torch.Tensor | VocabStats | StatsFn,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    entropy: bool = True,
    validate: bool = False,
    non_loss_data: bool = False,
    batch_invariant: bool | str = False,
):
    """Forward-only per-token log-probs and entropy of ``labels`` for scoring rollouts.

    It is :func:`token_loss` with :func:`score_tokens` (entropy in ``"metric"`` mode: never
    differentiable). Call it under ``torch.no_grad()``; with :func:`make_forward_step`, pass
    ``score_tokens`` and ``StatsOptions(entropy="metric")``.

    Args:
        logits, labels, loss_mask, tp_group, vocab_size, chunk_size, temperature, validate,
            batch_invariant: as in :func:`sft_loss` (``temperature`` should be the sampling
            temperature; ``batch_invariant=True`` makes each row's scores independent of the
            rest of the batch, bit for bit).
        entropy: also return the per-token entropy.
        non_loss_data: return only the dict of per-token tensors (Megatron's
            ``collect_non_loss_data=True`` path).

    Returns:
        as :func:`score_tokens`: ``LossOutput(0.0, num_tokens, {"logprobs": [..], "entropy":
        [..]})``, or the dict alone with ``non_loss_data``; fp32, shaped like ``labels``, 0 where
        not scored.

    Raises:
        ValueError: as :func:`token_stats` and :func:`score_tokens`.
    """
    options = StatsOptions(vocab_size=vocab_size, chunk_size=chunk_size, temperature=temperature,
                           entropy="metric" if entropy else "off", validate=validate,
                           batch_invariant=batch_invariant)
    return token_loss(logits, labels, loss_mask, loss_fn=score_tokens, tp_group=tp_group,
                      options=options, non_loss_data=non_loss_data)


# ---------------------------------------------------------------------------------------------
# forward_step factory


class StepBatch(NamedTuple):
    """One microbatch as :func:`make_forward_step`'s ``batch_fn`` returns it.

    ``model_inputs``: keyword arguments of the model call (Megatron ``GPTModel``: ``input_ids``,
    ``position_ids``, ``attention_mask``, optionally ``packed_seq_params`` ...; never
    ``labels``, so that the model returns logits). ``labels``: int64 ``[b, s]`` targets.
    ``loss_mask``: ``[b, s]``, non-zero where a token counts. ``loss_inputs``: extra keyword
    arguments of the per-token loss (``old_logprobs``, ``advantages``, ``ref_logprobs``).
    """

    model_inputs: Mapping[str, Any]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    loss_inputs: Mapping[str, Any] | None = None


def _module_chain(model) -> Iterator[Any]:
    """``model``, ``model.module``, ``model.module.module``, ... (DDP, Float16Module, FSDP)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        yield model
        model = getattr(model, "module", None)


def model_tp_group(model) -> dist.ProcessGroup | None:
    """The tensor-parallel group of a (possibly wrapped) Megatron model.

    Unwraps the ``.module`` chain (DDP, ``Float16Module``, FSDP) to the innermost model and reads
    its group as its release stores it (:func:`megatron_vocabstats.megatron.compat.tp_group_of`:
    ``tp_group``, ``pg_collection.tp``, ``model_comm_pgs.tp``, else Megatron's initialised
    tensor-parallel group, else None = no tensor parallelism). Never imports Megatron.
    """
    *_, inner = _module_chain(model)
    return tp_group_of(inner)


def _takes_fp32_output(model) -> bool:
    """Whether a wrapper in the chain (Megatron's ``Float16Module``) has an ``fp32_output`` flag."""
    for module in _module_chain(model):
        forward = getattr(module, "forward", None)
        if forward is None:
            continue
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            continue
        if "fp32_output" in params:
            return True
    return False


def make_forward_step(
    batch_fn: Callable[[Any], StepBatch],
    loss_fn: PerTokenLoss,
    *,
    tp_group: dist.ProcessGroup | None | str = FROM_MODEL,
    stats: StatsOptions | None = None,
):
    """A ``forward_step_func`` for Megatron's ``get_forward_backward_func()``.

    The returned ``forward_step(data_iterator, model, checkpoint_activations_microbatch=None, *,
    return_schedule_plan=False)`` takes ``batch = batch_fn(data_iterator)``, calls
    ``model(**batch.model_inputs)`` (with ``fp32_output=False`` when a ``Float16Module`` wrapper
    offers it, so bf16 logits are not copied to fp32; an explicit value in ``model_inputs`` wins),
    or ``model.build_schedule_plan(**batch.model_inputs)`` when the schedule asks for a schedule
    plan, and returns ``(output, functools.partial(token_loss, labels=..., loss_mask=...,
    loss_fn=loss_fn, loss_inputs=..., tp_group=..., options=stats))``. On the last pipeline
    stage the output is the logits ``[b, s, V/tp]`` (``GPTModel`` with ``labels=None``, both in
    megatron-core 0.16 and 0.19) or whatever a fused output processor returns (``VocabStats`` or a
    statistics callable, see :func:`token_stats`). ``checkpoint_activations_microbatch`` is
    accepted and not used (Megatron-Core models do not take it).

    Args:
        batch_fn: ``data_iterator -> StepBatch`` (see :class:`StepBatch`).
        loss_fn: a per-token loss (:func:`nll_loss`, ``functools.partial(policy_loss, ...)``,
            :func:`score_tokens`, ...), see :func:`token_loss`.
        tp_group: the vocabulary's tensor-parallel group; None = none; ``"model"`` (default)
            reads it from the model at each step (:func:`model_tp_group`).
        stats: :class:`StatsOptions` (e.g. ``entropy="grad"`` for an entropy bonus).

    Raises:
        ValueError: at build time, a non-callable ``batch_fn``/``loss_fn`` or a string
            ``tp_group`` other than ``"model"``; at each step, a ``batch_fn`` result that is not
            a :class:`StepBatch` or whose ``model_inputs`` set ``labels``.
    """
    if not callable(batch_fn):
        raise ValueError(f"batch_fn must be callable, got {type(batch_fn).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(tp_group, str) and tp_group != FROM_MODEL:
        raise ValueError(f"tp_group must be a process group, None or {FROM_MODEL!r}, "
                         f"got {tp_group!r}")
    stats = stats or StatsOptions()

    def forward_step(data_iterator, model, checkpoint_activations_microbatch=None, *,
                     return_schedule_plan=False):
        batch = batch_fn(data_iterator)
        if not isinstance(batch, StepBatch):
            raise ValueError(f"batch_fn must return a StepBatch, got {type(batch).__name__}")
        inputs = dict(batch.model_inputs)
        if "labels" in inputs:
            raise ValueError("batch_fn: model_inputs must not contain labels (the model would "
                             "return its own loss instead of logits); return them as "
                             "StepBatch.labels")
        group = model_tp_group(model) if isinstance(tp_group, str) else tp_group
        if return_schedule_plan:
            output = model.build_schedule_plan(**inputs)
        else:
            if "fp32_output" not in inputs and _takes_fp32_output(model):
                inputs["fp32_output"] = False
            output = model(**inputs)
        loss = functools.partial(token_loss, labels=batch.labels, loss_mask=batch.loss_mask,
                                 loss_fn=loss_fn, loss_inputs=batch.loss_inputs,
                                 tp_group=group, options=stats)
        return output, loss

    return forward_step
