"""The sampler's log-probs (:mod:`.from_logits`) straight from hidden states: every pass of the
threshold search recomputes each chunk's logits, so no ``[T, V/tp]`` tensor exists.
"""

from __future__ import annotations

from typing import Unpack

import torch
import torch.distributed as dist

from .._checks import first_order_backward
from ..engine.chunks import flatten_target
from ..engine.linear import ChunkBuffers, LinearStatsConfig, full_hidden, linear_chunks
from ..engine.recompute import recompute_backward
from ..hidden_checks import checked_linear_config
from ..options import LinearSamplingKwargs, takes_options
from ..workspace import untracked
from .from_logits import SamplingLogprobs, sampler_config
from .search import (
    SampledGrad,
    SamplerConfig,
    grad_coefficient,
    sampled_pass,
    sampling_outputs,
)


class _LinearSamplingLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, cfg: SamplerConfig, lcfg: LinearStatsConfig,
                tp_group):
        hidden, weight = untracked(hidden), untracked(weight)
        sc = cfg.stats
        total = full_hidden(hidden, lcfg, tp_group)
        hidden2d = total.reshape(-1, total.shape[-1])
        target1d, valid = flatten_target(target, sc.ignore_index)
        bufs = ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size)
        try:
            logprobs, outside, saved = sampled_pass(
                lambda: linear_chunks(hidden2d, weight, target1d, valid, sc, bufs), target1d,
                valid, cfg, hidden2d.shape[0], hidden.device, tp_group)
        finally:
            bufs.release()
        ctx.cfg, ctx.lcfg, ctx.tp_group = cfg, lcfg, tp_group
        ctx.main_grad = weight.main_grad if lcfg.accumulate_into_main_grad else None
        ctx.save_for_backward(hidden, weight, target, *saved)
        return sampling_outputs(ctx, logprobs, outside, target.shape)

    @staticmethod
    @first_order_backward("linear_vocab_parallel_sampling_logprobs")
    def backward(ctx, grad, _grad_outside):
        hidden, weight, target, *saved = ctx.saved_tensors
        cfg: SamplerConfig = ctx.cfg
        target1d, valid = flatten_target(target, cfg.stats.ignore_index)
        kernel = SampledGrad(grad_coefficient(grad, saved, cfg.stats.temperature), tuple(saved),
                             cfg)
        grad_hidden, grad_weight = recompute_backward(hidden, weight, target1d, valid, ctx.lcfg,
                                                      ctx.tp_group, ctx.main_grad, kernel)
        return grad_hidden, grad_weight, None, None, None, None


@takes_options
def linear_vocab_parallel_sampling_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    **options: Unpack[LinearSamplingKwargs],
) -> SamplingLogprobs:
    """:func:`~megatron_vocabstats.vocab_parallel_sampling_logprobs` of ``hidden @ W.T`` without
    the logits.

    Reference semantics (``W`` the full output weight, shards stacked in rank order; ``h`` the
    full sequence, the shards of ``hidden`` concatenated along dim 0 under
    ``sequence_parallel``)::

        vocab_parallel_sampling_logprobs(h @ W.T, target, temperature=..., top_k=..., ...)

    on the chunk products of :func:`~megatron_vocabstats.linear_vocab_parallel_stats` (model
    dtype, one rounding). ``hidden``, ``weight``, ``sequence_parallel``,
    ``accumulate_into_main_grad`` and the errors are those of ``linear_vocab_parallel_stats``; the
    filters, the other keywords (:class:`~megatron_vocabstats.ops.options.LinearSamplingKwargs`),
    results and communication those of ``vocab_parallel_sampling_logprobs`` (plus the
    sequence-parallel gather of ``hidden``, and in backward the all-reduce or reduce-scatter of
    dX). Memory: the fused head's chunk buffers, chunk-sized int64 keys and float64 masses.
    """
    def check(_logits, target_, group, **kwargs):
        return checked_linear_config(hidden, weight, target_, None, group, **kwargs)

    cfg, lcfg = sampler_config(None, target, tp_group, check=check, **options)
    return SamplingLogprobs(*_LinearSamplingLogprobs.apply(hidden, weight, target, cfg, lcfg,
                                                           tp_group))
