"""The ops: pure math (``_math``), collectives (``_comm``), checks (``_checks``), the chunk engine
(``engine/``) and the autograd Functions.

Layout: ``engine/`` holds the machinery every op shares (chunk iterators and buffers, gathered
statistics, the backward loops, the fused LM head's GEMMs and ``main_grad`` contract) behind one
per-chunk seam (``engine.kernel``: statistics and gradient of a chunk). The op modules
(``vocab_parallel``, ``topk``, ``sampling`` and their fused ``fused_*`` variants) hold their
autograd Functions and public API; op-specific math and checks sit beside them
(``topk_math``, ``topk_checks``, ``sampling_search``, ``linear_checks``). No op module imports
a private name of another, and nothing here imports ``megatron_vocabstats.megatron``.
"""

from .fused_linear import linear_vocab_parallel_cross_entropy, linear_vocab_parallel_stats
from .fused_sampling import linear_vocab_parallel_sampling_logprobs
from .fused_topk import linear_vocab_parallel_topk, linear_vocab_parallel_topk_logprobs
from .sampling import SamplingLogprobs, vocab_parallel_sampling_logprobs
from .topk import (
    TopKLogits,
    vocab_parallel_gather_logits,
    vocab_parallel_topk,
    vocab_parallel_topk_logits,
    vocab_parallel_topk_logprobs,
)
from .topk_math import TopK
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
