"""The PPO / GRPO clipped-surrogate :func:`policy_loss` and its options
(:class:`PolicyLossConfig`), with the optional rollout correction of
:mod:`megatron_vocabstats.rollout`.

A pure function of per-token tensors: no process groups, no host sync.
"""

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
# Log-ratios are clamped to +-LOG_RATIO_LIMIT before exp: ratios beyond e^20 (5e8) mean the
# rollout came from another policy; the clamp keeps exp finite so that the backward pass of a
# clipped token (0 * ratio) stays 0 instead of 0 * inf = NaN.
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
        # (clip_eps < 1: the ratio floor is 1 - clip_eps)
        for name, rule in (("clip_eps", dict(low=0.0, high=1.0, low_open=True, high_open=True)),
                           ("clip_eps_high", dict(low=0.0, low_open=True, none_ok=True)),
                           ("dual_clip", dict(low=1.0, low_open=True, none_ok=True)),
                           ("kl_coef", dict(low=0.0)), ("entropy_coef", {})):
            object.__setattr__(self, name, check_number(name, getattr(self, name), **rule))
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)


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
            ``level="sequence"``. A counted token whose old or rollout log-prob is NaN or
            +inf (or both -inf) gets weight 0 and a surrogate of 0 (ratio 1: no NaN reaches the
            loss, its gradient or the report; counted in ``"rollout invalid logprobs"``), or
            raises ``ValueError`` with ``RolloutCorrection(validate=True)``.
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
