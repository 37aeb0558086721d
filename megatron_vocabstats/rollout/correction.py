"""Importance weights (TIS, MIS, IcePop) correcting the trainer / rollout-engine mismatch in
:func:`~megatron_vocabstats.losses.policy_loss`. Methods, sources and the verl / TRL equivalents:
``docs/rollout.md``, "Rollout correction"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..ops.agreement import host_checks_enabled
from ..ops.options import check_bool, check_choice, check_number

__all__ = [
    "ROLLOUT_LEVELS",
    "ROLLOUT_MODES",
    "RATIO_QUANTILES",
    "CorrectionWeights",
    "RolloutCorrection",
    "correction_bounds",
    "correction_weights",
    "invalid_log_ratios",
]

ROLLOUT_MODES = ("tis", "mis", "icepop")
ROLLOUT_LEVELS = ("token", "sequence")
# (report suffix, quantile) of the per-token ratio reported by mismatch_diagnostics.
RATIO_QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
# Log-ratios are clamped to +-this before exp (losses.LOG_RATIO_LIMIT, verl's SAFETY_BOUND).
_LOG_RATIO_LIMIT = 20.0
_DEFAULTS = {"tis": (2.0, None, None), "mis": (None, None, 2.0), "icepop": (None, 0.5, 5.0)}
_FLAG_NAMES = ("truncated", "masked")


def _positive(name: str, value) -> float:
    return check_number(name, value, low=0.0, low_open=True)


def correction_bounds(mode: str, level: str, threshold=None, low=None, high=None, *,
                      prefix: str = "") -> tuple[float | None, float | None, float | None]:
    """:class:`RolloutCorrection`'s checks: its ``(threshold, low, high)`` with the mode's defaults
    (None where the mode takes no such field); errors name the fields ``prefix`` + name (the
    Megatron settings pass ``"rollout_correction_"``)."""
    p = prefix
    check_choice(f"{p}mode", mode, ROLLOUT_MODES)
    check_choice(f"{p}level", level, ROLLOUT_LEVELS)
    if mode == "icepop" and level != "token":
        raise ValueError(f"{p}level must be 'token' for {p}mode='icepop' (IcePop masks single "
                         f"tokens); use {p}mode='mis', {p}level='sequence' to drop whole rows")
    if mode == "tis":
        for name, value in (("low", low), ("high", high)):
            if value is not None:
                raise ValueError(f"{p}{name} applies to {p}mode 'mis' and 'icepop'; {p}mode='tis'"
                                 f" takes {p}threshold (leave {p}{name} None)")
        return _positive(f"{p}threshold", _DEFAULTS["tis"][0] if threshold is None
                         else threshold), None, None
    if threshold is not None:
        raise ValueError(f"{p}threshold applies to {p}mode='tis'; {p}mode={mode!r} takes {p}low "
                         f"and {p}high (leave {p}threshold None)")
    _, default_low, default_high = _DEFAULTS[mode]
    high = _positive(f"{p}high", default_high if high is None else high)
    low = _positive(f"{p}low", (default_low if default_low is not None else 1.0 / high)
                    if low is None else low)
    if low >= high:
        raise ValueError(f"{p}low must be < {p}high, got {p}low={low!r}, {p}high={high!r}")
    if low > 1.0:
        raise ValueError(f"{p}low must be <= 1 (the band must keep tokens without mismatch), "
                         f"got {low!r}")
    if high < 1.0:
        raise ValueError(f"{p}high must be >= 1 (the band must keep tokens without mismatch), "
                         f"got {high!r}")
    return None, low, high


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutCorrection:
    """How :func:`~megatron_vocabstats.losses.policy_loss` corrects the rollout mismatch.

    Fields, checked on construction (formulas: :func:`correction_weights`, ``docs/rollout.md``):

    * ``mode``: ``"tis"`` (truncated IS), ``"mis"`` (masked IS) or ``"icepop"`` (``"mis"`` with
      its own band, token level only).
    * ``level``: ``"token"`` or ``"sequence"`` (one weight per row of ``[b, s]`` inputs).
    * ``threshold``: ``"tis"`` only, the truncation C > 0 (default 2.0).
    * ``low``, ``high``: ``"mis"``/``"icepop"`` only, the kept band ``0 < low <= 1 <= high``,
      ``low < high``, ends inclusive; defaults ``"mis"`` ``high = 2``, ``low = 1 / high``,
      ``"icepop"`` ``[0.5, 5]``.
    * ``validate``: a counted token without a log-ratio raises in :func:`correction_weights` (a
      host sync) instead of getting weight 0, flagged.

    Raises ``ValueError`` naming the field: an unknown ``mode`` or ``level``, ``"icepop"`` at
    sequence level, a bound that is not a finite positive number, ``threshold`` given to
    ``"mis"``/``"icepop"`` or ``low``/``high`` given to ``"tis"``, ``low >= high``, or a band that
    does not contain 1.
    """

    mode: str = "tis"
    level: str = "token"
    threshold: float | None = None
    low: float | None = None
    high: float | None = None
    validate: bool = False

    def __post_init__(self):
        object.__setattr__(self, "validate", check_bool("validate", self.validate))
        bounds = correction_bounds(self.mode, self.level, self.threshold, self.low, self.high)
        for name, value in zip(("threshold", "low", "high"), bounds):
            object.__setattr__(self, name, value)

    @property
    def flag_name(self) -> str:
        """``"truncated"`` for ``"tis"``, else ``"masked"``: the flags' meaning and report name."""
        return "truncated" if self.mode == "tis" else "masked"


class CorrectionWeights(NamedTuple):
    """:func:`correction_weights`'s result, ``weights, flags``, shaped like its inputs.

    ``weights``: detached fp32 (float64 for float64 inputs), 0 where not counted. ``flags``: bool,
    the counted tokens truncated (``"tis"``), dropped or without a log-ratio (whole rows at
    sequence level).
    """

    weights: torch.Tensor
    flags: torch.Tensor


def _check_tensor(name: str, tensor, *, like: torch.Tensor | None = None,
                  like_name: str = "old_logprobs", floating: bool = True) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if floating and not tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if like is not None:
        if tensor.shape != like.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {like_name} has "
                             f"{tuple(like.shape)}")
        if tensor.device != like.device:
            raise ValueError(f"{name} is on {tensor.device} but {like_name} on {like.device}")


def _mask_of(mask, like: torch.Tensor, like_name: str) -> torch.Tensor:
    if mask is None:
        raise ValueError("mask is required (a tensor shaped like the tokens, non-zero where a "
                         "token counts)")
    _check_tensor("mask", mask, like=like, like_name=like_name, floating=False)
    return mask if mask.dtype == torch.bool else mask != 0


def invalid_log_ratios(trainer: torch.Tensor, rollout: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Bool: the counted tokens (``mask``, bool) whose log-ratio ``trainer - rollout`` has no value
    (NaN or +inf on either side, or -inf on both; one -inf is a valid ratio, clamped to +-20)."""
    with torch.no_grad():
        bad = torch.isnan(trainer - rollout) | torch.isposinf(trainer) | torch.isposinf(rollout)
        return bad & mask


def _check_valid(invalid, old_logprobs, rollout_logprobs) -> None:
    """``ValueError`` naming both inputs at the first counted token without a log-ratio."""
    if bool(invalid.any()):
        i = int(invalid.reshape(-1).nonzero()[0, 0])
        old, rollout = (float(t.reshape(-1)[i]) for t in (old_logprobs, rollout_logprobs))
        raise ValueError(
            f"old_logprobs / rollout_logprobs: {int(invalid.sum())} counted token(s) have no "
            f"log-ratio (NaN, +inf, or -inf on both sides), the first at flat position {i}: "
            f"old_logprobs={old}, rollout_logprobs={rollout}; RolloutCorrection(validate=False) "
            "gives them weight 0 and counts them instead")


def _log_ratio(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor):
    """``(trainer - rollout, dtype)`` in the compute dtype, exactly 0 where not counted."""
    dtype = torch.promote_types(torch.promote_types(trainer.dtype, rollout.dtype), torch.float32)
    diff = trainer.detach().to(dtype) - rollout.detach().to(dtype)
    return torch.where(mask, diff, 0.0), dtype


def correction_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       mask: torch.Tensor, cfg: RolloutCorrection) -> CorrectionWeights:
    """Detached importance weights correcting the trainer / rollout-engine mismatch.

    With ``d_t = clamp(old_logprobs_t - rollout_logprobs_t, -20, 20)`` at counted tokens
    (``m = mask != 0``) or, at sequence level, ``d_i = clamp(sum_t m_it (old_it - rollout_it),
    -20, 20)`` per row (broadcast to the row's tokens), and ``rho = exp(d)``:

    * ``"tis"``: ``w = min(rho, threshold)``; flag = ``rho > threshold``.
    * ``"mis"``, ``"icepop"``: ``w = rho`` if ``low <= rho <= high`` else 0; flag = outside.
    * a counted token without a log-ratio (:func:`invalid_log_ratios`; at sequence level its whole
      row, and a row whose sum is -inf + inf): ``w = 0``, flagged.

    ``old_logprobs`` (the trainer's, nats; gradient ignored), ``rollout_logprobs`` (the engine's)
    and ``mask`` (any dtype, non-zero = counted; values elsewhere never reach the result) share
    one shape, ``[b, s]`` at sequence level.

    Raises ``ValueError`` naming the argument: a ``cfg`` that is not a :class:`RolloutCorrection`,
    non-tensor or non-floating log-probs, shapes or devices that differ, a missing ``mask``,
    ``level="sequence"`` on inputs that are not 2-D; with ``cfg.validate`` (a host sync) a counted
    token without a log-ratio.
    """
    if not isinstance(cfg, RolloutCorrection):
        raise ValueError(f"cfg must be a RolloutCorrection, got {type(cfg).__name__}")
    _check_tensor("old_logprobs", old_logprobs)
    _check_tensor("rollout_logprobs", rollout_logprobs, like=old_logprobs)
    mask = _mask_of(mask, old_logprobs, "old_logprobs")
    if cfg.level == "sequence" and old_logprobs.dim() != 2:
        raise ValueError(f"level='sequence' needs [b, s] old_logprobs (rows are sequences), "
                         f"got shape {tuple(old_logprobs.shape)}")
    with torch.no_grad():
        invalid = invalid_log_ratios(old_logprobs, rollout_logprobs, mask)
        if host_checks_enabled(cfg.validate, old_logprobs.device):
            _check_valid(invalid, old_logprobs, rollout_logprobs)
        diff, _ = _log_ratio(old_logprobs, rollout_logprobs, mask & ~invalid)
        if cfg.level == "sequence":
            diff = diff.sum(dim=-1, keepdim=True)
            # (a row whose tokens' log-ratios sum to NaN, -inf + inf, has none either)
            invalid = (invalid.any(dim=-1, keepdim=True) | torch.isnan(diff)) & mask
            diff = torch.where(torch.isnan(diff), 0.0, diff)
        ratio = torch.exp(diff.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
        if cfg.mode == "tis":
            flags = ratio > cfg.threshold
            weights = ratio.clamp(max=cfg.threshold)
        else:
            flags = (ratio < cfg.low) | (ratio > cfg.high)
            weights = torch.where(flags, 0.0, ratio)
        weights = torch.where(mask & ~invalid, weights, 0.0)
        flags = (flags | invalid) & mask
    return CorrectionWeights(weights, flags)

