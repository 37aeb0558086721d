"""Loss functions with Megatron's ``(loss_sum, num_tokens, report)`` contract, and a forward_step.

Per-token losses are pure functions of per-token tensors (``logprobs`` first, ``loss_mask`` and
``entropy`` as keywords); :func:`token_stats` gets those tensors from a model output (logits, a
``VocabStats`` or a statistics callable), and :func:`token_loss` composes the two.

Megatron's contract (``pipeline_parallel.schedules.forward_step_calc_loss``): the schedule
divides ``loss_sum`` by ``max(num_tokens, 1)`` and by the number of microbatches, or, with
``calculate_per_token_loss``, the sums over microbatches and data-parallel ranks by the summed
``num_tokens``. Report values are ``[sum, count]`` pairs, summed the same way, then divided.
No host sync (the op's ``validate`` checks excepted, off here by default) and no collective
besides the op's.
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
