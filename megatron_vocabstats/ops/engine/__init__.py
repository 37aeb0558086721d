"""The chunk engine under every op: chunk iterators, chunk buffers, gathered statistics, the
recompute-backward loop and the weight-gradient helpers.

The op modules (``ops/vocab_parallel.py``, ``topk.py``, ``sampling.py`` and their fused
``fused_*.py`` variants) hold only their autograd Functions, their public API and the math no
other op uses. Everything they share lives here, behind one narrow seam (:mod:`.kernel`): per
chunk of tokens an op supplies

* the **statistics of this chunk**, a :class:`ChunkStats` ``stats(chunk, out)``, and
* the **gradient of this chunk**, a :class:`ChunkGrad` ``grad(chunk, out)``,

and the engine does the rest: the chunk loop and its workspace buffers
(:func:`logits_chunks` over logits, :func:`linear_chunks` over hidden states with the LM-head
GEMM per chunk), the one all-gather of the statistics (:func:`gathered_stats`), the backward
loops (:func:`logits_grad` for logits, :func:`recompute_backward` for the fused LM head, which
turns each chunk's gradient into ``dX`` and ``dW``), and the fused head's collectives and
``main_grad`` contract. A kernel backend (e.g. Triton) plugs in at the seam: it receives a
:class:`Chunk` (shapes and dtypes documented there) and an output tensor.

Modules: :mod:`.kernel` (the seam: ``Chunk``, ``ChunkStats``, ``ChunkGrad``, the core op's
``ShardStats``/``StatsGrad``), :mod:`.backends` (one backend object per ``cfg.kernel``: torch,
Triton), :mod:`.chunks` (logits chunks, gathered statistics, the unfused
backward loop), :mod:`.linear` (the fused head's config, buffers, chunk GEMMs and chunk policy),
:mod:`.wgrad` (weight/input gradients of a chunk), :mod:`.recompute` (the fused backward and the
forward-gradient mode).

May import: ``torch``, :mod:`.._math`, :mod:`.._grad`, :mod:`.._checks`, :mod:`.._comm`,
:mod:`..options`, :mod:`..workspace` and, lazily (:mod:`.backends`), :mod:`..kernels.triton_stats`;
never an op module of ``ops/`` nor the ``megatron_vocabstats.megatron`` subpackage.
"""

from .backends import BACKENDS, Backend, backend_of, grad_backend
from .chunks import (
    flatten_target,
    function_outputs,
    gathered_stats,
    logits_chunks,
    logits_grad,
    merge_tokens_per_pass,
    targets_in_range,
)
from .kernel import Chunk, ChunkGrad, ChunkStats, ShardStats, StatsGrad
from .linear import (
    CPU_LINEAR_CHUNK_BYTES,
    INVARIANT_ROWS,
    ChunkBuffers,
    LinearStatsConfig,
    auto_linear_chunk_size,
    chunk_logits,
    full_hidden,
    fused_chunks,
    linear_chunks,
    reduce_hidden_grad,
    tile_chunks,
)
from .recompute import (
    SCALE_RTOL,
    forward_with_grads,
    recompute_backward,
    scaled_forward_grads,
    upstream_scale,
)
from .wgrad import (
    accumulate_wgrad,
    finish_weight_grad,
    input_grads_of_chunk,
    weight_grad_buffer,
    wgrad_mode,
)

__all__ = [
    "BACKENDS", "Backend", "backend_of", "grad_backend",
    "Chunk", "ChunkGrad", "ChunkStats", "ShardStats", "StatsGrad",
    "flatten_target", "function_outputs", "gathered_stats", "logits_chunks", "logits_grad",
    "merge_tokens_per_pass", "targets_in_range",
    "CPU_LINEAR_CHUNK_BYTES", "INVARIANT_ROWS", "ChunkBuffers", "LinearStatsConfig",
    "auto_linear_chunk_size", "chunk_logits", "full_hidden", "fused_chunks", "linear_chunks",
    "reduce_hidden_grad", "tile_chunks",
    "SCALE_RTOL", "forward_with_grads", "recompute_backward", "scaled_forward_grads",
    "upstream_scale",
    "accumulate_wgrad", "finish_weight_grad", "input_grads_of_chunk", "weight_grad_buffer",
    "wgrad_mode",
]
