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
(one all-gather of the statistics per call); the losses add none.
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
