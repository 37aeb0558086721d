"""The ops: pure math (``_math``), collectives (``_comm``) and the autograd Functions."""

from .fused_linear import linear_vocab_parallel_cross_entropy, linear_vocab_parallel_stats
from .fused_sampling import linear_vocab_parallel_sampling_logprobs
from .fused_topk import linear_vocab_parallel_topk, linear_vocab_parallel_topk_logprobs
from .sampling import SamplingLogprobs, vocab_parallel_sampling_logprobs
from .topk import (
    TopK,
    TopKLogits,
    vocab_parallel_gather_logits,
    vocab_parallel_topk,
    vocab_parallel_topk_logits,
    vocab_parallel_topk_logprobs,
)
from .vocab_parallel import (
    VocabStats,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)
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
