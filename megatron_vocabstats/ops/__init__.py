"""The ops: pure math (``_math``), collectives (``_comm``), checks (``_checks``), the chunk engine
(``engine/``) and the autograd Functions.

Layout: ``engine/`` holds the machinery every op shares (chunk iterators and buffers, gathered
statistics, the backward loops, the fused LM head's GEMMs and ``main_grad`` contract) behind one
per-chunk seam (``engine.kernel``: statistics and gradient of a chunk). One folder per op family
(``stats/``, ``topk/``, ``sampling/``) holds its autograd Functions and public API, on logits
(``from_logits``) and on hidden states (``from_hidden``, the fused LM head), with the family's own
math and checks beside them (``topk/math``, ``topk/checks``, ``sampling/search``); the fused
heads share ``hidden_checks``. No op module imports a private name of another, and nothing here
imports ``megatron_vocabstats.megatron``.
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
