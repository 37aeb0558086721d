"""Report entries measuring the trainer / rollout-engine mismatch, with no host sync."""

from __future__ import annotations

import torch

from ..ops.options import check_choice
from .correction import (
    _FLAG_NAMES,
    _LOG_RATIO_LIMIT,
    RATIO_QUANTILES,
    _check_tensor,
    _log_ratio,
    _mask_of,
    invalid_log_ratios,
)

__all__ = ["mismatch_diagnostics"]


def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.stack([total.detach().float(), count.float()])


def _masked_quantiles(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor,
                      quantiles) -> list[torch.Tensor]:
    """``torch.quantile(values[mask], q)`` for each q without a host sync (one sort with the
    uncounted positions at +inf, integer gathers); 0 when nothing counts."""
    flat = torch.where(mask, values, float("inf")).reshape(-1)
    ordered = torch.sort(flat).values
    last = (count - 1).clamp(min=0).to(values.dtype)
    top = max(flat.numel() - 1, 0)
    out = []
    for q in quantiles:
        pos = last * q
        lo = pos.floor()
        hi = pos.ceil()
        v_lo = ordered.gather(0, lo.long().clamp(0, top).reshape(1))[0]
        v_hi = ordered.gather(0, hi.long().clamp(0, top).reshape(1))[0]
        # v_lo + frac (v_hi - v_lo), written so that v_lo == v_hi (frac 0) stays exact.
        value = torch.lerp(v_lo, v_hi, pos - lo) if q < 1.0 else v_hi
        out.append(torch.where(count > 0, value, 0.0))
    return out


def mismatch_diagnostics(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    *,
    flag_name: str = "truncated",
    outside: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-step report entries (detached fp32 ``[sum, count]`` pairs) measuring the mismatch.

    With ``d_t = clamp(trainer_logprobs_t - rollout_logprobs_t, -20, 20)``, ``r_t = exp(d_t)``,
    ``n`` the counted tokens and ``v`` those with a log-ratio (:func:`invalid_log_ratios`), ``n_v``
    their count:

    * ``"rollout |dlogprob|"``: ``[sum_v |d_t|, n_v]``, nats.
    * ``"rollout k3 kl"``: ``[sum_v (r_t - 1 - log r_t), n_v]``, Schulman's k3 estimate of
      KL(pi_rollout || pi_trainer) (nats, >= 0).
    * ``"rollout ratio p50"``, ``"p90"``, ``"p99"``, ``"max"``: quantiles of ``r_t`` over this
      microbatch's ``v`` (as ``torch.quantile``), each ``[value, 1]`` (``[0, 0]`` without such
      tokens), so Megatron's reduction averages the per-microbatch quantiles.
    * ``"rollout invalid logprobs"``: ``[n - n_v, n]``.
    * with ``weights``: ``"rollout weight"`` ``[sum w_t, n]``.
    * with ``flags``: ``"rollout <flag_name> fraction"`` ``[sum flags, n]`` (``"truncated"``,
      ``"masked"``).
    * with ``outside``: ``"rollout outside support"`` ``[sum outside_t m_t, n]``.

    Keys in that order. Every tensor has ``trainer_logprobs``' shape: ``rollout_logprobs`` (the
    engine's), ``mask`` (any dtype, non-zero = counted; values elsewhere never reach the entries),
    ``weights`` and ``flags`` (:func:`correction_weights`'s), ``outside`` (bool: targets outside
    the sampler's kept set). :func:`~megatron_vocabstats.losses.policy_loss` passes its
    ``old_logprobs`` as ``trainer_logprobs``, so the entries measure the engines' disagreement.

    Raises ``ValueError`` naming the argument: non-tensors, non-floating log-probs or weights, a
    non-bool ``flags``/``outside``, shapes or devices that differ, a missing ``mask``, an unknown
    ``flag_name``.
    """
    _check_tensor("trainer_logprobs", trainer_logprobs)
    like = dict(like=trainer_logprobs, like_name="trainer_logprobs")
    _check_tensor("rollout_logprobs", rollout_logprobs, **like)
    mask = _mask_of(mask, trainer_logprobs, "trainer_logprobs")
    check_choice("flag_name", flag_name, _FLAG_NAMES)
    if weights is not None:
        _check_tensor("weights", weights, **like)
    for name, tensor in (("flags", flags), ("outside", outside)):
        if tensor is not None:
            _check_tensor(name, tensor, floating=False, **like)
            if tensor.dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor, got {tensor.dtype}")

    with torch.no_grad():
        invalid = invalid_log_ratios(trainer_logprobs, rollout_logprobs, mask)
        valid = mask & ~invalid
        diff, dtype = _log_ratio(trainer_logprobs, rollout_logprobs, valid)
        count = mask.sum(dtype=torch.int64)
        count_valid = valid.sum(dtype=torch.int64)
        clamped = diff.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        ratio = torch.exp(clamped)
        report = {
            "rollout |dlogprob|": _pair(clamped.abs().sum(), count_valid),
            "rollout k3 kl": _pair((torch.expm1(clamped) - clamped).sum(), count_valid),
        }
        one = torch.ones((), dtype=torch.int64, device=count.device)
        for (suffix, _), value in zip(RATIO_QUANTILES, _masked_quantiles(
                ratio, valid, count_valid, [q for _, q in RATIO_QUANTILES])):
            report[f"rollout ratio {suffix}"] = _pair(value, torch.where(count_valid > 0, one,
                                                                         0))
        report["rollout invalid logprobs"] = _pair(invalid.sum(), count)
        if weights is not None:
            report["rollout weight"] = _pair(
                torch.where(mask, weights.detach().to(dtype), 0.0).sum(), count)
        if flags is not None:
            report[f"rollout {flag_name} fraction"] = _pair((flags & mask).sum(), count)
        if outside is not None:
            report["rollout outside support"] = _pair((outside & mask).sum(), count)
    return report
