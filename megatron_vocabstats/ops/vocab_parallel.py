"""Exact vocab-parallel log-probs, entropy and cross-entropy without gathering the vocabulary.

One autograd Function covers every chunk: the forward upcasts one ``[chunk, W]`` slice at a time
into two reused fp32 buffers, packs each shard's statistics into a ``[k, T]`` tensor and merges
them after a single all-gather; the backward recomputes each chunk and writes its gradient into one
preallocated tensor of the logits' dtype, with no collective.

This module holds the Function and the public API; the chunk loop, the buffers and the gathered
statistics are the engine's (:mod:`.engine`), the math :mod:`._math`'s. May import:
:mod:`._argtypes`, :mod:`._checks`, :mod:`._grad`, :mod:`._math`, :mod:`.agreement`,
:mod:`.options`, :mod:`.workspace` and :mod:`.engine`; never ``megatron_vocabstats.megatron`` (the
default tp group of :func:`vocab_parallel_cross_entropy` comes from ``megatron_vocabstats.mcore``,
which only reads the third-party ``megatron.core``).
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import torch
import torch.distributed as dist

from ..mcore import default_tp_group, megatron_tp_size
from ._argtypes import check_bool
from ._checks import check_finite, checked_config, first_order_backward
from ._grad import finite_lse, grad_coefficients
from ._math import merge_stats
from .agreement import host_checks_enabled
from .engine.backends import backend_of
from .engine.chunks import (
    flatten_target,
    function_outputs,
    gathered_stats,
    logits_chunks,
    logits_grad,
    merge_tokens_per_pass,
    targets_in_range,
)
from .engine.kernel import StatsGrad
from .options import StatsConfig, VocabStatsKwargs, check_keywords
from .workspace import untracked

__all__ = [
    "VocabStats",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_stats",
]


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


def _flatten(logits, target, cfg: StatsConfig):
    return logits.reshape(-1, cfg.layout.width), *flatten_target(target, cfg.ignore_index)


class _VocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, cfg: StatsConfig, tp_group):
        logits = untracked(logits)
        logits2d, target1d, valid = _flatten(logits, target, cfg)
        has_target = target is not None
        chunks = logits_chunks(logits2d, target1d, valid, cfg, padded=True,
                               upcast=not backend_of(cfg).tiles)
        parts = gathered_stats(chunks, logits2d.shape[0], cfg, tp_group,
                               has_target=has_target, device=logits.device)
        merged = merge_stats(parts, valid, vocab_size=cfg.layout.vocab_size,
                             label_smoothing=cfg.label_smoothing if has_target else 0.0,
                             entropy=cfg.entropy != "off", has_target=has_target,
                             batch_invariant=bool(cfg.batch_invariant),
                             tokens_per_pass=merge_tokens_per_pass(cfg, parts.shape[0]),
                             in_range=targets_in_range(target1d, cfg))
        if host_checks_enabled(cfg.validate, logits.device):
            check_finite(merged.logsumexp, valid, logits2d=logits2d, temperature=cfg.temperature)

        logprobs, entropy, lse = function_outputs(ctx, merged, logits.shape[:-1], cfg.entropy)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, target, lse, entropy if cfg.entropy == "grad" else None,
                              merged.lse_lo)
        return logprobs, entropy, lse

    @staticmethod
    @first_order_backward("vocab_parallel_stats")
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        logits, target, lse, ent, lse_lo = ctx.saved_tensors
        cfg: StatsConfig = ctx.cfg
        logits2d, target1d, valid = _flatten(logits, target, cfg)
        # Coefficients carry the temperature and are 0 at ignored rows, whose gradient is then
        # exactly 0 (their lse is made finite so that p stays finite).
        coef_lp, coef_h = grad_coefficients(grad_logprobs, grad_entropy, valid, cfg.temperature,
                                            in_range=targets_in_range(target1d, cfg))
        lse = finite_lse(lse.reshape(-1), valid)
        ent = ent.reshape(-1) if ent is not None else None
        grad = StatsGrad(lse, ent if coef_h is not None else None, coef_lp, coef_h,
                         valid, cfg.layout, cfg.label_smoothing, lse_lo=lse_lo)
        grad_logits = logits_grad(logits2d, target1d, valid, cfg, grad)
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
    kernel: str = "auto",
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
            parallelism (``logits`` holds the whole vocabulary; refused without ``vocab_size``
            where Megatron's parallel state is initialised with tensor parallelism: the logits
            are then one rank's shard and the group was forgotten).
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
            ``q = (1 - eps) onehot(target) + eps / V`` over the V real columns (the global real
            size, never the shard width), so ``-logprobs`` is the smoothed cross-entropy.
        validate: run the checks that read tensor values on the host (target range, one tiny
            all-gather comparing shard width, token count, vocab_size, dtype, targets and options
            across ranks, and finite results). Skipped while a CUDA graph is being captured
            and while a tracer runs the call (``torch.compile``, ``make_fx``: no values).
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
        kernel: the backend of the per-chunk statistics and gradient: ``"auto"`` (default:
            the ``VOCABSTATS_KERNEL`` environment variable, ``torch`` or ``triton``, if set;
            else ``"torch"``: Triton for CUDA logits once the kernels have passed the GPU
            check, ``ops.kernels.AUTO_TRITON_ON_CUDA``),
            ``"torch"`` (the reference path) or ``"triton"`` (``ops.kernels.triton_stats``:
            one read of the logits per pass; CUDA logits, or CPU under Triton's interpreter
            ``TRITON_INTERPRET=1``). Every batch-invariant mode runs on both (the kernels keep a
            row's reduction order fixed; "tp" takes their per-block statistics). Both are
            within the tolerances of ``docs/numerics.md``; their bits differ. The resolved
            backend must be equal on all ranks (checked with ``validate``).

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
            does not fit the shards, a missing ``tp_group`` (see there), and (with
            ``validate``) the full logits replicated on every rank (a first row that is not
            constant and equal on every rank, at least ``vocab_size`` wide; narrower, or without
            ``vocab_size``, equal shards are computed as shards with one warning per process;
            the message names ``tp_group``), target ids outside ``[0, V)`` other than
            ``ignore_index``, shards, targets or options that differ across ranks (the message
            names the field and prints each rank's value), and
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
        kernel=kernel,
    )
    return VocabStats(*_VocabParallelStats.apply(logits, target, cfg, tp_group))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[VocabStatsKwargs],
) -> torch.Tensor:
    """Per-token ``log p(target)`` (fp32, nats, shaped like ``target``) from vocab-parallel logits.

    Equals ``vocab_parallel_stats(..., entropy="off").logprobs``: the same keywords
    (:class:`~megatron_vocabstats.ops.options.VocabStatsKwargs`), shapes, errors and communication
    (see :func:`vocab_parallel_stats`). Ignored positions give 0.
    """
    check_keywords("vocab_parallel_logprobs", options, VocabStatsKwargs)
    return vocab_parallel_stats(logits, target, tp_group=tp_group, entropy="off",
                                **options).logprobs


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    differentiable: bool = True,
    **options: Unpack[VocabStatsKwargs],
) -> torch.Tensor:
    """Per-token entropy ``-sum_j p_j log p_j`` (fp32, nats, shaped like ``logits.shape[:-1]``).

    Exact (``H = logZ - E_p[z]``, no sampling), from the shard ``[..., W]`` without gathering it.
    ``differentiable=False`` is the ``"metric"`` mode: no gradient and nothing saved for one;
    a ``differentiable`` that is not a bool raises a ``TypeError`` (also a ``ValueError``).
    Keywords (:class:`~megatron_vocabstats.ops.options.VocabStatsKwargs`), errors and communication
    as in :func:`vocab_parallel_stats` (no target).
    """
    check_keywords("vocab_parallel_entropy", options, VocabStatsKwargs)
    differentiable = check_bool("differentiable", differentiable)
    return vocab_parallel_stats(logits, None, tp_group=tp_group,
                                entropy="grad" if differentiable else "metric",
                                **options).entropy


def _check_megatron_ready() -> None:
    """The drop-in's ``tp_group=None`` means Megatron's group: ``ValueError`` naming
    ``tp_group`` when Megatron was imported but its parallel state is not initialised yet while
    several processes run (the call would silently compute per-shard statistics)."""
    if megatron_tp_size() == 0 and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "vocab_parallel_cross_entropy: tp_group=None means Megatron's tensor-parallel group, "
            "but megatron.core.parallel_state is not initialised yet (torch.distributed runs "
            f"{dist.get_world_size()} processes): call it after initialize_model_parallel, or "
            "pass tp_group (or vocab_size for logits that hold the whole vocabulary)")


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[VocabStatsKwargs],
) -> torch.Tensor:
    """Drop-in for Megatron's ``tensor_parallel.vocab_parallel_cross_entropy``.

    Same positional arguments and result: per-token loss ``-log p(target)``, fp32, shaped like
    ``target`` (Megatron: logits ``[s, b, V/tp]``, target ``[s, b]``), plus the keywords of
    :func:`vocab_parallel_stats` (:class:`~megatron_vocabstats.ops.options.VocabStatsKwargs`;
    ``ignore_index``: loss and gradient 0 there). Unlike the other ops,
    and like Megatron, ``tp_group=None`` means Megatron's default tensor-parallel group when
    ``megatron.core.parallel_state`` is initialised (no tensor parallelism otherwise; but a
    ``ValueError`` naming ``tp_group`` when Megatron was imported and is not initialised yet
    in a multi-process run, unless ``vocab_size`` says the logits hold the whole vocabulary).

    Label smoothing follows ``docs/numerics.md``: ``(1-eps) * nll + eps * (logZ - mean_j z_j)``
    over the V real columns. Megatron's own version spreads ``eps*K/(K-1)`` with K the local
    shard width, so its smoothed loss differs from this one (and across tp sizes).

    Raises: as :func:`vocab_parallel_stats`.
    """
    check_keywords("vocab_parallel_cross_entropy", options, VocabStatsKwargs)
    if tp_group is None:
        tp_group = default_tp_group()
        if tp_group is None and options.get("vocab_size") is None:
            _check_megatron_ready()
    stats = vocab_parallel_stats(vocab_parallel_logits, target, tp_group=tp_group,
                                 entropy="off", label_smoothing=label_smoothing, **options)
    return 0.0 - stats.logprobs  # +0.0, not -0.0, at ignored positions
