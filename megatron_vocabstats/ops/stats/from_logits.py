"""Exact vocab-parallel log-probs, entropy and cross-entropy without gathering the vocabulary.

One autograd Function covers every chunk: the forward upcasts one ``[chunk, W]`` slice at a time
into two reused fp32 buffers, packs each shard's statistics into a ``[k, T]`` tensor and merges
them after a single all-gather; the backward recomputes each chunk and writes its gradient into one
preallocated tensor of the logits' dtype, with no collective.
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import torch
import torch.distributed as dist

from ...mcore import default_tp_group, megatron_tp_size
from .._argtypes import check_bool
from .._checks import check_finite, checked_config, first_order_backward
from .._grad import finite_lse, grad_coefficients
from .._math import merge_stats
from ..agreement import host_checks_enabled
from ..engine.backends import backend_of
from ..engine.chunks import (
    flatten_target,
    function_outputs,
    gathered_stats,
    logits_chunks,
    logits_grad,
    merge_tokens_per_pass,
    row_argmax,
    targets_in_range,
)
from ..engine.kernel import StatsGrad
from ..options import StatsConfig, StatsOpKwargs, VocabStatsKwargs, takes_options
from ..workspace import untracked

__all__ = [
    "VocabStats",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_logprobs",
    "vocab_parallel_stats",
]


class VocabStats(NamedTuple):
    """Per-token statistics, each shaped like ``target`` (the logits' leading shape).

    ``logprobs``: fp32 log p(target) in nats (with label smoothing ``sum_j q_j log p_j``, see
    :func:`vocab_parallel_stats`); None when no target was given.
    ``entropy``: fp32 ``-sum_j p_j log p_j`` in nats; None when ``entropy="off"``.
    ``logsumexp``: fp32 ``log sum_j exp(z_j)`` over the real vocabulary; never differentiable.
    ``argmax``: int64 global id of the row's largest logit (the first on ties); None unless
    ``argmax=True``; never differentiable.
    """

    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None
    logsumexp: torch.Tensor
    argmax: torch.Tensor | None = None


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
                               has_target=has_target, device=logits.device, argmax=cfg.argmax)
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
        return logprobs, entropy, lse, row_argmax(parts, cfg, logits.shape[:-1])

    @staticmethod
    @first_order_backward("vocab_parallel_stats")
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse, _grad_argmax):
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


@takes_options
def vocab_parallel_stats(
    logits: torch.Tensor,
    target: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[StatsOpKwargs],
) -> VocabStats:
    """Exact per-token log-probs, entropy, logsumexp (and argmax) from vocab-parallel logits.

    Reference semantics (one process, full vocabulary, ``z = logits.float() / temperature`` with
    columns ``>= vocab_size`` removed)::

        logp = torch.log_softmax(z, -1)
        logprobs = (1 - eps) * logp.gather(-1, target[..., None])[..., 0] + eps * logp.mean(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        logsumexp = torch.logsumexp(z, -1)

    without gathering the vocabulary, an fp32 copy of the shard or a one-hot. Method: per-shard
    sufficient statistics merged across ranks, ``H = logZ - E_p[z]`` (``docs/numerics.md``).

    Args:
        logits: this rank's vocabulary shard ``[..., W]`` (W = padded V / tp), bf16, fp16 or fp32,
            any leading shape (Megatron ``[s, b, W]``, THD ``[T, 1, W]``, ``[B, S, W]``). Rank r
            holds global columns ``[r*W, (r+1)*W)``, or from ``vocab_start``. Never modified.
        target: int64 global token ids shaped like ``logits.shape[:-1]``, or None to compute only
            entropy and logsumexp.
        tp_group: the tensor-parallel group; None: no tensor parallelism.
        vocab_size: the real (unpadded) V; global ids >= V are padding. Default ``W * tp``.
        vocab_start: this shard's first global id, for unequal shards (needs ``vocab_size``).
        chunk_size: tokens upcast to fp32 at a time (None: auto); results do not depend on it.
        entropy: ``"off"`` (returned as None), ``"metric"`` (no gradient) or ``"grad"``.
        temperature: logits (and gradients) are divided by it; at least about 2.94e-39.
        ignore_index: targets equal to it get logprob 0, entropy 0 and exactly zero gradient.
        label_smoothing: eps in [0, 1): ``logprobs`` becomes ``sum_j q_j log p_j``, q smoothed.
        validate: the checks that read values on the host, and the cross-rank agreement.
        batch_invariant: ``False``, ``True`` (bitwise per row) or ``"tp"`` (also across tp).
        kernel: ``"auto"``, ``"torch"`` or ``"triton"``.
        argmax: also each row's global argmax id (``VocabStats.argmax``; torch kernel only).
        Each option is stated once, with its checks and costs, in ``docs/options.md``.

    Returns:
        :class:`VocabStats` ``(logprobs, entropy, logsumexp, argmax)``, shaped like
        ``logits.shape[:-1]``, identical on every rank of ``tp_group``.

    Communication: one all-gather of ``[5, T]`` fp32 (``[6, T]`` with ``argmax``) in forward,
    plus one of a few int64 with ``validate``; none in backward. Memory beyond the inputs: two
    reused fp32 ``[chunk, W]`` buffers (``ops.workspace``) and ``O(tp * T)`` fp32 vectors;
    backward allocates the logits gradient once, in the logits dtype. No host synchronisation
    with ``validate=False`` (graph-capturable).

    Raises:
        TypeError: an argument of the wrong Python type, naming it (``InputTypeError``, also a
            ``ValueError``).
        ValueError: naming the argument: a bad shape or dtype, an empty shard, an option out of
            range, a missing ``tp_group``; with ``validate``, target ids outside ``[0, V)``, full
            logits replicated on every rank, inputs or options that differ across ranks (raised
            on every rank), scored rows with no finite logsumexp (NaN, +inf, all -inf, or a too
            small ``temperature``).
        RuntimeError: on double backward (``create_graph=True``), which is not supported.
    """
    cfg = checked_config(logits, target, tp_group, **options)
    return VocabStats(*_VocabParallelStats.apply(logits, target, cfg, tp_group))


@takes_options
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
    return vocab_parallel_stats(logits, target, tp_group=tp_group, entropy="off",
                                **options).logprobs


@takes_options
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


@takes_options
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
    if tp_group is None:
        tp_group = default_tp_group()
        if tp_group is None and options.get("vocab_size") is None:
            _check_megatron_ready()
    stats = vocab_parallel_stats(vocab_parallel_logits, target, tp_group=tp_group,
                                 entropy="off", label_smoothing=label_smoothing, **options)
    return 0.0 - stats.logprobs  # +0.0, not -0.0, at ignored positions
