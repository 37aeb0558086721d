"""Vocab-parallel log-probs, entropy and cross-entropy straight from hidden states.

The LM head and :func:`~megatron_vocabstats.vocab_parallel_stats` in one autograd Function: each
chunk's logits ``hidden_chunk @ weight.T`` live only in a ``[chunk, W]`` buffer of the model
dtype, and backward recomputes each chunk and turns its logits gradient into ``dX = g @ W`` and
``dW += g.T @ h`` right away. No ``[T, V/tp]`` tensor ever exists, so the peak does not grow with
the sequence length beyond the ``[T, H]`` activations and a few ``[T]`` vectors.

Method: the chunked "cut cross-entropy" idea (Wijmans et al., 2024, arXiv:2411.09009) and
Liger-Kernel's fused linear cross-entropy, on top of the exact vocab-parallel statistics of
``docs/numerics.md``; Megatron's ``ColumnParallelLinear`` contract for sequence parallelism and
gradient-accumulation fusion (``weight.main_grad``).
"""

from __future__ import annotations

import functools
from typing import Unpack

import torch
import torch.distributed as dist

from .._checks import check_finite, first_order_backward
from .._grad import finite_lse, grad_coefficients
from .._math import merge_stats
from ..agreement import host_checks_enabled
from ..engine.backends import backend_of
from ..engine.chunks import (
    flatten_target,
    function_outputs,
    gathered_stats,
    merge_tokens_per_pass,
    row_argmax,
    targets_in_range,
)
from ..engine.kernel import StatsGrad
from ..engine.linear import (
    ChunkBuffers,
    LinearStatsConfig,
    full_hidden,
    fused_chunks,
    reduce_hidden_grad,
)
from ..engine.recompute import forward_with_grads, recompute_backward, scaled_forward_grads
from ..hidden_checks import checked_linear_config
from ..options import LinearStatsKwargs, LinearStatsOpKwargs, takes_options
from ..workspace import untracked
from .from_logits import VocabStats

__all__ = [
    "linear_vocab_parallel_cross_entropy",
    "linear_vocab_parallel_stats",
]


class _LinearVocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, grad_weights, cfg: LinearStatsConfig, tp_group):
        hidden, weight = untracked(hidden), untracked(weight)
        sc = cfg.stats
        argmax = None
        total = full_hidden(hidden, cfg, tp_group)
        total_shape = total.shape
        hidden2d = total.reshape(-1, total_shape[-1])
        target1d, valid = flatten_target(target, sc.ignore_index)
        has_target = target is not None
        merge = functools.partial(
            merge_stats, vocab_size=sc.layout.vocab_size,
            label_smoothing=sc.label_smoothing if has_target else 0.0,
            entropy=sc.entropy != "off", has_target=has_target,
            batch_invariant=bool(sc.batch_invariant))
        tiles = backend_of(sc).tiles
        # The statistics of a backend that computes the logits itself take no buffer at all.
        bufs = None if tiles and not cfg.forward_grad else ChunkBuffers(
            hidden2d, sc.layout.width, sc.chunk_size, batch_invariant=bool(sc.batch_invariant),
            tiles=tiles)
        try:
            if cfg.forward_grad:
                merged, dx2d, acc = forward_with_grads(hidden2d, weight, target1d, valid,
                                                       grad_weights, bufs, cfg, tp_group, merge)
            else:
                # A kernel's statistics take all tokens in one launch (no chunk buffer to bound).
                chunks = fused_chunks(hidden2d, weight, target1d, valid, sc, bufs, padded=True,
                                      tiles=tiles, tile_rows=hidden2d.shape[0])
                parts = gathered_stats(chunks, hidden2d.shape[0], sc, tp_group,
                                       has_target=has_target, device=hidden.device,
                                       argmax=sc.argmax)
                merged = merge(parts, valid, in_range=targets_in_range(target1d, sc),
                               tokens_per_pass=merge_tokens_per_pass(sc, parts.shape[0]))
                argmax = row_argmax(parts, sc, total_shape[:-1])
        finally:
            if bufs is not None:
                bufs.release()
        del bufs, total, hidden2d
        if host_checks_enabled(sc.validate, hidden.device):
            check_finite(merged.logsumexp, valid)

        logprobs, entropy, lse = function_outputs(ctx, merged, total_shape[:-1], sc.entropy)
        ctx.cfg, ctx.tp_group = cfg, tp_group
        ctx.main_grad = weight.main_grad if cfg.accumulate_into_main_grad else None
        if cfg.forward_grad:
            grad_hidden = None
            if dx2d is not None:
                grad_hidden = reduce_hidden_grad(dx2d, total_shape, cfg, tp_group)
            ctx.save_for_backward(weight, target, grad_weights, grad_hidden, acc)
            ctx.used = False
        else:
            ctx.save_for_backward(hidden, weight, target, lse,
                                  entropy if sc.entropy == "grad" else None, merged.lse_lo)
        return logprobs, entropy, lse, argmax

    @staticmethod
    @first_order_backward("linear_vocab_parallel_stats")
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse, _grad_argmax):
        if ctx.cfg.forward_grad:
            grad_hidden, grad_weight = scaled_forward_grads(ctx, grad_logprobs)
        else:
            grad_hidden, grad_weight = _recomputed_grads(ctx, grad_logprobs, grad_entropy)
        return grad_hidden, grad_weight, None, None, None, None


def _recomputed_grads(ctx, grad_logprobs, grad_entropy):
    hidden, weight, target, lse, ent, lse_lo = ctx.saved_tensors
    cfg: LinearStatsConfig = ctx.cfg
    sc = cfg.stats
    target1d, valid = flatten_target(target, sc.ignore_index)
    coef_lp, coef_h = grad_coefficients(grad_logprobs, grad_entropy, valid, sc.temperature,
                                        in_range=targets_in_range(target1d, sc))
    lse = finite_lse(lse.reshape(-1), valid)
    ent = ent.reshape(-1) if coef_h is not None else None
    grad = StatsGrad(lse, ent, coef_lp, coef_h, valid, sc.layout, sc.label_smoothing,
                     lse_lo=lse_lo)
    return recompute_backward(hidden, weight, target1d, valid, cfg, ctx.tp_group, ctx.main_grad,
                              grad)


@takes_options
def linear_vocab_parallel_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    grad_weights: torch.Tensor | None = None,
    **options: Unpack[LinearStatsOpKwargs],
) -> VocabStats:
    """Exact per-token log-probs, entropy, logsumexp (and argmax) of ``hidden @ W.T``, no logits.

    Reference semantics (one process; ``W`` the full output weight, the shards of ``tp_group``
    stacked in rank order; ``h`` the full sequence, the shards of ``hidden`` concatenated along
    dim 0 under ``sequence_parallel``)::

        logits = h @ W.T                      # in the model dtype, as Megatron's output layer
        vocab_parallel_stats(logits, target, vocab_size=..., entropy=..., temperature=..., ...)

    chunk by chunk of tokens: a chunk's logits live only in a ``[chunk, W]`` buffer, backward
    recomputes them and turns their gradient into ``dX = g @ W`` and ``dW += g.T @ h`` at once.
    Outputs are bitwise ``vocab_parallel_stats``'s on the chunk products (``docs/options.md``).
    Method: chunked linear cross-entropy (Wijmans et al. 2024, arXiv:2411.09009) with the core
    op's exact vocab-parallel statistics.

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32 hidden states (Megatron ``[s, b, H]``, THD
            ``[T, 1, H]``), replicated on the ranks of ``tp_group``, or this rank's sequence
            shard with ``sequence_parallel``. Never modified.
        weight: this rank's shard ``[W, H]`` of the output layer (rows = global ids
            ``[rank*W, (rank+1)*W)``), dtype and device of ``hidden``; tied embeddings allowed
            (gradients add up).
        target: int64 global token ids shaped like the (gathered) leading shape of ``hidden``,
            or None for entropy and logsumexp only.
        tp_group, **options: as for :func:`vocab_parallel_stats`
            (:class:`~.options.LinearStatsOpKwargs`); ``chunk_size`` and ``batch_invariant``
            also shape the GEMMs here; ``argmax`` not with ``grad_weights``.
        sequence_parallel: ``hidden`` is the local sequence shard (gathered inside, its
            gradient reduce-scattered); ignored for tp = 1.
        grad_weights: per-token weights ``w`` whose upstream gradient is ``c * w``: the
            gradients are computed in forward (forward-gradient mode; entropy not "grad").
        accumulate_into_main_grad: add the fp32 weight gradient into ``weight.main_grad``.
        partial_hidden_grad: return this rank's share of ``dX``, not summed over ``tp_group``.
        Each option is stated once, with its checks and costs, in ``docs/options.md``.

    Returns:
        :class:`~megatron_vocabstats.VocabStats` ``(logprobs, entropy, logsumexp, argmax)``,
        shaped like ``target``, bitwise identical on every rank of ``tp_group``.

    Communication: forward, the core op's all-gather (per chunk with ``grad_weights``) and the
    sequence-parallel gather of ``hidden``; backward, one all-reduce of ``dX`` (under sequence
    parallelism the gather of ``hidden`` again and a reduce-scatter; none with
    ``partial_hidden_grad``; in forward with ``grad_weights``). Memory beyond inputs and
    outputs: the reused chunk buffers, ``O(tp * T)`` fp32 vectors, the gathered ``hidden``, and in
    backward ``dX`` and fp32 ``[W, H]`` weight-gradient sums (none with an fp32 ``main_grad``).

    Raises:
        ValueError: naming the argument: what :func:`vocab_parallel_stats` raises, misshaped or
            mismatched ``hidden``/``weight``/``target``/``grad_weights``, an option not allowed
            with another (``docs/options.md``), ``accumulate_into_main_grad`` without a matching
            ``weight.main_grad``, and with ``validate`` on tp > 1 (on every rank) any input,
            option or requested gradient that differs across ranks.
        RuntimeError: a second backward through one forward with ``grad_weights``.
    """
    cfg = checked_linear_config(hidden, weight, target, grad_weights, tp_group, **options)
    return VocabStats(*_LinearVocabParallelStats.apply(hidden, weight, target, grad_weights, cfg,
                                                       tp_group))


@takes_options
def linear_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    loss_weights: torch.Tensor | None = None,
    **options: Unpack[LinearStatsKwargs],
) -> torch.Tensor:
    """Per-token cross-entropy ``-log p(target)`` (fp32, nats, shaped like ``target``) of
    ``hidden @ W.T``, without the logits: the fused replacement of Megatron's output layer +
    ``vocab_parallel_cross_entropy`` (the same per-token loss contract; 0 with zero gradient at
    ``ignore_index``).

    ``loss_weights`` (e.g. Megatron's ``loss_mask``) selects the forward-gradient mode: valid when
    the upstream gradient of the returned loss is ``c * loss_weights`` for one scalar ``c`` (as
    ``sum(loss * loss_mask)`` then any scaling); see ``grad_weights`` of
    :func:`linear_vocab_parallel_stats`, whose other keywords
    (:class:`~megatron_vocabstats.ops.options.LinearStatsKwargs`), errors and communication
    apply.
    """
    stats = linear_vocab_parallel_stats(hidden, weight, target, tp_group=tp_group,
                                        entropy="off", grad_weights=loss_weights, **options)
    return 0.0 - stats.logprobs  # +0.0, not -0.0, at ignored positions
