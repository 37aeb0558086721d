"""megatron-vocabstats: exact, memory-lean LM-head statistics for Megatron-Core.

Public API only; importing it has no side effects (the Megatron patch is
``import megatron_vocabstats.patch``).
"""

from . import ops, packing
from .distill import distillation_loss, topk_divergence
from .losses import (
    LossOutput,
    StatsOptions,
    StepBatch,
    logprobs_step,
    make_forward_step,
    nll_loss,
    policy_loss,
    score_tokens,
    sft_loss,
    token_loss,
)
from .ops import *  # noqa: F403 - the ops' public API: ops.__all__
from .packing import *  # noqa: F403 - packing.__all__
from .rollout import (
    CorrectionWeights,
    RolloutCorrection,
    correction_weights,
    mismatch_diagnostics,
)

__version__ = "0.1.0"

__all__ = [
    *ops.__all__,
    *packing.__all__,
    "distillation_loss",
    "topk_divergence",
    "LossOutput",
    "StatsOptions",
    "StepBatch",
    "logprobs_step",
    "make_forward_step",
    "nll_loss",
    "policy_loss",
    "score_tokens",
    "sft_loss",
    "token_loss",
    "CorrectionWeights",
    "RolloutCorrection",
    "correction_weights",
    "mismatch_diagnostics",
]
