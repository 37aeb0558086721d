"""Trainer / rollout-engine mismatch: importance-weight corrections and diagnostics."""

from . import correction, diagnostics
from .correction import (  # noqa: F401 - re-exported (__all__ below)
    RATIO_QUANTILES,
    ROLLOUT_LEVELS,
    ROLLOUT_MODES,
    CorrectionWeights,
    RolloutCorrection,
    correction_bounds,
    correction_weights,
    invalid_log_ratios,
)
from .diagnostics import mismatch_diagnostics  # noqa: F401

__all__ = [*correction.__all__, *diagnostics.__all__]
