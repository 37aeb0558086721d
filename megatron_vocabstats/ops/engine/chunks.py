"""The engine of the unfused ops: the chunk iterator over logits and the gathered statistics.

A ``[T, W]`` logits shard is read in chunks of ``chunk_size`` rows, each upcast into reused fp32
workspace buffers; the chunks' statistics are gathered over the shards in one all-gather for
``_math.merge_stats``, and the backward of an op on logits runs its :class:`~.kernel.ChunkGrad`
over the same chunks.
"""

from __future__ import annotations

import torch

from .. import _comm
from .._layout import BLOCK, local_target_index, merge_first_max, padded_width, target_in_range
from .._math import (
    NUM_STATS,
    STAT_ARGMAX,
    STAT_MAX,
    MergedStats,
    load_chunk,
    real_columns,
    rebase_zsum_,
)
from ..options import StatsConfig
from ..workspace import WORKSPACE
from .backends import backend_of, grad_backend
from .kernel import Chunk, ChunkGrad


def function_outputs(ctx, merged: MergedStats, shape, entropy_mode: str):
    """``(logprobs, entropy, logsumexp)`` of an autograd Function's forward, viewed as ``shape``:
    logsumexp (and a "metric" entropy) non-differentiable, gradients not materialised."""
    logprobs, entropy, lse = (None if t is None else t.view(shape)
                              for t in (merged.logprobs, merged.entropy, merged.logsumexp))
    # One call: a second mark_non_differentiable would replace the first.
    ctx.mark_non_differentiable(lse, *([entropy] if entropy_mode == "metric" else []))
    ctx.set_materialize_grads(False)
    return logprobs, entropy, lse


def logits_chunks(logits2d, target1d, valid, cfg: StatsConfig, *, padded: bool = False,
                  upcast: bool = True):
    """Yield a :class:`~.kernel.Chunk` per ``cfg.chunk_size`` rows, ``z`` and ``scratch`` two
    fp32 ``[chunk, W]`` workspace buffers (``z`` from ``_math.load_chunk``) reused by every chunk
    and given back when the generator finishes or is closed; ``logits`` is ``logits2d[rows]``.
    ``padded``: buffers of ``_layout.padded_width`` columns (block statistics). ``upcast=False``
    (a backend that reads the logits itself): one chunk of all rows, no buffer taken."""
    num_tokens = logits2d.shape[0]
    if not upcast:
        rows = slice(0, num_tokens)
        index = owned = None
        if target1d is not None:
            index, owned = local_target_index(target1d, valid, cfg.layout)
        yield Chunk(rows, None, None, index, owned, logits2d)
        return
    width = padded_width(cfg.layout.width, bool(cfg.batch_invariant) and padded)
    shape = (min(cfg.chunk_size, max(num_tokens, 1)), width)
    leases = [WORKSPACE.take(shape, torch.float32, logits2d.device) for _ in range(2)]
    zbuf, scratch = (lease.tensor for lease in leases)
    try:
        for start in range(0, num_tokens, cfg.chunk_size):
            rows = slice(start, min(start + cfg.chunk_size, num_tokens))
            index = owned = None
            if target1d is not None:
                index, owned = local_target_index(target1d[rows], valid[rows], cfg.layout)
            z = load_chunk(logits2d[rows], zbuf, cfg.layout, cfg.temperature)
            yield Chunk(rows, z, scratch, index, owned, logits2d[rows])
    finally:
        WORKSPACE.give(*leases)


def gathered_stats(chunks, num_tokens: int, cfg: StatsConfig, tp_group, *, has_target: bool,
                   device, argmax: bool = False) -> torch.Tensor:
    """Statistics of every chunk of ``chunks`` (z from :func:`logits_chunks` ``padded=True`` or
    alike) gathered over ``tp_group`` in one all-gather (none for tp = 1), for
    ``_math.merge_stats(batch_invariant=bool(cfg.batch_invariant))``.

    Returns ``[tp, NUM_STATS, T]``, or for ``batch_invariant="tp"`` ``[tp * nb, NUM_STATS, T]``
    per-block statistics in global column order (a view, no copy; merge it in passes of
    :func:`merge_tokens_per_pass`). ``argmax``: one more row, ``_math.STAT_ARGMAX``. With label
    smoothing the ``a_r`` rows come rebased on the merged maximum (``_math.rebase_zsum_``)."""
    zsum = has_target and cfg.label_smoothing > 0.0
    opts = dict(layout=cfg.layout, entropy=cfg.entropy != "off", zsum=zsum,
                temperature=cfg.temperature, argmax=argmax)
    rows = NUM_STATS + argmax
    kernels = backend_of(cfg)
    if cfg.batch_invariant == "tp":
        stats_of = kernels.shard_stats(**opts, blocks=True)
        blocks = padded_width(cfg.layout.width, True) // BLOCK
        # Block-major, so that the gathered [tp, nb, NUM_STATS, T] is [tp * nb, ...] as a view.
        stats = torch.zeros((blocks, rows, num_tokens), dtype=torch.float32, device=device)
        for chunk in chunks:
            stats_of(chunk, stats.permute(1, 2, 0)[:, chunk.rows])
        gathered = _comm.gather_stats(stats, tp_group)
        gathered = gathered.view(gathered.shape[0] * blocks, rows, num_tokens)
        part_width = BLOCK
    else:
        # Shards of unequal widths (vocab_start) send their real column count along, in one
        # more token column of the same all-gather: the smoothing merge needs every shard's.
        # (an int: torch 2.11's symbolic shapes cannot add a bool to a SymInt)
        counted = int(zsum and not cfg.layout.even)
        stats = torch.zeros((rows, num_tokens + counted), dtype=torch.float32, device=device)
        stats_of = kernels.shard_stats(**opts, batch_invariant=bool(cfg.batch_invariant))
        for chunk in chunks:
            stats_of(chunk, stats[:, chunk.rows])
        if counted:
            stats[0, -1] = cfg.layout.real_width
        gathered = _comm.gather_stats(stats, tp_group)
        if counted:
            counts, gathered = gathered[:, 0, -1], gathered[..., :num_tokens]
        part_width = cfg.layout.width
    if zsum and gathered.shape[0] > 1:
        if cfg.layout.even:
            counts = real_columns(gathered.shape[0], part_width, cfg.layout.vocab_size, device)
        step = merge_tokens_per_pass(cfg, gathered.shape[0]) or max(num_tokens, 1)
        for start in range(0, num_tokens, step):
            rebase_zsum_(gathered[..., start:start + step], counts, cfg.layout.vocab_size)
    return gathered


def row_argmax(parts: torch.Tensor, cfg: StatsConfig, shape) -> torch.Tensor | None:
    """Each row's global argmax id (int64, viewed as ``shape``) from the gathered statistics of
    :func:`gathered_stats` (made with ``argmax=cfg.argmax``); None unless ``cfg.argmax``."""
    if not cfg.argmax:
        return None
    return merge_first_max(parts[:, STAT_MAX], parts[:, STAT_ARGMAX]).view(shape)


def merge_tokens_per_pass(cfg: StatsConfig, num_parts: int) -> int | None:
    """``merge_stats``'s ``tokens_per_pass`` for ``num_parts`` parts per token: None except for
    ``batch_invariant="tp"``, whose ``tp * nb`` parts would make the merge's temporaries large;
    there, as many tokens as keep its ~8 fp32 ``[parts, tokens]`` near one ``[chunk, W]``."""
    if cfg.batch_invariant != "tp":
        return None
    return max(1, cfg.chunk_size * padded_width(cfg.layout.width, True) // (8 * num_parts))


def targets_in_range(target1d, cfg: StatsConfig):
    """``_layout.target_in_range`` of the flattened targets, None without targets."""
    return None if target1d is None else target_in_range(target1d, cfg.layout.vocab_size)


def flatten_target(target, ignore_index: int):
    """``(target [T], valid [T] bool)`` of a target of any leading shape; ``(None, None)`` for
    None."""
    if target is None:
        return None, None
    target1d = target.reshape(-1)
    return target1d, target1d != ignore_index


def logits_grad(logits2d, target1d, valid, cfg: StatsConfig, grad: ChunkGrad) -> torch.Tensor:
    """The backward of an op on logits: ``grad`` of every chunk of ``logits2d`` ``[T, W]`` into
    a new ``[T, W]`` tensor of its dtype, returned; no collective. On ``cfg.kernel``'s backend
    for a :class:`~.kernel.StatsGrad`, else on the torch chunks."""
    grad_logits = torch.empty_like(logits2d)
    kernels = grad_backend(cfg, grad)
    grad = kernels.stats_grad(grad, cfg.temperature)
    for chunk in logits_chunks(logits2d, target1d, valid, cfg, upcast=not kernels.tiles):
        grad(chunk, grad_logits[chunk.rows])
    return grad_logits
