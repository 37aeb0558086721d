"""Top-k of vocab-parallel logits and log-probs at given ids, for top-k distillation.

* :func:`vocab_parallel_topk` (teacher side): the global top-k log-probs and their global ids from
  each rank's local top-k candidates. One all-gather carries, per token, every rank's k candidate
  values and ids together with its logsumexp statistics, so the teacher costs one collective.
* :func:`vocab_parallel_topk_logprobs` (student side): ``log p(i)`` at given global ids, normalised
  over the full vocabulary. The k columns are picked in the logits' storage dtype and only the
  ``[T, k]`` result is upcast; one all-gather of ``[5 + k, T]`` fp32 in forward, none in backward.

Math (``docs/numerics.md``, "Top-k distillation"): per shard the statistics of ``_math.chunk_stats``
(max and sum of exp), merged as ``log Z = m + log S``; ``log p(i) = (z_i - m) - log S``. The
gradient of ``sum_k g_k log p(i_k)`` w.r.t. z is ``sum_k g_k 1[j = i_k] - p_j sum_k g_k``: the
core op's ``chunk_grad`` with ``coef = sum_k g_k`` and no target, plus a scatter-add of ``g_k`` at
the owned ids (duplicate ids add up).

Ties in the top-k are broken by the lowest global id: candidates are ranked by one int64 key per
column, the order-preserving integer image of the fp32 value in the high 32 bits and the complement
of the id in the low 32 bits, so ``torch.topk`` sees no ties at all. A NaN ranks above everything,
so a row holding one comes out all NaN (never a plausible top-k).

Under ``validate`` on tp > 1 the ranks also agree on ``k``, ``indices`` and ``mask`` (checksums)
before any result is used. Without ``validate`` nothing is compared: a differing ``k`` gives
gathers of differing sizes (the collective fails or hangs until the backend's timeout),
differing ids or masks silently wrong sums.
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

    Method: each rank takes the top ``min(k, W)`` of its shard chunk by chunk (fp32 chunk,
    temperature applied, padding columns at -inf and ranked after real columns), then one
    all-gather carries every rank's candidates (values and global ids) and logsumexp statistics
    (``docs/numerics.md``); every rank merges them in rank order to the same global top-k.

    Args:
        logits: this rank's vocabulary shard ``[..., W]`` (bf16, fp16 or fp32, W = padded V / tp),
            rank r holding global ids ``[r*W, (r+1)*W)`` (or from ``vocab_start``). Never
            modified; no gradient flows.
        k: how many ids per token, ``1 <= k <= vocab_size``. Must be equal on all ranks.
        tp_group: the vocabulary's tensor-parallel group; None = no tensor parallelism.
        **options: :class:`~megatron_vocabstats.ops.options.ScaledKwargs`, as
            ``vocab_parallel_stats``: ``vocab_size`` (the real V; ids ``>= V`` are never
            returned; default ``W * tp``), ``vocab_start`` (unequal shards; every rank then sends
            k candidates), ``temperature`` (logits are divided by it before the softmax),
            ``chunk_size`` (results do not depend on it) and ``validate`` (the host-reading
            checks: cross-rank agreement of shapes and options, finite logsumexp).

    Returns:
        :class:`TopK` ``(logprobs fp32 [..., k], indices int64 [..., k])``, sorted by descending
        log-prob, equal ids order by lowest id; identical on every rank. A logit of -inf gives a
        log-prob of -inf; a row holding a NaN logit is all NaN (``validate``: an error). Not
        differentiable (the teacher is a constant).

    Communication: one all-gather of ``[5 + 2 min(k, W), T]`` int32 in forward (plus, with
    ``validate`` on tp > 1, one of a few int64: the core checks and the agreement on ``k``).
    Memory: the core op's two fp32 ``[chunk, W]`` buffers plus a few chunk-sized int64 keys, and
    ``O(tp * k * T)`` for the candidates.

    Raises:
        ValueError: ``k`` not an int in ``[1, V]`` (``InputTypeError``, also a ``TypeError``,
            when not an int at all), and everything ``vocab_parallel_stats`` raises
            for the logits and options (NaN or +inf logits included, with ``validate``); under
            ``validate`` and tp > 1 on every rank, also for a ``k`` that differs across them.
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
    """Global top-k of the raw logits and their ids, without gathering the vocabulary.

    Reference semantics (one process, full vocabulary)::

        torch.topk(logits.float()[..., :V], k)   # ties: the lowest id first

    The same pass as :func:`vocab_parallel_topk` (same candidates, tie rule, arguments, errors and
    one all-gather; its keywords but ``temperature``) returning the logits instead of their
    log-probs: e.g. a sampler's top-k
    filter, or raw-logit distillation. Logits at or below -1e30 come out -inf; a row holding a
    NaN logit is all NaN (``validate``: an error). Not differentiable.

    Returns:
        :class:`TopKLogits` ``(logits fp32 [..., k], indices int64 [..., k])``, equal on every
        rank.
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

    computed without gathering the vocabulary and without an fp32 copy of the logits: the k
    columns are picked in the storage dtype and only the ``[T, k]`` result is upcast; the
    normaliser comes from the core op's per-shard statistics (``docs/numerics.md``). For k = 1 it
    is bit for bit ``vocab_parallel_logprobs``.

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); differentiable; never modified.
        indices: integer global ids ``[..., k]`` (leading shape that of ``logits``), e.g. the
            teacher's :func:`vocab_parallel_topk` ids. Duplicates allowed (their gradients add up).
        tp_group: the vocabulary's tensor-parallel group; None = no tensor parallelism.
        mask: optional, shaped like ``logits.shape[:-1]``; rows where it is 0 get log-prob 0 and
            exactly zero gradient whatever their ids or logits hold (padded positions with k
            copies of id 0, all -inf logits). None = every row.
        **options: :class:`~megatron_vocabstats.ops.options.ScaledKwargs`, as
            ``vocab_parallel_stats``; the gradient is divided by the temperature too.

    Returns:
        fp32 ``[..., k]`` log-probs (nats), identical on every rank; -inf where the logit is -inf;
        NaN at an unmasked id outside ``[0, V)`` when ``validate`` is off (with it: an error);
        such an id passes no gradient.

    Gradient: ``d/dz_j sum_k g_k log p(i_k) = sum_k g_k 1[j = i_k] - p_j sum_k g_k`` (divided by
    the temperature), recomputed chunk by chunk in fp32 and cast once to the logits dtype.

    Communication: one all-gather of ``[5 + k, T]`` fp32 in forward (plus, with ``validate`` on
    tp > 1, one of a few int64: the core checks and the agreement on ``k``, ``mask`` and the
    ids), none in backward. Memory: two fp32 ``[chunk, W]`` buffers, ``O(tp k T)`` fp32;
    backward allocates the logits gradient once, in the logits dtype.

    Raises:
        ValueError: ``indices`` not an integer tensor ``[..., k]`` with the logits' leading shape,
            a misshapen ``mask``, devices that differ, (with ``validate``) unmasked ids outside
            ``[0, V)``, and everything ``vocab_parallel_stats`` raises; under ``validate`` and
            tp > 1 on every rank, also for a ``k``, ``mask`` or ids at unmasked rows that differ
            across the ranks (compared by checksum; the message names the ranks that differ).
            ``indices`` not a tensor: ``InputTypeError`` (a ``TypeError`` and ``ValueError``).
        RuntimeError: on double backward (``create_graph=True``), which is not supported.
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
    """The logits at global ids from vocab-parallel shards: ``logits_full.gather(-1, indices)``.

    Reference semantics (one process, full vocabulary)::

        logits_full.float().gather(-1, indices)        # [..., k]

    Each rank picks the ids it owns (in the storage dtype, then upcast: exact), and one
    all-gather of ``[k, T]`` fp32 sums them in rank order (every id has one owner, so the sum is
    exact). Differentiable: the gradient goes to the owned columns (duplicate ids add up), with
    no collective in backward.

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); never modified.
        indices: integer global ids ``[..., k]`` with the logits' leading shape.
        tp_group, **options: as :func:`vocab_parallel_stats`
            (:class:`~megatron_vocabstats.ops.options.ShardKwargs`).
        mask: optional, shaped like ``logits.shape[:-1]``: rows where it is 0 give 0 and zero
            gradient whatever their ids hold.

    Returns:
        fp32 ``[..., k]``, equal on every rank, bit for bit the logits' values (-inf and -0.0
        included); NaN at an unmasked id outside ``[0, V)`` when ``validate`` is off (with it:
        an error).

    Raises:
        ValueError: as :func:`vocab_parallel_topk_logprobs` (``indices``, ``mask``, ids out of
            range with ``validate``, and what ``vocab_parallel_stats`` raises for the logits);
            under ``validate`` and tp > 1 on every rank. RuntimeError on double backward.
    """
    cfg, valid = picked_config(logits, indices, mask, tp_group, temperature=1.0, **options)
    return _GatherLogits.apply(logits, indices, valid, cfg, tp_group)
