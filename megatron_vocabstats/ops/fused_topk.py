"""Top-k distillation ops straight from hidden states: the LM head fused with ``ops/topk.py``.

Each chunk's logits ``hidden_chunk @ weight.T`` exist only in the fused LM head's ``[chunk, W]``
buffer (``fused_linear._ChunkBuffers`` / ``_logit_chunks``); the per-chunk math and the merge are
those of :mod:`megatron_vocabstats.ops.topk`, and backward recomputes each chunk's logits and turns
the logits gradient into ``dX`` and ``dW`` right away (``fused_linear._input_grads_of_chunk``), so
no ``[T, V/tp]`` tensor exists and the workspace does not grow with the sequence length.
Method: chunked linear cross-entropy (Wijmans et al. 2024, arXiv:2411.09009) applied to top-k
log-probs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._checks import host_checks_enabled
from .fused_linear import (
    LinearStatsConfig,
    _checked_linear_config,
    _ChunkBuffers,
    _finish_weight_grad,
    _input_grads_of_chunk,
    _logit_chunks,
    _reduce_hidden_grad,
    _weight_grad_buffer,
)
from .topk import (
    TopK,
    TopKConfig,
    backward_terms,
    chunk_topk_grad,
    index_problem,
    k_problem,
    picked_pass,
    raise_everywhere,
    real_vocab,
    topk_pass,
    valid_rows,
)


def _linear_config(hidden, weight, tp_group, *, chunk_size, vocab_size, temperature,
                   validate) -> LinearStatsConfig:
    return _checked_linear_config(
        hidden, weight, None, None, tp_group, sequence_parallel=False,
        accumulate_into_main_grad=False, chunk_size=chunk_size, vocab_size=vocab_size,
        entropy="off", temperature=temperature, ignore_index=-100, label_smoothing=0.0,
        validate=validate)


class _LinearTopKLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, indices, valid, cfg: LinearStatsConfig, tp_group):
        sc = cfg.stats
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        indices2d = indices.reshape(-1, indices.shape[-1])
        bufs = _ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size)
        chunks = ((rows, logits, z, bufs.scratch) for rows, logits, z, _, _ in
                  _logit_chunks(hidden2d, weight, None, None, sc, bufs))
        logprobs, lse = picked_pass(chunks, indices2d, valid, sc, tp_group)
        del bufs
        ctx.cfg, ctx.tp_group = cfg, tp_group
        ctx.save_for_backward(hidden, weight, indices, valid, lse)
        ctx.set_materialize_grads(False)
        return logprobs.view(indices.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None, None, None
        hidden, weight, indices, valid, lse = ctx.saved_tensors
        cfg: LinearStatsConfig = ctx.cfg
        sc = cfg.stats
        hidden2d = hidden.reshape(-1, hidden.shape[-1])
        local, coef, hits, lse = backward_terms(grad, indices, valid, lse, sc)
        dx2d = torch.empty_like(hidden2d) if cfg.grad_hidden else None
        acc = _weight_grad_buffer(weight, None) if cfg.grad_weight else None
        bufs = _ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size)
        for rows, logits, z, _, _ in _logit_chunks(hidden2d, weight, None, None, sc, bufs):
            chunk_topk_grad(z, bufs.scratch, logits, lse=lse[rows], coef=coef[rows],
                            hits=hits[rows], local=local[rows], valid=valid[rows],
                            layout=sc.layout)
            _input_grads_of_chunk(logits, hidden2d[rows], weight,
                                  dx2d[rows] if dx2d is not None else None, acc, bufs)
        del bufs
        grad_hidden = None
        if dx2d is not None:
            grad_hidden = _reduce_hidden_grad(dx2d, hidden.shape, cfg, ctx.tp_group)
        grad_weight = _finish_weight_grad(acc, weight, None, cfg) if acc is not None else None
        return grad_hidden, grad_weight, None, None, None, None


def linear_vocab_parallel_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Log-probs of ``hidden @ W.T`` at given global ids, normalised over the full vocabulary,
    without the logits.

    Reference semantics (one process; ``W`` the full output weight, shards stacked in rank order)::

        vocab_parallel_topk_logprobs(hidden @ W.T, indices, mask=mask, vocab_size=..., ...)

    Each chunk's logits are ``hidden_chunk @ weight.T`` in the model dtype, as in
    :func:`~megatron_vocabstats.linear_vocab_parallel_stats`, so the results equal the unfused op
    on the logits assembled from those chunk products bit for bit (see that function for the
    rounding of a full ``hidden @ weight.T`` versus chunks). Backward recomputes each chunk.

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32 hidden states, replicated on the ranks of ``tp_group``
            (no sequence parallelism); never modified.
        weight: this rank's ``[W, H]`` shard of the output layer, same dtype and device.
        indices: integer global ids ``[..., k]`` with the leading shape of ``hidden``.
        tp_group, mask, vocab_size, temperature, validate: as
            :func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`.
        chunk_size: tokens per chunk (default ``fused_linear.auto_linear_chunk_size``).

    Returns:
        fp32 ``[..., k]`` log-probs, identical on every rank (0 at masked rows).

    Communication: forward, one all-gather of ``[5 + k, T]`` fp32 (plus, with ``validate`` on
    tp > 1, two of a few int64); backward, one all-reduce of ``dX`` (as ``ColumnParallelLinear``).
    Memory beyond inputs and outputs: the fused head's chunk buffers, ``O(tp k T)`` fp32, and in
    backward ``dX`` and the fp32 ``[W, H]`` weight-gradient sums; nothing ``[T, W]``.

    Raises:
        ValueError: everything :func:`~megatron_vocabstats.linear_vocab_parallel_stats` raises
            for ``hidden``/``weight``/options and everything ``vocab_parallel_topk_logprobs``
            raises for ``indices``/``mask``; under ``validate`` and tp > 1 on every rank.
    """
    cfg = _linear_config(hidden, weight, tp_group, chunk_size=chunk_size, vocab_size=vocab_size,
                         temperature=temperature, validate=validate)
    device = hidden.device
    problem = index_problem(indices, mask, hidden.shape[:-1], device, cfg.stats.layout.vocab_size,
                            host_checks_enabled(validate, device))
    raise_everywhere(problem, tp_group, device=device, validate=validate)
    valid = valid_rows(mask, hidden.numel() // hidden.shape[-1], device)
    return _LinearTopKLogprobs.apply(hidden, weight, indices, valid, cfg, tp_group)


def linear_vocab_parallel_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    validate: bool = True,
) -> TopK:
    """The teacher's global top-k of ``hidden @ W.T`` without the logits: equals
    :func:`~megatron_vocabstats.vocab_parallel_topk` on the chunk products (see
    :func:`linear_vocab_parallel_topk_logprobs` for ``hidden``/``weight`` and the rounding).

    Not differentiable. Communication: one all-gather of ``[5 + 2 min(k, W), T]`` int32 (plus a few
    int64 with ``validate``). Raises ``ValueError`` for ``k`` outside ``[1, V]`` and what
    ``linear_vocab_parallel_stats`` raises; under ``validate`` and tp > 1 on every rank.
    """
    cfg = _linear_config(hidden, weight, tp_group, chunk_size=chunk_size, vocab_size=vocab_size,
                         temperature=temperature, validate=validate)
    vocab = real_vocab(cfg.stats.layout.width, tp_group, cfg.stats.layout.vocab_size)
    raise_everywhere(k_problem(k, vocab), tp_group, device=hidden.device, validate=validate)
    sc = cfg.stats
    hidden2d = hidden.detach().reshape(-1, hidden.shape[-1])
    with torch.no_grad():
        bufs = _ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size)
        chunks = ((rows, z, bufs.scratch) for rows, _, z, _, _ in
                  _logit_chunks(hidden2d, weight.detach(), None, None, sc, bufs))
        top = topk_pass(chunks, hidden2d.shape[0], hidden.device, TopKConfig(stats=sc, k=k),
                        tp_group)
    shape = (*hidden.shape[:-1], k)
    return TopK(top.logprobs.view(shape), top.indices.view(shape))
