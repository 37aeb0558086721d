"""Top-k distillation ops straight from hidden states: the LM head fused with :mod:`.from_logits`
chunk by chunk, so that no ``[T, V/tp]`` tensor exists (backward recomputes each chunk's logits).
"""

from __future__ import annotations

import math
from typing import Unpack

import torch
import torch.distributed as dist

from .. import _comm
from .._checks import first_order_backward
from ..agreement import host_checks_enabled
from ..engine.linear import ChunkBuffers, LinearStatsConfig, full_hidden, linear_chunks
from ..engine.recompute import recompute_backward
from ..hidden_checks import checked_linear_config, lead_shape
from ..options import LinearTopKIdsKwargs, LinearTopKKwargs, takes_options
from ..workspace import untracked
from .checks import agreement, index_problem, k_problem, real_vocab, valid_rows
from .math import TopK, TopKConfig, TopKGrad, backward_terms, picked_pass, topk_pass


def _linear_config(hidden, weight, tp_group, **options) -> LinearStatsConfig:
    return checked_linear_config(hidden, weight, None, None, tp_group, entropy="off",
                                 kernel="torch", **options)


class _LinearTopKLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, indices, valid, cfg: LinearStatsConfig, tp_group):
        hidden, weight = untracked(hidden), untracked(weight)
        sc = cfg.stats
        total = full_hidden(hidden, cfg, tp_group)
        hidden2d = total.reshape(-1, total.shape[-1])
        indices2d = indices.reshape(-1, indices.shape[-1])
        bufs = ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size)
        try:
            chunks = linear_chunks(hidden2d, weight, None, None, sc, bufs)
            logprobs, lse, lse_lo = picked_pass(chunks, indices2d, valid, sc, tp_group)
        finally:
            bufs.release()
        ctx.cfg, ctx.tp_group = cfg, tp_group
        ctx.main_grad = weight.main_grad if cfg.accumulate_into_main_grad else None
        # the local shard only (SP)
        ctx.save_for_backward(hidden, weight, indices, valid, lse, lse_lo)
        ctx.set_materialize_grads(False)
        return logprobs.view(indices.shape)

    @staticmethod
    @first_order_backward("linear_vocab_parallel_topk_logprobs")
    def backward(ctx, grad):
        hidden, weight, indices, valid, lse, lse_lo = ctx.saved_tensors
        cfg: LinearStatsConfig = ctx.cfg
        kernel = TopKGrad(*backward_terms(grad, indices, valid, lse, lse_lo, cfg.stats), valid,
                          cfg.stats.layout)
        grad_hidden, grad_weight = recompute_backward(hidden, weight, None, None, cfg,
                                                      ctx.tp_group, ctx.main_grad, kernel)
        return grad_hidden, grad_weight, None, None, None, None


@takes_options
def linear_vocab_parallel_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    **options: Unpack[LinearTopKKwargs],
) -> torch.Tensor:
    """Log-probs of ``hidden @ W.T`` at given global ids, normalised over the full vocabulary,
    without the logits.

    Reference semantics (one process; ``W`` the full output weight, shards stacked in rank order;
    ``h`` the full sequence, the shards of ``hidden`` concatenated along dim 0 under
    ``sequence_parallel``)::

        vocab_parallel_topk_logprobs(h @ W.T, indices, mask=mask, vocab_size=..., ...)

    bit for bit on the logits assembled from the chunk products ``hidden_chunk @ weight.T`` (model
    dtype), as :func:`~megatron_vocabstats.linear_vocab_parallel_stats`; backward recomputes each
    chunk. Method: chunked linear cross-entropy (Wijmans et al. 2024, arXiv:2411.09009) applied to
    the top-k log-probs.

    Args:
        hidden, weight, sequence_parallel, accumulate_into_main_grad: as
            :func:`~megatron_vocabstats.linear_vocab_parallel_stats`.
        indices, mask, tp_group, **options: as
            :func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`
            (:class:`~megatron_vocabstats.ops.options.LinearTopKKwargs`), with the leading
            shape of ``hidden`` (the gathered ``[s, ...]`` under ``sequence_parallel``).

    Returns:
        fp32 ``[..., k]`` log-probs, identical on every rank (0 at masked rows).

    Communication: forward, one all-gather of ``[5 + k, T]`` fp32 (plus the check all-gather with
    ``validate`` and the all-gather of ``hidden`` under ``sequence_parallel``); backward, as
    ``ColumnParallelLinear``: the all-reduce of ``dX``, or the all-gather of ``hidden`` again and a
    reduce-scatter. Memory: the chunk buffers, ``O(tp k T)`` fp32, the gathered ``hidden``; in
    backward ``dX`` and the fp32 ``[W, H]`` weight-gradient sums (none with an fp32 ``main_grad``);
    nothing ``[T, W]``.

    Raises:
        ValueError: what ``linear_vocab_parallel_stats`` raises for ``hidden``, ``weight`` and the
            options, and what ``vocab_parallel_topk_logprobs`` raises for ``indices`` and ``mask``
            (under ``validate`` on tp > 1, on every rank).
    """
    lead = lead_shape(hidden, options.get("sequence_parallel"),
                      _comm.group_rank_size(tp_group)[1])
    problem = None
    if lead is not None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        problem = index_problem(indices, mask, lead, hidden.device,
                                real_vocab(weight.shape[0], tp_group, options.get("vocab_size")),
                                host_checks_enabled(options.get("validate", True), hidden.device))
    cfg = _linear_config(hidden, weight, tp_group, local_error=problem,
                         agree=agreement(lambda: indices.shape[-1], indices, mask), **options)
    valid = valid_rows(mask, math.prod(lead), hidden.device)
    return _LinearTopKLogprobs.apply(hidden, weight, indices, valid, cfg, tp_group)


@takes_options
def linear_vocab_parallel_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[LinearTopKIdsKwargs],
) -> TopK:
    """The teacher's global top-k of ``hidden @ W.T`` without the logits: equals
    :func:`~megatron_vocabstats.vocab_parallel_topk` on the chunk products (see
    :func:`linear_vocab_parallel_topk_logprobs` for ``hidden``/``weight``/``sequence_parallel``,
    the keywords and the rounding); results ``[*lead, k]`` for the (gathered) leading shape.

    Not differentiable. Communication: one all-gather of ``[5 + 2 min(k, W), T]`` int32 (plus one
    of a few int64 with ``validate``, and the all-gather of ``hidden`` under
    ``sequence_parallel``). Raises ``ValueError`` for ``k`` outside ``[1, V]`` and what
    ``linear_vocab_parallel_stats`` raises; under ``validate`` and tp > 1 on every rank,
    including a ``k`` that differs across the ranks.
    """
    problem = None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        vocab = real_vocab(weight.shape[0], tp_group, options.get("vocab_size"))
        problem = k_problem(k, vocab) if vocab is not None else None
    cfg = _linear_config(hidden, weight, tp_group, local_error=problem, agree=agreement(k),
                         differentiable=False, **options)
    sc, k = cfg.stats, int(k)  # (checked: an integral number, numpy's included)
    with torch.no_grad():
        total = full_hidden(untracked(hidden).detach(), cfg, tp_group)
        hidden2d = total.reshape(-1, total.shape[-1])
        bufs = ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size)
        try:
            chunks = linear_chunks(hidden2d, untracked(weight).detach(), None, None, sc, bufs)
            top = topk_pass(chunks, hidden2d.shape[0], hidden.device,
                            TopKConfig(stats=sc, k=k), tp_group)
        finally:
            bufs.release()
    shape = (*total.shape[:-1], k)
    return TopK(top.logprobs.view(shape), top.indices.view(shape))
