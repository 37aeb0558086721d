"""The PPO / GRPO clipped-surrogate :func:`policy_loss`, with an optional rollout correction."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ops.options import check_choice, check_number
from ..rollout import (
    RolloutCorrection,
    correction_weights,
    invalid_log_ratios,
    mismatch_diagnostics,
)
from .inputs import (
    LossOutput,
    _check_float,
    _compute_dtype,
    _count,
    _masked,
    _pair,
    _per_token_inputs,
)

AGGREGATIONS = ("token-mean", "sequence-mean")
KL_ESTIMATORS = ("k1", "k3")
# Log-ratios are clamped to +-this before exp (e^20 = 5e8 already means another policy), so that
# the backward of a clipped token (0 * ratio) stays 0 instead of 0 * inf = NaN.
LOG_RATIO_LIMIT = 20.0


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
        for name, rule in (("clip_eps", dict(low=0.0, high=1.0, low_open=True, high_open=True)),
                           ("clip_eps_high", dict(low=0.0, low_open=True, none_ok=True)),
                           ("dual_clip", dict(low=1.0, low_open=True, none_ok=True)),
                           ("kl_coef", dict(low=0.0)), ("entropy_coef", {})):
            object.__setattr__(self, name, check_number(name, getattr(self, name), **rule))
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)


def _kl_to_reference(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) from ``log r = log(ref / pi)``: k1 = -log r, k3 = r - 1 - log r."""
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
    """Per-token loss (0 where masked; ``weights`` scale the clipped surrogate only) and metrics."""
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

    Per token, with ``r = exp(clamp(logprobs - old_logprobs, -20, 20))`` and advantage A::

        pg = max(-A r, -A clip(r, 1 - clip_eps, 1 + clip_eps_high))
        pg = min(pg, -dual_clip * A)  where A < 0
        loss_t = w_t * pg + kl_coef * KL_t - entropy_coef * entropy_t

    ``KL_t`` from ``d = ref_logprobs - logprobs``: ``-d`` (``kl_estimator="k1"``) or
    ``exp(d) - d - 1`` (``"k3"``); ``w_t``: the detached weights of ``rollout_correction``, else
    one. Sources, gradients, aggregation and report entries: ``docs/ops.md``, "policy_loss in
    detail"; masks, dtypes and the common checks: "Losses for forward_step". No host sync unless
    ``RolloutCorrection(validate=True)``.

    ``logprobs``: floating log pi in nats, ``[b, s]`` (any shape for token-mean); every other
    tensor has its shape: ``old_logprobs`` (log pi_old), ``advantages``, ``loss_mask``,
    ``entropy`` (nats), ``ref_logprobs`` (log pi_ref), ``rollout_logprobs`` (the engine's; without
    a correction only reported) and ``rollout_outside`` (bool: targets outside the sampler's kept
    set; only reported). ``clip_eps`` in (0, 1); ``clip_eps_high`` > 0, None = ``clip_eps``;
    ``dual_clip`` None (off) or > 1; ``kl_coef`` >= 0. ``aggregation``: ``"token-mean"`` or
    ``"sequence-mean"`` (rows: dim 0 of ``[b, s]``; ``num_tokens`` then counts the rows with a
    counted token).

    Raises ``ValueError`` naming the argument, besides the common checks: options out of range;
    ``"sequence-mean"`` or ``level="sequence"`` on inputs that are not 2-D; ``kl_coef > 0``
    without ``ref_logprobs``; ``entropy_coef != 0`` without ``entropy`` (or its gradient, where
    ``logprobs`` has one); a bad ``rollout_correction`` or ``rollout_outside``; a correction
    without ``rollout_logprobs`` or (``validate``) with a counted token without a log-ratio.
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
    surrogate_old = old
    if rollout_correction is not None:
        rollout = as_data(rollout_logprobs.detach())
        weights, flags = correction_weights(old, rollout, mask, rollout_correction)
        # A token without a log-ratio has weight 0: its ratio to old_logprobs must stay finite
        # too (weight 0 times NaN is NaN), so old is taken as the log-prob itself there.
        surrogate_old = torch.where(invalid_log_ratios(old, rollout, mask),
                                    as_data(logprobs).detach(), old)
    per_token, metrics = _policy_terms(
        as_data(logprobs), surrogate_old, as_data(advantages.detach()), mask,
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
    """The rollout arguments of :func:`policy_loss` but ``rollout_logprobs``' shape."""
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
