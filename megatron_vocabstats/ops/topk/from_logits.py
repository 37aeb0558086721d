"""Top-k of vocab-parallel logits for top-k distillation: the teacher's global top-k
(:func:`vocab_parallel_topk`, :func:`vocab_parallel_topk_logits`) and the student's log-probs or
logits at given global ids (:func:`vocab_parallel_topk_logprobs`,
:func:`vocab_parallel_gather_logits`). Math: ``docs/numerics.md``, "Top-k distillation"; use:
``docs/distillation.md``.
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import torch
import torch.distributed as dist

from .. import _comm
from .._checks import checked_config, first_order_backward
from ..engine.chunks import logits_chunks, logits_grad
from ..options import ScaledKwargs, ShardKwargs, StatsConfig, takes_options
from ..workspace import untracked
from .checks import (
    agreement,
    k_problem,
    picked_config,
    real_vocab,
)
from .math import (
    TopK,
    TopKConfig,
    TopKGrad,
    backward_terms,
    locate,
    picked_pass,
    topk_pass,
)

__all__ = [
    "TopKLogits",
    "vocab_parallel_gather_logits",
    "vocab_parallel_topk",
    "vocab_parallel_topk_logits",
    "vocab_parallel_topk_logprobs",
]


class TopKLogits(NamedTuple):
    """Global top-k of each token by raw logit: ``logits`` fp32 ``[..., k]`` (the logits' values,
    exact; sorted descending) and ``indices`` int64 ``[..., k]`` (global vocabulary ids)."""

    logits: torch.Tensor
    indices: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Teacher: top-k


@takes_options
def vocab_parallel_topk(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[ScaledKwargs],
) -> TopK:
    """Global top-k log-probs and ids of vocab-parallel logits, without gathering the vocabulary.

    Reference semantics (one process, full vocabulary,
    ``z = logits.float()[..., :V] / temperature``)::

        logp = torch.log_softmax(z, -1)
        order = sorted(range(V), key=lambda j: (-logp[j], j))[:k]   # per token: ties -> lowest id
        TopK(logp[order], order)

    Method: each rank takes its top ``min(k, W)`` (``k`` with ``vocab_start``) chunk by chunk,
    padding columns never winning; one all-gather carries every rank's candidates and logsumexp
    statistics, and every rank merges them in rank order to the same top-k.

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); never modified, no gradient.
        k: ids per token, an int in ``[1, V]``, equal on all ranks.
        tp_group, **options: as ``vocab_parallel_stats``
            (:class:`~megatron_vocabstats.ops.options.ScaledKwargs`).

    Returns:
        :class:`TopK` ``(logprobs fp32 [..., k], indices int64 [..., k])``, sorted by descending
        log-prob, identical on every rank, not differentiable. A logit of -inf gives -inf; a row
        holding a NaN logit is all NaN (``validate``: an error).

    Communication: one all-gather of ``[5 + 2 min(k, W), T]`` int32 (plus, with ``validate`` on
    tp > 1, the check all-gather of a few int64, which also compares ``k``). Memory: the core op's
    two fp32 ``[chunk, W]`` buffers, chunk-sized int64 keys and ``O(tp k T)`` candidates.

    Raises:
        ValueError: ``k`` not in ``[1, V]`` (not an int: ``InputTypeError``, also a
            ``TypeError``), what ``vocab_parallel_stats`` raises, and under ``validate`` on tp > 1
            (on every rank) a ``k`` that differs across the ranks.
    """
    return _topk(logits, k, tp_group, normalize=True, **options)


def _topk(logits, k, tp_group, *, normalize: bool, vocab_size=None, **options) -> TopK:
    width = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() else 0
    vocab = real_vocab(width, tp_group, vocab_size)
    problem = k_problem(k, vocab) if vocab is not None else None
    stats_cfg = checked_config(logits, None, tp_group, local_error=problem, agree=agreement(k),
                               vocab_size=vocab_size, entropy="off", kernel="torch",
                               **options)
    k = int(k)  # (checked: an integral number, numpy's included)
    cfg = TopKConfig(stats=stats_cfg, k=k, normalize=normalize)
    logits2d = untracked(logits).detach().reshape(-1, stats_cfg.layout.width)
    with torch.no_grad():
        chunks = logits_chunks(logits2d, None, None, stats_cfg)
        top = topk_pass(chunks, logits2d.shape[0], logits.device, cfg, tp_group)
    shape = (*logits.shape[:-1], k)
    return TopK(top.logprobs.view(shape), top.indices.view(shape))


@takes_options
def vocab_parallel_topk_logits(
    logits: torch.Tensor,
    k: int,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[ShardKwargs],
) -> TopKLogits:
    """Global top-k of the raw logits and their ids, without gathering the vocabulary: e.g. a
    sampler's top-k filter, or raw-logit distillation.

    Reference semantics (one process, full vocabulary)::

        torch.topk(logits.float()[..., :V], k)   # ties: the lowest id first

    :func:`vocab_parallel_topk`'s pass, arguments (no ``temperature``), communication and errors,
    returning the logits instead of their log-probs: :class:`TopKLogits`, equal on every rank, not
    differentiable. Logits at or below -1e30 come out -inf; a row holding a NaN logit is all NaN
    (``validate``: an error).
    """
    return TopKLogits(*_topk(logits, k, tp_group, normalize=False, temperature=1.0, **options))


# ---------------------------------------------------------------------------------------------
# Student: log-probs at given ids


class _TopKLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, indices, valid, cfg: StatsConfig, tp_group):
        logits2d = untracked(logits).reshape(-1, cfg.layout.width)
        indices2d = indices.reshape(-1, indices.shape[-1])
        chunks = logits_chunks(logits2d, None, None, cfg)
        logprobs, lse, lse_lo = picked_pass(chunks, indices2d, valid, cfg, tp_group)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, indices, valid, lse, lse_lo)
        ctx.set_materialize_grads(False)
        return logprobs.view(indices.shape)

    @staticmethod
    @first_order_backward("vocab_parallel_topk_logprobs")
    def backward(ctx, grad):
        logits, indices, valid, lse, lse_lo = ctx.saved_tensors
        cfg: StatsConfig = ctx.cfg
        logits2d = logits.reshape(-1, cfg.layout.width)
        kernel = TopKGrad(*backward_terms(grad, indices, valid, lse, lse_lo, cfg), valid,
                          cfg.layout)
        grad_logits = logits_grad(logits2d, None, None, cfg, kernel)
        return grad_logits.view(logits.shape), None, None, None, None


@takes_options
def vocab_parallel_topk_logprobs(
    logits: torch.Tensor,
    indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    **options: Unpack[ScaledKwargs],
) -> torch.Tensor:
    """Log-probs at given global ids, normalised over the full vocabulary, from vocab-parallel
    logits.

    Reference semantics (one process, ``z = logits.float()[..., :V] / temperature``)::

        torch.log_softmax(z, -1).gather(-1, indices)       # 0 at rows where mask == 0

    The k columns are picked in the storage dtype and only the ``[T, k]`` result is upcast; the
    normaliser comes from the core op's per-shard statistics (``docs/numerics.md``). For k = 1 it
    is bit for bit ``vocab_parallel_logprobs``.

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); differentiable; never modified.
        indices: integer global ids ``[..., k]`` with the logits' leading shape, e.g. the
            teacher's :func:`vocab_parallel_topk` ids; duplicates allowed (their gradients add up).
        mask: optional, shaped like ``logits.shape[:-1]``; rows where it is 0 get log-prob 0 and
            exactly zero gradient whatever their ids or logits hold. None = every row.
        tp_group, **options: as ``vocab_parallel_stats``
            (:class:`~megatron_vocabstats.ops.options.ScaledKwargs`).

    Returns:
        fp32 ``[..., k]`` log-probs (nats), identical on every rank; -inf where the logit is -inf;
        NaN at an unmasked id outside ``[0, V)`` when ``validate`` is off (with it: an error), which
        passes no gradient. Gradient: ``sum_k g_k 1[j = i_k] - p_j sum_k g_k`` divided by the
        temperature, cast once to the logits dtype.

    Communication: one all-gather of ``[5 + k, T]`` fp32 in forward (plus, with ``validate`` on
    tp > 1, the check all-gather, which also compares ``k``, ``mask`` and the ids), none in
    backward. Memory: two fp32 ``[chunk, W]`` buffers and ``O(tp k T)`` fp32.

    Raises:
        ValueError: ``indices`` not an integer tensor ``[..., k]`` with the logits' leading shape
            (not a tensor: ``InputTypeError``, also a ``TypeError``), a misshapen ``mask``,
            devices that differ, (with ``validate``) unmasked ids outside ``[0, V)``, what
            ``vocab_parallel_stats`` raises; under ``validate`` on tp > 1 (on every rank) a ``k``,
            ``mask`` or unmasked ids that differ across the ranks (the message names the ranks).
        RuntimeError: on double backward (``create_graph=True``).
    """
    cfg, valid = picked_config(logits, indices, mask, tp_group, **options)
    return _TopKLogprobs.apply(logits, indices, valid, cfg, tp_group)


# ---------------------------------------------------------------------------------------------
# Raw logits at given ids


class _GatherLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, indices, valid, cfg: StatsConfig, tp_group):
        logits2d = logits.reshape(-1, cfg.layout.width)
        local, owned, in_range = locate(indices.reshape(-1, indices.shape[-1]), valid, cfg.layout)
        # Each id is owned by one rank and -0.0 elsewhere (x + -0.0 == x for every x, -0.0 and
        # -inf included): the rank-order sum is exact.
        mine = torch.where(owned, logits2d.gather(1, local).float(), -0.0).t().contiguous()
        parts = _comm.gather_stats(mine, tp_group)
        picked = parts[0]
        for part in parts[1:]:  # (torch.sum would start from +0.0 and lose a -0.0)
            picked = picked + part
        picked = picked.t()
        picked = torch.where(in_range | ~valid.unsqueeze(1), picked, float("nan"))
        ctx.cfg = cfg
        ctx.save_for_backward(local, owned)
        ctx.logits_shape = logits.shape
        ctx.logits_dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return torch.where(valid.unsqueeze(1), picked, 0.0).view(indices.shape)

    @staticmethod
    @first_order_backward("vocab_parallel_gather_logits")
    def backward(ctx, grad):
        local, owned = ctx.saved_tensors
        g = torch.where(owned, grad.reshape(local.shape).float(), 0.0)
        grad_logits = torch.zeros((local.shape[0], ctx.cfg.layout.width), dtype=torch.float32,
                                  device=grad.device).scatter_add_(1, local, g)
        return grad_logits.to(ctx.logits_dtype).view(ctx.logits_shape), None, None, None, None


@takes_options
def vocab_parallel_gather_logits(
    logits: torch.Tensor,
    indices: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    mask: torch.Tensor | None = None,
    **options: Unpack[ShardKwargs],
) -> torch.Tensor:
    """The logits at given global ids from vocab-parallel shards, exact.

    Reference semantics (one process, full vocabulary)::

        logits_full.float().gather(-1, indices)        # [..., k]; 0 at rows where mask == 0

    Each rank picks the ids it owns and one all-gather of ``[k, T]`` fp32 sums them in rank order
    (one owner per id: bit for bit, -inf and -0.0 included). The gradient goes to the owned columns
    (duplicate ids add up), with no collective in backward. Arguments (no ``temperature``:
    :class:`~megatron_vocabstats.ops.options.ShardKwargs`), the NaN at out-of-range ids and the
    errors: as :func:`vocab_parallel_topk_logprobs`.
    """
    cfg, valid = picked_config(logits, indices, mask, tp_group, temperature=1.0, **options)
    return _GatherLogits.apply(logits, indices, valid, cfg, tp_group)
