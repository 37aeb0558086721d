"""Vocab-parallel log-probs, entropy and cross-entropy straight from hidden states.

The LM head and :func:`~megatron_vocabstats.vocab_parallel_stats` in one autograd Function: the
tokens are processed in chunks, each chunk's logits ``hidden_chunk @ weight.T`` live only in a
``[chunk, W]`` buffer of the model dtype, and its statistics are taken with the core op's math
(``_math.load_chunk``, ``chunk_stats``, ``merge_stats``, ``chunk_grad``). Backward recomputes each
chunk's logits, turns them into the logits gradient and immediately into ``dX = g @ W`` and
``dW += g.T @ h``. No ``[T, V/tp]`` tensor ever exists, so the peak does not grow with the
sequence length beyond the ``[T, H]`` activations and a few ``[T]`` vectors.

Method: the chunked "cut cross-entropy" idea (Wijmans et al., 2024, arXiv:2411.09009) and
Liger-Kernel's fused linear cross-entropy, on top of the exact vocab-parallel statistics of
``docs/numerics.md``; Megatron's ``ColumnParallelLinear`` contract for sequence parallelism and
gradient-accumulation fusion (``weight.main_grad``).

This module holds the autograd Function and the public API; the chunk loop, the buffers, the
weight-gradient GEMMs, the recompute backward and the forward-gradient mode are the engine's
(:mod:`.engine`); the input checks live in :mod:`.linear_checks`. May import: :mod:`._checks`,
:mod:`._layout`, :mod:`._grad`, :mod:`._math`, :mod:`.agreement`, :mod:`.options`,
:mod:`.workspace`, the modules of :mod:`.engine`, :mod:`.linear_checks` and the public names of
:mod:`.vocab_parallel`.
"""

from __future__ import annotations

import functools
from typing import Unpack

import torch
import torch.distributed as dist

from ._checks import check_finite, first_order_backward
from ._grad import finite_lse, grad_coefficients
from ._layout import merge_first_max
from ._math import STAT_ARGMAX, STAT_MAX, merge_stats
from .agreement import host_checks_enabled
from .engine.backends import backend_of
from .engine.chunks import (
    flatten_target,
    function_outputs,
    gathered_stats,
    merge_tokens_per_pass,
    targets_in_range,
)
from .engine.kernel import StatsGrad
from .engine.linear import (
    ChunkBuffers,
    LinearStatsConfig,
    full_hidden,
    fused_chunks,
    reduce_hidden_grad,
)
from .engine.recompute import forward_with_grads, recompute_backward, scaled_forward_grads
from .linear_checks import checked_linear_config
from .options import LinearStatsKwargs, StatsKwargs, check_keywords
from .vocab_parallel import VocabStats
from .workspace import untracked

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
                                       argmax=cfg.argmax)
                merged = merge(parts, valid, in_range=targets_in_range(target1d, sc),
                               tokens_per_pass=merge_tokens_per_pass(sc, parts.shape[0]))
                if cfg.argmax:
                    argmax = merge_first_max(parts[:, STAT_MAX], parts[:, STAT_ARGMAX])
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
        return logprobs, entropy, lse, None if argmax is None else argmax.view(total_shape[:-1])

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


def linear_vocab_parallel_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    entropy: str = "grad",
    grad_weights: torch.Tensor | None = None,
    accumulate_into_main_grad: bool = False,
    partial_hidden_grad: bool = False,
    kernel: str = "auto",
    return_argmax: bool = False,
    **options: Unpack[StatsKwargs],
) -> VocabStats | tuple[VocabStats, torch.Tensor]:
    """Exact per-token log-probs, entropy and logsumexp of ``hidden @ W.T`` without the logits.

    Reference semantics (one process; ``W`` the full output weight, the shards of ``tp_group``
    stacked in rank order; ``h`` the full sequence, the shards of ``hidden`` concatenated along
    dim 0 under ``sequence_parallel``)::

        logits = h @ W.T                      # in the model dtype, as Megatron's output layer
        vocab_parallel_stats(logits, target, vocab_size=..., entropy=..., temperature=..., ...)

    computed chunk by chunk of tokens: a chunk's logits exist only in a ``[chunk, W]`` buffer
    (``W`` = padded V / tp), the statistics are those of the core op (same code, see
    :func:`~megatron_vocabstats.vocab_parallel_stats` and ``docs/numerics.md``), and backward
    recomputes each chunk's logits, derives the logits gradient and turns it into
    ``dX = g @ W`` and ``dW += g.T @ h`` right away. Method: chunked linear cross-entropy
    (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models",
    arXiv:2411.09009; Liger-Kernel's fused linear cross-entropy) made vocab-parallel with the
    core op's exact statistics.

    Numerics: each chunk's logits are ``hidden_chunk @ weight.T`` in the model dtype (fp32
    accumulation inside the matmul, one rounding), so all outputs are bitwise equal to
    ``vocab_parallel_stats`` on the logits assembled from those chunk products. Versus one full
    ``hidden @ weight.T`` they differ only where the BLAS rounds a logit differently for another
    row count (on CPU bf16/fp16 never observed; fp32 by ~1 ulp for chunks < 64 rows): then
    ``|d logprob| <= 2 max|d logit| / temperature``. The logits gradient is rounded once to the
    model dtype (as Megatron's unfused pair), ``dX`` is one matmul per chunk (fp32 accumulation,
    one rounding) summed over the shards in the model dtype, ``dW`` is accumulated over all
    chunks in fp32 and rounded once (or added into ``main_grad``).

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32 hidden states (Megatron ``[s, b, H]``, THD
            ``[T, 1, H]``), replicated on the ranks of ``tp_group``; with ``sequence_parallel``
            this rank's sequence shard ``[s/tp, ..., H]`` (gathered along dim 0 inside, its
            gradient reduce-scattered). Never modified.
        weight: this rank's shard ``[W, H]`` of the output layer (rows = global vocabulary ids
            ``[rank*W, (rank+1)*W)``), same dtype and device as ``hidden``; tied embeddings
            allowed (the same parameter may be used elsewhere; gradients add up).
        target: int64 global token ids shaped like the (gathered) leading shape of ``hidden``,
            or None for entropy and logsumexp only.
        tp_group: the tensor-parallel group; None means no tensor parallelism.
        sequence_parallel: ``hidden`` is the local sequence shard (Megatron's
            ``sequence_parallel``); ignored for tp = 1.
        entropy: as :func:`~megatron_vocabstats.vocab_parallel_stats`.
        **options: the keywords of :func:`~megatron_vocabstats.vocab_parallel_stats`
            (:class:`~megatron_vocabstats.ops.options.StatsKwargs`: ``vocab_size``,
            ``vocab_start``, ``chunk_size``, ``temperature``, ``ignore_index``,
            ``label_smoothing``, ``validate``, ``batch_invariant``), with the same meaning; with
            ``vocab_start`` the weight shard holds rows ``[vocab_start, vocab_start + W)``. The
            temperature scales each fp32 chunk and the gradients; the weight is never copied.
            Here ``chunk_size`` and ``batch_invariant`` also shape the GEMMs (below).
        chunk_size: tokens per chunk; workspace one ``[chunk, W]`` buffer of the model dtype, two
            fp32 ``[chunk, W]`` (plus an fp32 ``[chunk, H]`` on CPU; none with
            ``kernel="triton"``). None: :func:`auto_linear_chunk_size` (64 MiB per fp32 buffer
            on CPU, 256 MiB on GPU; with the Triton kernels on GPU up to 4,096 rows within
            640 MiB of the one buffer, for the weight gradient's fp32 sums). Results do not
            depend on it (up to the matmul rounding noted above).
        grad_weights: forward-gradient mode, for losses whose per-token weights are known in
            forward (masked SFT cross-entropy): fp32 (any float) weights ``w`` shaped like
            ``target``. Valid only when the upstream gradient of ``logprobs`` is ``c * w`` for a
            single scalar ``c`` — e.g. ``loss = -(w * logprobs).sum() / n`` or Megatron's
            ``sum(per_token_loss * loss_mask)`` with ``w = loss_mask``, under any later scaling.
            The gradients are then computed during forward (3 matmuls per chunk instead of 4,
            no recompute) and backward only multiplies them by ``c``. Needs ``entropy`` "off" or
            "metric". Costs between forward and backward: ``dX`` (the size of ``hidden``) and
            the fp32 ``dW`` sums (``4 * W * H`` bytes), and one all-gather of
            ``[5, chunk]`` statistics per chunk instead of one in all. With ``validate`` the
            backward checks the proportionality (a host sync) and raises ``ValueError`` if it
            does not hold. Backward runs once per forward (a second one, e.g. after
            ``retain_graph=True``, raises ``RuntimeError``). Not differentiated.
        accumulate_into_main_grad: Megatron's gradient-accumulation fusion: add the fp32 weight
            gradient into ``weight.main_grad`` (read at forward time), set
            ``weight.grad_added_to_main_grad = True`` and return a dummy gradient (zeros if
            ``weight.zero_out_wgrad``) if the weight has that attribute, else None. False: an
            ordinary gradient in the weight dtype.
        partial_hidden_grad: return this rank's share ``G_r @ W_r`` of ``dX`` (``G_r`` the
            logits gradient of its vocabulary shard), not summed over ``tp_group``, for a caller
            whose own collective sums it: verl's ``linear_cross_entropy`` convention (its Megatron
            forward gathers the sequence-parallel hidden states first, whose backward
            reduce-scatters). Saves the all-reduce of ``dX``. Not with ``sequence_parallel``
            (``ValueError``); the same on every rank. Default False: the full ``dX``.
        batch_invariant: as :func:`~megatron_vocabstats.vocab_parallel_stats` (``True`` or
            ``"tp"``), and the logits themselves are computed as matmuls of exactly 64 rows
            (``INVARIANT_ROWS``; on the Triton backend the kernel's fixed tiles do the same) from
            a reused, zero-padded copy of the rows, so that every GEMM
            has one shape whatever the token count, ``chunk_size`` or the row's position: a
            row's outputs are then bitwise invariant to them as far as the GEMM computes each
            row independently of the others with a fixed kernel for a fixed shape (checked on
            CPU for fp32 and bf16; cuBLAS does for a fixed shape, outside split-K heuristics
            that only depend on the shape). ``"tp"`` makes the statistics agree across tp for
            the same logits; the logits of tp shards are separate GEMMs of other N, so they
            can round differently from tp = 1. Costs: matmuls of 64 rows (the last one of a
            chunk partly on zero rows), chunk buffers rounded up to whole 64-row blocks even
            for few tokens, one ``[chunk, H]`` copy per chunk. Gradients are not covered
            (``dW`` sums over all tokens).
        kernel: the backend, as for :func:`~megatron_vocabstats.vocab_parallel_stats`
            (``"auto"``, ``"torch"``, ``"triton"``). ``"triton"``
            (``ops.kernels.triton_stats``, CUDA or ``TRITON_INTERPRET=1``): forward computes
            each tile of logits with ``tl.dot`` (fp32 accumulation, rounded once to the model
            dtype as the GEMM is) and folds it into the statistics without storing it, in one
            launch over all tokens: no ``[chunk, W]`` buffer at all; backward recomputes each
            tile the same way and writes the chunk's logits gradient once in the model dtype
            (one ``[chunk, W]`` buffer, no fp32 ones), from which cuBLAS makes ``dX`` and
            ``dW``; the forward-gradient mode stores each chunk's logits tiles in that buffer
            as it takes the statistics and turns them into the gradient (3 GEMMs per chunk).
            Same tolerances; a logit may round one ulp away from the torch path's (another
            accumulation order), so the bits differ. Modelled H200 times:
            ``docs/gpu-model.md``.
        return_argmax: also return the global id of each row's largest logit, as
            ``torch.argmax(logits / temperature, dim=-1)`` over the whole (gathered) vocabulary
            would give it (ties to the lowest id; padding columns beyond ``vocab_size`` never
            win): each shard's first maximum travels in the statistics' one all-gather (one
            more fp32 row, the id's int32 bits: exact for any id) and the lowest id among the
            shards holding the global maximum wins, by exact comparisons, no logits gathered.
            For top-1 accuracy, e.g. Megatron's MTP acceptance rate. -1 where the row's maximum
            is NaN. Torch statistics only (``kernel`` resolving to "torch"); not with
            ``grad_weights``.

    Returns:
        :class:`~megatron_vocabstats.VocabStats` ``(logprobs, entropy, logsumexp)``, fp32,
        shaped like ``target`` (the gathered leading shape under sequence parallelism),
        bitwise identical on every rank of ``tp_group``; with ``return_argmax`` the tuple
        ``(VocabStats, argmax)``, ``argmax`` int64 of that shape (not differentiable).

    Communication: forward, one all-gather of ``[5, T]`` fp32 statistics (one of ``[5, chunk]``
    per chunk with ``grad_weights``), one of a few int64 with ``validate``, and the
    sequence-parallel all-gather of ``hidden``. Backward: the reduction of ``dX`` over the
    shards (one all-reduce, or one reduce-scatter under sequence parallelism, as
    ``ColumnParallelLinear``), plus under sequence parallelism the all-gather of ``hidden`` again
    (only the local shard is saved, as Megatron does). With ``grad_weights`` the ``dX`` reduction
    happens in forward and backward has none (one tiny int64 all-gather with ``validate``);
    with ``partial_hidden_grad`` there is no ``dX`` reduction at all.

    Memory beyond inputs and outputs: the chunk buffers (reused across calls through
    ``ops.workspace``), ``O(tp * T)`` fp32 vectors, the
    gathered ``hidden`` under sequence parallelism, and in backward ``dX`` before its reduction
    and the fp32 ``[W, H]`` weight-gradient sums (none extra when ``main_grad`` is fp32).

    Raises:
        ValueError: naming the argument: ``hidden``/``weight`` not tensors, ``weight`` not 2-D,
            an empty hidden dimension (H = 0), hidden sizes, dtypes or devices that differ, a
            ``target`` whose shape is not the (gathered) leading shape of ``hidden``,
            ``grad_weights`` misshaped or with ``entropy="grad"``, ``accumulate_into_main_grad``
            without a matching ``weight.main_grad``, and everything
            :func:`vocab_parallel_stats` raises; with ``validate`` on tp > 1, on every rank,
            including a sequence-parallel shard whose length differs across ranks, and the
            hidden size H, ``sequence_parallel``, ``grad_weights`` (given or None, and its values),
            ``accumulate_into_main_grad``, the same first weight row on every rank with at
            least ``vocab_size`` rows (the full weight replicated; named as ``tp_group``), the
            gradients asked (``hidden`` / ``weight`` ``requires_grad`` under grad mode:
            backward's dX reduction, and whether backward runs), ``partial_hidden_grad``,
            ``return_argmax`` or, with ``grad_weights``, ``chunk_size`` differing across the
            ranks (the error names the field and prints each rank's value); ``return_argmax``
            not a bool, with ``grad_weights``, or with a kernel that resolves to "triton".
            Without ``validate`` those fail, hang or give wrong gradients; so does a backward
            that runs on some ranks only (every rank's loss must use the outputs).
        RuntimeError: a second backward through one forward with ``grad_weights`` (not
            supported: the gradients stored in forward are used up by the first).
    """
    check_keywords("linear_vocab_parallel_stats", options, StatsKwargs)
    cfg = checked_linear_config(hidden, weight, target, grad_weights, tp_group,
                                sequence_parallel=sequence_parallel,
                                accumulate_into_main_grad=accumulate_into_main_grad,
                                partial_hidden_grad=partial_hidden_grad,
                                entropy=entropy, kernel=kernel, argmax=return_argmax,
                                **options)
    *stats, argmax = _LinearVocabParallelStats.apply(hidden, weight, target, grad_weights, cfg,
                                                     tp_group)
    return (VocabStats(*stats), argmax) if return_argmax else VocabStats(*stats)


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
    check_keywords("linear_vocab_parallel_cross_entropy", options, LinearStatsKwargs)
    stats = linear_vocab_parallel_stats(hidden, weight, target, tp_group=tp_group,
                                        entropy="off", grad_weights=loss_weights, **options)
    return 0.0 - stats.logprobs  # +0.0, not -0.0, at ignored positions
