"""The vocab-parallel ops and their public API: log-probs, entropy, cross-entropy, top-k and
sampler log-probs (and their gradients) from this rank's vocabulary shard of the logits or, fused
with the LM head, from hidden states, without gathering the vocabulary. What lives where:
``docs/layout.md``.
"""

from .sampling.from_hidden import linear_vocab_parallel_sampling_logprobs
from .sampling.from_logits import SamplingLogprobs, vocab_parallel_sampling_logprobs
from .stats.from_hidden import linear_vocab_parallel_cross_entropy, linear_vocab_parallel_stats
from .stats.from_logits import (
    VocabStats,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)
from .topk.from_hidden import linear_vocab_parallel_topk, linear_vocab_parallel_topk_logprobs
from .topk.from_logits import (
    TopKLogits,
    vocab_parallel_gather_logits,
    vocab_parallel_topk,
    vocab_parallel_topk_logits,
    vocab_parallel_topk_logprobs,
)
from .topk.math import TopK
from .workspace import configure_workspace, reset_workspace, with_workspace_reset

__all__ = [
    "SamplingLogprobs",
    "linear_vocab_parallel_sampling_logprobs",
    "vocab_parallel_sampling_logprobs",
    "TopK",
    "TopKLogits",
    "vocab_parallel_gather_logits",
    "vocab_parallel_topk_logits",
    "linear_vocab_parallel_topk",
    "linear_vocab_parallel_topk_logprobs",
    "vocab_parallel_topk",
    "vocab_parallel_topk_logprobs",
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
