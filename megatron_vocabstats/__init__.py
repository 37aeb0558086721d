"""megatron-vocabstats: exact, memory-lean LM-head statistics for Megatron-Core.

Public API only; importing it has no side effects (the Megatron patch is
``import megatron_vocabstats.patch``).
"""

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
from .ops import (
    TopK,
    TopKLogits,
    vocab_parallel_gather_logits,
    vocab_parallel_topk_logits,
    linear_vocab_parallel_topk,
    linear_vocab_parallel_topk_logprobs,
    vocab_parallel_topk,
    vocab_parallel_topk_logprobs,
    VocabStats,
    configure_workspace,
    linear_vocab_parallel_cross_entropy,
    linear_vocab_parallel_stats,
    reset_workspace,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
    with_workspace_reset,
)
from .packing import (
    PackedBatch,
    context_parallel_indices,
    gather_from_context_parallel,
    make_packed_seq_params,
    pack_sequences,
    sequence_alignment,
    shard_for_context_parallel,
    shift_packed_labels,
    unpack_sequences,
)

__version__ = "0.1.0"

__all__ = [
    "distillation_loss",
    "topk_divergence",
    "TopK",
    "TopKLogits",
    "vocab_parallel_gather_logits",
    "vocab_parallel_topk_logits",
    "linear_vocab_parallel_topk",
    "linear_vocab_parallel_topk_logprobs",
    "vocab_parallel_topk",
    "vocab_parallel_topk_logprobs",
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
    "PackedBatch",
    "context_parallel_indices",
    "gather_from_context_parallel",
    "make_packed_seq_params",
    "pack_sequences",
    "sequence_alignment",
    "shard_for_context_parallel",
    "shift_packed_labels",
    "unpack_sequences",
    "VocabStats",
    "linear_vocab_parallel_cross_entropy",
    "linear_vocab_parallel_stats",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_stats",
    "configure_workspace",
    "reset_workspace",
    "with_workspace_reset",
]
