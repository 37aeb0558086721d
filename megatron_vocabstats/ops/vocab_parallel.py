"""Exact vocab-parallel log-probs, entropy and cross-entropy without gathering the vocabulary.

One autograd Function covers every chunk: the forward upcasts one ``[chunk, W]`` slice at a time
into two reused fp32 buffers, packs each shard's statistics into a ``[k, T]`` tensor and merges
them after a single all-gather; the backward recomputes each chunk and writes its gradient into one
preallocated tensor of the logits' dtype, with no collective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _comm
from ._checks import (
    StatsConfig,
    check_finite,
    checked_config,
    first_order_backward,
    host_checks_enabled,
)
from ._math import (
    BLOCK,
    NUM_STATS,
    MergedStats,
    block_stats,
    chunk_grad,
    chunk_stats,
    finite_lse,
    grad_coefficients,
    load_chunk,
    local_target_index,
    merge_stats,
    padded_width,
    real_columns,
    rebase_zsum_,
    target_in_range,
)
from .workspace import WORKSPACE

class VocabStats(NamedTuple):
    """Per-token statistics, each fp32 and shaped like ``target``.

    ``logprobs``: log p(target) in nats (with label smoothing: ``sum_j q_j log p_j``, see
    :func:`vocab_parallel_stats`); ``None`` when no target was given.
    ``entropy``: ``-sum_j p_j log p_j`` in nats; ``None`` when ``entropy="off"``.
    ``logsumexp``: ``log sum_j exp(z_j)`` over the real vocabulary; never differentiable.
    """

    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None
    logsumexp: torch.Tensor


def function_outputs(ctx, merged: MergedStats, shape, entropy_mode: str):
    """``(logprobs, entropy, logsumexp)`` of an autograd Function's forward, viewed as ``shape``.

    Marks logsumexp (and the entropy in "metric" mode) non-differentiable and lets backward see
    None for outputs that get no gradient.
    """
    logprobs, entropy, lse = (None if t is None else t.view(shape)
                              for t in (merged.logprobs, merged.entropy, merged.logsumexp))
    # One call: a second mark_non_differentiable would replace the first.
    ctx.mark_non_differentiable(lse, *([entropy] if entropy_mode == "metric" else []))
    ctx.set_materialize_grads(False)
    return logprobs, entropy, lse


def _chunks(logits2d, target1d, valid, cfg: StatsConfig, *, padded: bool = False):
    """Yield ``(rows, z, scratch, index, owned)`` per chunk, reusing two fp32 ``[chunk, W]`` buffers.

    ``z`` is the chunk upcast to fp32 (temperature applied, padding at -inf); ``index``/``owned``
    locate each row's target in this shard (None without targets). The buffers come from the
    workspace cache (:mod:`.workspace`) and go back to it when the generator finishes or is
    closed. ``padded``: buffers of :func:`~._math.padded_width` columns (whole blocks, for
    :func:`~._math.block_stats` in batch-invariant mode).
    """
    num_tokens = logits2d.shape[0]
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
            yield rows, z, scratch, index, owned
    finally:
        WORKSPACE.give(*leases)


def gathered_stats(chunks, num_tokens: int, cfg: StatsConfig, tp_group, *, has_target: bool,
                   device) -> torch.Tensor:
    """Statistics of every chunk of ``chunks`` (``(rows, z, scratch, index, owned)`` with z from
    :func:`_chunks` ``padded=True`` or alike), gathered over ``tp_group``, ready for
    :func:`~._math.merge_stats` (with ``batch_invariant=bool(cfg.batch_invariant)``).

    Returns ``[tp, NUM_STATS, T]`` shard statistics, or for ``batch_invariant="tp"``
    ``[tp * nb, NUM_STATS, T]`` per-block statistics in global column order (nb blocks of
    ``BLOCK`` columns per shard; a view of the gathered tensor, no copy: merge it with
    :func:`merge_tokens_per_pass`). One all-gather (none for tp = 1). With label smoothing the
    parts' smoothing rows are made relative to the merged maximum (``_math.rebase_zsum_``), in
    passes of :func:`merge_tokens_per_pass` tokens.
    """
    zsum = has_target and cfg.label_smoothing > 0.0
    opts = dict(layout=cfg.layout, entropy=cfg.entropy != "off", zsum=zsum)
    if cfg.batch_invariant == "tp":
        blocks = padded_width(cfg.layout.width, True) // BLOCK
        # Block-major, so that the gathered [tp, nb, NUM_STATS, T] is [tp * nb, ...] as a view.
        stats = torch.zeros((blocks, NUM_STATS, num_tokens), dtype=torch.float32, device=device)
        for rows, z, scratch, index, owned in chunks:
            block_stats(z, scratch, index, owned, stats.permute(1, 2, 0)[:, rows], **opts)
        gathered = _comm.gather_stats(stats, tp_group)
        gathered = gathered.view(gathered.shape[0] * blocks, NUM_STATS, num_tokens)
        part_width = BLOCK
    else:
        # Shards of unequal widths (vocab_start) send their real column count along, in one
        # more token column of the same all-gather: the smoothing merge needs every shard's.
        counted = zsum and not cfg.layout.even
        stats = torch.zeros((NUM_STATS, num_tokens + counted), dtype=torch.float32,
                            device=device)
        for rows, z, scratch, index, owned in chunks:
            chunk_stats(z, scratch, index, owned, stats[:, rows],
                        batch_invariant=bool(cfg.batch_invariant), **opts)
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


def merge_tokens_per_pass(cfg: StatsConfig, num_parts: int) -> int | None:
    """``tokens_per_pass`` of :func:`~._math.merge_stats` for ``num_parts`` gathered parts per
    token (:func:`gathered_stats`): None (one pass) except for ``batch_invariant="tp"``, whose
    ``tp * nb`` parts would make the merge's temporaries several times the gathered statistics;
    there, as many tokens as keep its ~8 fp32 ``[parts, tokens]`` temporaries near one fp32
    ``[chunk, W]`` buffer."""
    if cfg.batch_invariant != "tp":
        return None
    return max(1, cfg.chunk_size * padded_width(cfg.layout.width, True) // (8 * num_parts))


def flatten_target(target, ignore_index: int):
    """``(target [T], valid [T] bool)`` of a target of any leading shape; ``(None, None)`` for None."""
    if target is None:
        return None, None
    target1d = target.reshape(-1)
    return target1d, target1d != ignore_index


def _flatten(logits, target, cfg: StatsConfig):
    return (logits.reshape(-1, cfg.layout.width), *flatten_target(target, cfg.ignore_index))


def _in_range(target1d, cfg: StatsConfig):
    return None if target1d is None else target_in_range(target1d, cfg.layout.vocab_size)


class _VocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, cfg: StatsConfig, tp_group):
        logits2d, target1d, valid = _flatten(logits, target, cfg)
        has_target = target is not None
        parts = gathered_stats(_chunks(logits2d, target1d, valid, cfg, padded=True),
                               logits2d.shape[0], cfg, tp_group, has_target=has_target,
                               device=logits.device)
        merged = merge_stats(parts, valid, vocab_size=cfg.layout.vocab_size,
                             label_smoothing=cfg.label_smoothing if has_target else 0.0,
                             entropy=cfg.entropy != "off", has_target=has_target,
                             batch_invariant=bool(cfg.batch_invariant),
                             tokens_per_pass=merge_tokens_per_pass(cfg, parts.shape[0]),
                             in_range=_in_range(target1d, cfg))
        if host_checks_enabled(cfg.validate, logits.device):
            check_finite(merged.logsumexp, valid, logits2d=logits2d, temperature=cfg.temperature)

        logprobs, entropy, lse = function_outputs(ctx, merged, logits.shape[:-1], cfg.entropy)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, target, lse, entropy if cfg.entropy == "grad" else None)
        return logprobs, entropy, lse

    @staticmethod
    @first_order_backward("vocab_parallel_stats")
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        logits, target, lse, ent = ctx.saved_tensors
        cfg: StatsConfig = ctx.cfg
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None
        logits2d, target1d, valid = _flatten(logits, target, cfg)
        # Coefficients carry the temperature and are 0 at ignored rows, whose gradient is then
        # exactly 0 (their lse is made finite so that p stays finite).
        coef_lp, coef_h = grad_coefficients(grad_logprobs, grad_entropy, valid, cfg.temperature,
                                            in_range=_in_range(target1d, cfg))
        lse = finite_lse(lse.reshape(-1), valid)
        ent = ent.reshape(-1) if ent is not None else None

        grad_logits = torch.empty_like(logits2d)
        for rows, z, scratch, index, owned in _chunks(logits2d, target1d, valid, cfg):
            chunk_grad(
                z, scratch, grad_logits[rows],
                lse=lse[rows],
                ent=ent[rows] if coef_h is not None else None,
                coef_lp=coef_lp[rows] if coef_lp is not None else None,
                coef_h=coef_h[rows] if coef_h is not None else None,
                index=index, owned=owned,
                valid=valid[rows] if valid is not None else None,
                layout=cfg.layout,
                label_smoothing=cfg.label_smoothing,
            )
        return grad_logits.view(logits.shape), None, None, None


def vocab_parallel_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    entropy: str = "grad",
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    validate: bool = True,
    batch_invariant: bool | str = False,
) -> VocabStats:
    """Exact per-token log-probs, entropy and logsumexp from vocab-parallel logits.

    Reference semantics (one process, full vocabulary, ``z = logits.float() / temperature`` with
    columns ``>= vocab_size`` removed)::

        logp = torch.log_softmax(z, -1)
        logprobs = (1 - eps) * logp.gather(-1, target[..., None])[..., 0] + eps * logp.mean(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        logsumexp = torch.logsumexp(z, -1)

    computed without gathering the vocabulary, without an fp32 copy of the shard and without a
    one-hot. Method: per-shard sufficient statistics (max, sum of exp, exp-weighted logits, target
    logit) merged across ranks, ``H = logZ - E_p[z]``; formulas in ``docs/numerics.md``.

    Args:
        logits: this rank's vocabulary shard ``[..., W]`` (W = padded V / tp), bf16, fp16 or fp32,
            any leading shape (Megatron ``[s, b, W]``, THD ``[T, 1, W]``, ``[B, S, W]``). Never
            modified. Rank r holds global columns ``[r*W, (r+1)*W)`` (Megatron's split), or
            ``[vocab_start, vocab_start + W)`` with ``vocab_start``.
        target: int64 global token ids shaped like ``logits.shape[:-1]``, or None to compute only
            entropy and logsumexp.
        tp_group: the tensor-parallel group the vocabulary is split over; None means no tensor
            parallelism (``logits`` holds the whole vocabulary).
        vocab_size: the real (unpadded) global vocabulary size V; columns at global id >= V are
            padding and get zero probability (they may fill whole shards, as Megatron's
            padding of a small vocabulary does). Default ``W * tp``.
        vocab_start: the global id of this rank's first column, for shards of unequal widths
            (torchtitan's ``ceil(V / tp)`` split with a shorter last shard: ``rank *
            ceil(V / tp)``). Needs ``vocab_size``; the shards must tile ``[0, V)`` (and may run
            past it into padding) in rank order, checked with ``validate`` (one more pair of
            int64 in the check all-gather). Not with ``batch_invariant="tp"``. Default None:
            equal shards, rank r at ``r * W``.
        chunk_size: tokens upcast to fp32 at a time; the workspace is two fp32 ``[chunk, W]``
            buffers. None picks it from the width and device (``ops._checks.auto_chunk_size``:
            about 4 MiB per buffer on CPU, 256 MiB on GPU). Results do not depend on it.
        entropy: ``"off"`` (not computed, returned as None), ``"metric"`` (computed, not
            differentiable, nothing extra saved) or ``"grad"`` (differentiable:
            ``dH/dz_j = -p_j (log p_j + H)``).
        temperature: a real number >= 1 / fp32 max (about 2.94e-39); logits are divided by it
            (in the fp32 chunk, never copied); gradients too.
        ignore_index: an int; positions whose target equals it get logprob 0 and entropy 0 and
            exactly zero gradient; their logsumexp is still reported.
        label_smoothing: eps in [0, 1). ``logprobs`` becomes ``sum_j q_j log p_j`` with
            ``q = (1 - eps) onehot(target) + eps / V`` over the V real columns (the global real size,
            never the shard width), so ``-logprobs`` is the smoothed cross-entropy.
        validate: run the checks that read tensor values on the host (target range, one tiny
            all-gather comparing shard width, token count, vocab_size, dtype, targets and options
            across ranks, and finite results). Skipped while a CUDA graph is being captured.
            Without it, ranks that disagree are not detected (a wrong result or a failed
            collective). This rank's shape, dtype and argument checks always run. Must be equal
            on all ranks (a bool). Logits at or below -1e30 count as -inf. Without it a target
            id outside ``[0, V)`` (and not ``ignore_index``) gives a NaN logprob and passes no
            logprob gradient (its entropy and logsumexp are still exact); found on the device,
            without a host synchronisation.
        batch_invariant: ``False`` (default, torch's reductions), ``True`` or ``"tp"``. With
            ``True`` a row's logprobs, entropy and logsumexp (and its gradient row) are bitwise
            the same whatever the number of tokens, the row's position, the other rows and
            ``chunk_size``, on a given device, dtype and tp size: every sum over columns runs
            in blocks of 128 columns with a fixed halving tree of elementwise adds
            (``ops._math.tree_sum_``), the shards combined in the same fixed order. Same
            communication; the reductions cost about twice the reads of torch's sums.
            Across tp sizes results still differ by rounding (each shard's sums are rescaled to
            the global maximum). ``"tp"`` also makes tp = 1 and tp = k agree bitwise (with the
            same global column blocks: the shard width must be a multiple of 128 for tp > 1, as
            Megatron's vocabulary padding gives): the per-block statistics of every shard
            are gathered and combined over the whole vocabulary in one fixed tree. Its cost:
            the all-gather carries ``[W/128, 5, T]`` fp32 per rank instead of ``[5, T]`` (about
            ``20 * V/128`` bytes per token gathered, 24 KB at V = 151,936); forward holds this
            rank's share and the gathered whole (``1 + 1/tp`` times that), merged in passes of
            tokens with temporaries near one fp32 chunk buffer. Values stay within the
            tolerances of ``docs/numerics.md``.
            Must be equal on all ranks.

    Returns:
        :class:`VocabStats` ``(logprobs, entropy, logsumexp)``, fp32 tensors shaped like
        ``logits.shape[:-1]``, identical on every rank of ``tp_group``.

    Communication: one all-gather of ``[5, T]`` fp32 in forward (plus one of 5 int64 when
    ``validate``), none in backward. Memory beyond the inputs: two fp32 ``[chunk, W]`` buffers
    (reused across calls through ``ops.workspace``; see there for their lifetime under streams and
    CUDA graphs) and ``O(tp * T)`` fp32 vectors; backward allocates the logits gradient once, in
    the logits dtype. No host synchronisation with ``validate=False`` (graph-capturable).

    Raises:
        TypeError: naming the argument and value, for an argument of the wrong Python type
            (``logits`` or ``target`` not a tensor, ``temperature``/``label_smoothing`` not a
            real number, ``ignore_index``/``chunk_size``/``vocab_size`` not an int, ``validate``
            not a bool, ``tp_group`` not a process group). It is ``ops._checks.InputTypeError``,
            a ``ValueError`` as well.
        ValueError: naming the argument, for a non-integer ``target``, leading shapes that differ,
            a dtype other than bf16/fp16/fp32, an empty vocabulary shard (width 0),
            ``chunk_size <= 0``, an unknown ``entropy`` mode, a ``temperature`` that is not
            finite or below 2.94e-39, ``label_smoothing`` outside [0, 1), a ``vocab_size`` that
            does not fit the shards, and (with ``validate``) full replicated logits passed as a
            shard (as wide as the real vocabulary, first row equal on every rank), target ids
            outside ``[0, V)`` other than ``ignore_index``, shards, targets or options that
            differ across ranks (the message names the field and prints each rank's value), and
            scored rows whose logits are NaN, +inf or all -inf, or whose ``logits / temperature``
            overflows fp32 (reported as a too small ``temperature``). Without ``validate`` such
            rows give NaN. Under tensor parallelism with ``validate`` any error of one rank's
            checks raises on every rank (the others name the rank).
        RuntimeError: on double backward (``create_graph=True``), which is not supported.

    Extreme finite logits (up to the fp32 maximum, with label smoothing too) give exact results;
    the smoothing sum is taken relative to the row maximum and scaled so that it cannot
    overflow.
    """
    cfg = checked_config(
        logits,
        target,
        tp_group,
        vocab_size=vocab_size,
        vocab_start=vocab_start,
        chunk_size=chunk_size,
        entropy=entropy,
        temperature=temperature,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        validate=validate,
        batch_invariant=batch_invariant,
    )
    return VocabStats(*_VocabParallelStats.apply(logits, target, cfg, tp_group))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    validate: bool = True,
    batch_invariant: bool | str = False,
) -> torch.Tensor:
    """Per-token ``log p(target)`` (fp32, nats, shaped like ``target``) from vocab-parallel logits.

    Equals ``vocab_parallel_stats(..., entropy="off").logprobs``: same arguments, shapes, errors
    and communication (see :func:`vocab_parallel_stats`). Ignored positions give 0.
    """
    return vocab_parallel_stats(
        logits, target, tp_group=tp_group, vocab_size=vocab_size, vocab_start=vocab_start,
        chunk_size=chunk_size,
        entropy="off", temperature=temperature, ignore_index=ignore_index, validate=validate,
        batch_invariant=batch_invariant,
    ).logprobs


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    differentiable: bool = True,
    validate: bool = True,
    batch_invariant: bool | str = False,
) -> torch.Tensor:
    """Per-token entropy ``-sum_j p_j log p_j`` (fp32, nats, shaped like ``logits.shape[:-1]``).

    Exact (``H = logZ - E_p[z]``, no sampling), from the shard ``[..., W]`` without gathering it.
    ``differentiable=False`` is the ``"metric"`` mode: no gradient and nothing saved for one.
    Arguments, errors and communication as in :func:`vocab_parallel_stats` (no target).
    """
    return vocab_parallel_stats(
        logits, None, tp_group=tp_group, vocab_size=vocab_size, vocab_start=vocab_start,
        chunk_size=chunk_size,
        entropy="grad" if differentiable else "metric", temperature=temperature,
        validate=validate, batch_invariant=batch_invariant,
    ).entropy


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    *,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    validate: bool = True,
    batch_invariant: bool | str = False,
) -> torch.Tensor:
    """Drop-in for Megatron's ``tensor_parallel.vocab_parallel_cross_entropy``.

    Same positional arguments and result: per-token loss ``-log p(target)``, fp32, shaped like
    ``target`` (Megatron: logits ``[s, b, V/tp]``, target ``[s, b]``), plus ``ignore_index``
    (loss and gradient 0 there). Unlike the other ops, and like Megatron, ``tp_group=None`` means
    Megatron's default tensor-parallel group when ``megatron.core.parallel_state`` is initialised
    (no tensor parallelism otherwise).

    Label smoothing follows ``docs/numerics.md``: ``(1-eps) * nll + eps * (logZ - mean_j z_j)``
    over the V real columns. Megatron's own version spreads ``eps*K/(K-1)`` with K the local
    shard width, so its smoothed loss differs from this one (and across tp sizes).

    Raises: as :func:`vocab_parallel_stats`.
    """
    if tp_group is None:
        from ..megatron.compat import default_tp_group

        tp_group = default_tp_group()
    stats = vocab_parallel_stats(
        vocab_parallel_logits, target, tp_group=tp_group, vocab_size=vocab_size,
        vocab_start=vocab_start,
        chunk_size=chunk_size, entropy="off", ignore_index=ignore_index,
        label_smoothing=label_smoothing, validate=validate, batch_invariant=batch_invariant,
    )
    return 0.0 - stats.logprobs  # +0.0, not -0.0, at ignored positions
