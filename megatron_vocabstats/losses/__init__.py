"""Loss functions in Megatron's ``(loss_sum, num_tokens, report)`` contract, and a forward_step.

Per-token losses are pure functions of per-token tensors; :func:`token_stats` gets those from a
model output and :func:`token_loss` composes the two. What every loss shares (masks, dtypes,
reduction, host syncs): ``docs/ops.md``, "Losses for forward_step".
"""

from ..ops.options import IGNORE_INDEX
from .forward_step import (
    FROM_MODEL,
    StepBatch,
    make_forward_step,
    model_tp_group,
)
from .inputs import (
    LossOutput,
)
from .policy import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOG_RATIO_LIMIT,
    PolicyLossConfig,
    policy_loss,
)
from .stats import (
    PerTokenLoss,
    StatsFn,
    StatsOptions,
    logprobs_step,
    selected_tokens,
    sft_loss,
    token_loss,
    token_stats,
)
from .token import nll_loss, score_tokens

__all__ = [
    "AGGREGATIONS",
    "FROM_MODEL",
    "IGNORE_INDEX",
    "KL_ESTIMATORS",
    "LOG_RATIO_LIMIT",
    "LossOutput",
    "PerTokenLoss",
    "PolicyLossConfig",
    "StatsFn",
    "StatsOptions",
    "StepBatch",
    "logprobs_step",
    "make_forward_step",
    "model_tp_group",
    "nll_loss",
    "policy_loss",
    "score_tokens",
    "selected_tokens",
    "sft_loss",
    "token_loss",
    "token_stats",
]
