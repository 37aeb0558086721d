"""megatron-vocabstats: exact, memory-lean LM-head statistics for Megatron-Core.

Public API only; importing it has no side effects (the Megatron patch is
``import megatron_vocabstats.patch``).
"""

from .ops import (
    VocabStats,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)

__version__ = "0.1.0"

__all__ = [
    "VocabStats",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_stats",
]
