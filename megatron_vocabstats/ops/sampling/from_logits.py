"""Log-probs under an inference sampler's distribution (vLLM's v1 sampler: temperature, min-p,
top-k, top-p) from vocab-parallel logits, without gathering the vocabulary; the filters'
thresholds come from a radix search over the shards (:mod:`.search`). Order, tie rules, method,
communication and precision (a token whose strictly-more-likely mass lies within about 1e-7
relative of ``top_p`` may fall either way): ``docs/rollout.md``.
"""

from __future__ import annotations

from typing import NamedTuple, Unpack

import torch
import torch.distributed as dist

from .._checks import checked_config, first_order_backward
from ..agreement import bits_float, float_bits
from ..engine.chunks import flatten_target, logits_chunks, logits_grad
from ..options import SAMPLER_OPTIONS, SamplingKwargs, takes_options
from ..workspace import untracked
from .search import (
    SampledGrad,
    SamplerConfig,
    grad_coefficient,
    sampled_pass,
    sampling_outputs,
)

# A top_k at least this large keeps every column of any vocabulary (ids are below 2**31).
_TOP_K_ALL = 2**62

__all__ = [
    "SamplingLogprobs",
    "sampler_config",
    "sampler_problem",
    "vocab_parallel_sampling_logprobs",
]


class SamplingLogprobs(NamedTuple):
    """``logprobs``: fp32 ``log q(target)`` shaped like ``target`` (nats; 0 at ``ignore_index``);
    ``outside``: bool, True where a scored target is outside the kept set (a -inf logit included,
    with or without filters), exactly where ``logprobs`` is -inf."""

    logprobs: torch.Tensor
    outside: torch.Tensor


def sampler_problem(top_k, top_p, min_p) -> Exception | None:
    """The first bad filter argument as an exception naming it (a wrong type an
    ``InputTypeError``, a value out of range a ``ValueError``), or None."""
    for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        try:
            SAMPLER_OPTIONS[name].check(name, value)
        except ValueError as exc:  # InputTypeError included
            return exc
    return None


class _SamplingLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, cfg: SamplerConfig, tp_group):
        sc = cfg.stats
        logits2d = untracked(logits).reshape(-1, sc.layout.width)
        target1d, valid = flatten_target(target, sc.ignore_index)
        logprobs, outside, saved = sampled_pass(
            lambda: logits_chunks(logits2d, target1d, valid, sc), target1d, valid, cfg,
            logits2d.shape[0], logits.device, tp_group)
        ctx.cfg = cfg
        ctx.save_for_backward(logits, target, *saved)
        return sampling_outputs(ctx, logprobs, outside, target.shape)

    @staticmethod
    @first_order_backward("vocab_parallel_sampling_logprobs")
    def backward(ctx, grad, _grad_outside):
        logits, target, *saved = ctx.saved_tensors
        cfg: SamplerConfig = ctx.cfg
        sc = cfg.stats
        logits2d = logits.reshape(-1, sc.layout.width)
        target1d, valid = flatten_target(target, sc.ignore_index)
        kernel = SampledGrad(grad_coefficient(grad, saved, sc.temperature), tuple(saved), cfg)
        grad_logits = logits_grad(logits2d, target1d, valid, sc, kernel)
        return grad_logits.view(logits.shape), None, None, None


def sampler_config(logits, target, tp_group, *, local_error=None, check=checked_config,
                   **options) -> tuple[SamplerConfig, object]:
    """Validate one call (the core checks through ``check``, the filters, their agreement
    across ranks): ``(SamplerConfig, what check returned)``."""
    top_k, top_p, min_p = (options.pop(name, None) for name in SAMPLER_OPTIONS)
    problem = local_error or sampler_problem(top_k, top_p, min_p)
    if target is None and problem is None:
        problem = ValueError("target is required: the sampled token ids to score")
    if problem is None and top_k is not None:
        # Every k >= V keeps the whole vocabulary: a huge one (2**70, 10**400) is clamped below
        # int64 and float64 overflow, on every rank alike (no vocabulary reaches 2**62).
        top_k = min(int(top_k), _TOP_K_ALL)
    stats = check(
        logits, target, tp_group, local_error=problem,
        agree=(("top_k", lambda: -1 if top_k is None else int(top_k)),
               ("top_p", lambda: float_bits(-1.0 if top_p is None else float(top_p)),
                bits_float),
               ("min_p", lambda: float_bits(-1.0 if min_p is None else float(min_p)),
                bits_float)),
        entropy="off", kernel="torch", **options)
    return SamplerConfig(stats=getattr(stats, "stats", stats),
                         top_k=None if top_k is None else int(top_k),
                         top_p=None if top_p is None else float(top_p),
                         min_p=None if min_p is None else float(min_p)), stats


@takes_options
def vocab_parallel_sampling_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[SamplingKwargs],
) -> SamplingLogprobs:
    """``log q(target)`` under the inference sampler's truncated, renormalised distribution q.

    Reference semantics (one process, full vocabulary, vLLM's v1 sampler; the order, the tie rules
    and the method, a radix threshold search over the shards: ``docs/rollout.md``)::

        z = logits.float()[..., :V] / temperature
        keep = torch.exp(z - z.max(-1, keepdim=True).values) >= min_p          # min-p
        z = z.masked_fill(~keep, -inf)
        keep &= z >= z.topk(top_k, -1).values[..., -1:]                         # top-k
        z_k = z.masked_fill(~keep, -inf)
        order = z_k.sort(-1, stable=True).indices                               # top-p
        drop = torch.softmax(z_k, -1).gather(-1, order).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        keep &= ~drop.new_zeros(drop.shape).scatter(-1, order, drop)
        logprobs = torch.log_softmax(z.masked_fill(~keep, -inf), -1).gather(-1, target[..., None])

    Args:
        logits: this rank's shard ``[..., W]`` (bf16, fp16 or fp32); differentiable, never modified.
        target: int64 global ids shaped like ``logits.shape[:-1]`` (the sampled tokens).
        top_k: an int >= 1 (ties at the k-th value kept; k >= V keeps everything); None = off.
        top_p: in (0, 1]; None or 1 = off. A tie on the boundary keeps its highest ids.
        min_p: in [0, 1); None or 0 = off.
        tp_group, **options: as :func:`~megatron_vocabstats.vocab_parallel_stats`
            (:class:`~megatron_vocabstats.ops.options.SamplingKwargs`); ``temperature`` > 0.

    Returns:
        :class:`SamplingLogprobs`, equal on every rank; the log-prob is NaN at an id outside
        ``[0, V)`` when ``validate`` is off. Gradient w.r.t. the logits with the kept set held
        constant: ``(1[j = y] - q_j) / temperature``; zero where the target is outside the set or
        ignored.

    Communication (tp > 1): at most 14 small all-gathers in forward (plus the check all-gather
    with ``validate``), none in backward. Memory: the core op's two fp32 ``[chunk, W]`` buffers,
    chunk-sized int64 keys and float64 masses.

    Raises:
        ValueError: a filter out of range, ``temperature`` not > 0, what
            :func:`~megatron_vocabstats.vocab_parallel_stats` raises, and under ``validate`` on
            tp > 1 (on every rank) filters that differ across the ranks. A filter of the wrong
            type: ``InputTypeError`` (a ``TypeError`` and a ``ValueError``).
        RuntimeError: on double backward.
    """
    cfg, _ = sampler_config(logits, target, tp_group, **options)
    return SamplingLogprobs(*_SamplingLogprobs.apply(logits, target, cfg, tp_group))
