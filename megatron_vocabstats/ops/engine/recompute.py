"""The backward engines of the fused LM head: recompute each chunk, or take the gradients in
forward.

Backward recomputes each chunk's logits, turns them into their gradient by the op's
:class:`~.kernel.ChunkGrad` and at once into ``dX = g @ W`` and ``dW += g.T @ h``. The
forward-gradient mode (``linear_vocab_parallel_stats(grad_weights=...)``) takes statistics and
gradients in one pass and only scales them in backward.
"""

from __future__ import annotations

import torch

from .. import _comm
from .._grad import finite_lse, grad_coefficients
from .._math import MergedStats, load_chunk
from ..agreement import host_checks_enabled
from .backends import backend_of, grad_backend
from .chunks import gathered_stats, targets_in_range
from .kernel import ChunkGrad, StatsGrad
from .linear import (
    ChunkBuffers,
    LinearStatsConfig,
    full_hidden,
    fused_chunks,
    reduce_hidden_grad,
)
from .wgrad import (
    finish_weight_grad,
    fresh_weight_grad,
    input_grads_of_chunk,
    weight_grad_buffer,
)


def forward_with_grads(hidden2d, weight, target1d, valid, grad_weights, bufs,
                       cfg: LinearStatsConfig, tp_group, merge):
    """The forward-gradient pass: ``(MergedStats, dX or None, dW sums or None)``, the gradients
    those of upstream ``grad_weights`` on the logprobs (``dX`` [T, H] per shard, model dtype;
    fp32 ``dW`` sums): 3 matmuls per chunk, no recompute, and one all-gather per chunk (its
    gradient needs the global logsumexp)."""
    sc = cfg.stats
    kernels = backend_of(sc)
    in_range = targets_in_range(target1d, sc)  # NaN logprob, no gradient
    coef_lp, _ = grad_coefficients(grad_weights, None, valid, sc.temperature, in_range=in_range)
    names = ("logsumexp", "logprobs", "lse_lo") + (("entropy",) if sc.entropy != "off" else ())
    out = {name: hidden2d.new_empty(hidden2d.shape[0], dtype=torch.float32) for name in names}
    dx2d = torch.empty_like(hidden2d) if cfg.grad_hidden else None
    fresh = cfg.grad_weight and fresh_weight_grad(None, kernels.tiles)
    acc = weight_grad_buffer(weight, None, fresh=fresh) if cfg.grad_weight else None
    for chunk in fused_chunks(hidden2d, weight, target1d, valid, sc, bufs, padded=True):
        rows = chunk.rows
        n = rows.stop - rows.start
        local = chunk._replace(rows=slice(0, n))  # the chunk's own [n] vectors below
        if kernels.tiles:  # the statistics store the chunk's logits: its gradient reads them
            local = local._replace(logits=bufs.logits[:n])
        parts = gathered_stats([local], n, sc, tp_group, has_target=True,
                               device=hidden2d.device)
        part = merge(parts, valid[rows], in_range=in_range[rows])
        for name in names:
            out[name][rows] = getattr(part, name)
        if kernels.tiles:  # 3 GEMMs: the gradient from the stored logits, not recomputed
            local = local._replace(hidden=None, weight=None)
        else:  # the statistics overwrote z
            local = local._replace(z=load_chunk(chunk.logits, bufs.z, sc.layout, sc.temperature),
                                   scratch=bufs.scratch)
        grad = StatsGrad(finite_lse(part.logsumexp, valid[rows]), None, coef_lp[rows], None,
                         valid[rows], sc.layout, sc.label_smoothing, lse_lo=part.lse_lo)
        g = bufs.logits[:n]
        kernels.stats_grad(grad, sc.temperature)(local, g)
        input_grads_of_chunk(g, hidden2d[rows], weight,
                             dx2d[rows] if dx2d is not None else None, acc, bufs, fresh=fresh)
        fresh = False
    if fresh:  # no chunk (no tokens): the uninitialised sums are zero
        acc.zero_()
    return MergedStats(**{name: out.get(name) for name in ("logsumexp", "logprobs", "entropy",
                                                           "lse_lo")}), dx2d, acc


def scaled_forward_grads(ctx, grad_logprobs):
    """``(grad_hidden, grad_weight)`` of the forward-gradient mode: the gradients stored by
    :func:`forward_with_grads` scaled by :func:`upstream_scale` (once per forward)."""
    # Checked before ctx.saved_tensors: the first backward may have scaled acc in place, and
    # unpacking it again would raise torch's version-counter error instead.
    if ctx.used:
        raise RuntimeError("linear_vocab_parallel_stats: with grad_weights (forward-gradient "
                           "mode) backward runs once per forward: the gradients stored in "
                           "forward were used up (scaled) by the first backward. Run the forward "
                           "again, or pass grad_weights=None to backpropagate more than once")
    ctx.used = True
    weight, target, grad_weights, grad_hidden, acc = ctx.saved_tensors
    cfg: LinearStatsConfig = ctx.cfg
    valid = target.reshape(-1) != cfg.stats.ignore_index
    scale = upstream_scale(grad_logprobs, grad_weights, valid, cfg, ctx.tp_group)
    if grad_hidden is not None:
        grad_hidden = grad_hidden.mul(scale)
    grad_weight = None
    if acc is not None and not cfg.accumulate_into_main_grad and weight.dtype != acc.dtype:
        # The scaling and the cast to the weight's dtype in one pass (fp32 product, one rounding:
        # the bits of acc.mul_(scale).to(dtype), a read of acc fewer).
        grad_weight = torch.mul(acc, scale, out=torch.empty_like(weight))
    elif acc is not None:
        grad_weight = finish_weight_grad(acc.mul_(scale), weight, ctx.main_grad, cfg)
    return grad_hidden, grad_weight


# Relative tolerance of the proportionality check of the forward-gradient mode: far above the
# rounding of c * w (a few fp32 ulps, and of the scale's reductions), far below any real mismatch.
SCALE_RTOL = 1e-4


def upstream_scale(grad_logprobs, grad_weights, valid, cfg: LinearStatsConfig, tp_group):
    """The 0-d fp32 c with ``grad_logprobs = c * grad_weights`` on the scored positions: least
    squares ``<g, w> / <w, w>`` (0 when every weight is 0), no host sync. With ``validate``
    (outside capture) a residual above ``SCALE_RTOL * max|g|`` raises ``ValueError`` on every
    rank (one tiny all-gather under tp > 1)."""
    g = torch.where(valid, grad_logprobs.reshape(-1).float(), 0.0)
    w = torch.where(valid, grad_weights.reshape(-1).float(), 0.0)
    norm = (w * w).sum()
    scale = torch.where(norm > 0, (g * w).sum() / norm.clamp(min=torch.finfo(torch.float32).tiny),
                        0.0)
    if host_checks_enabled(cfg.stats.validate, g.device) and g.numel():
        bad = not bool((g - scale * w).abs().max() <= SCALE_RTOL * g.abs().max())
        _, tp = _comm.group_rank_size(tp_group)
        if tp > 1:
            bad = any(row[0] for row in _comm.all_gather_ints([int(bad)], tp_group,
                                                               device=g.device))
        if bad:
            raise ValueError(
                "grad_weights: the upstream gradient of logprobs is not a scalar multiple of "
                "grad_weights on the scored positions (on some rank); the forward-gradient mode "
                "only serves losses sum(c * grad_weights * logprobs) with one scalar c. Pass the "
                "loss's per-token weights as grad_weights, or grad_weights=None"
            )
    return scale


def recompute_backward(hidden, weight, target1d, valid, cfg: LinearStatsConfig, tp_group,
                       main_grad, grad: ChunkGrad) -> tuple:
    """``(grad_hidden, grad_weight)`` of a fused op by recomputing each chunk's logits (None for
    a gradient ``cfg`` does not ask for).

    ``grad(chunk, out)`` turns the chunk's logits in ``out`` (model dtype ``[n, W]``, also
    ``chunk.logits``) into their gradient in place, or, for a :class:`~.kernel.StatsGrad` on a
    ``tiles`` backend, writes it from a chunk without logits (:func:`.linear.tile_chunks`).
    ``hidden``: this rank's (sequence-parallel) shard; ``target1d``/``valid``: the flattened
    targets (None without); ``main_grad``: the weight's, under gradient-accumulation fusion."""
    sc = cfg.stats
    total = full_hidden(hidden, cfg, tp_group)
    hidden2d = total.reshape(-1, total.shape[-1])
    dx2d = torch.empty_like(hidden2d) if cfg.grad_hidden else None
    kernels = grad_backend(sc, grad)
    fresh = cfg.grad_weight and fresh_weight_grad(main_grad, kernels.tiles)
    acc = weight_grad_buffer(weight, main_grad, fresh=fresh) if cfg.grad_weight else None
    grad = kernels.stats_grad(grad, sc.temperature)
    bufs = ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size,
                        batch_invariant=bool(sc.batch_invariant), tiles=kernels.tiles)
    try:
        for chunk in fused_chunks(hidden2d, weight, target1d, valid, sc, bufs,
                                  tiles=kernels.tiles):
            g = bufs.logits[:chunk.rows.stop - chunk.rows.start]
            grad(chunk, g)
            input_grads_of_chunk(g, hidden2d[chunk.rows], weight,
                                 dx2d[chunk.rows] if dx2d is not None else None, acc, bufs,
                                 fresh=fresh)
            fresh = False
    finally:
        bufs.release()
    if fresh:  # no chunk (no tokens): the uninitialised sums are zero
        acc.zero_()
    grad_hidden = None
    if dx2d is not None:
        grad_hidden = reduce_hidden_grad(dx2d, total.shape, cfg, tp_group)
    grad_weight = None
    if acc is not None:
        grad_weight = finish_weight_grad(acc, weight, main_grad, cfg)
    return grad_hidden, grad_weight
