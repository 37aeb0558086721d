"""Peak-memory cases for slime's training-step log-probs (issue 30, item 5): ``cases(...)`` gives
zero-argument callables, each one forward + backward of what slime's policy loss runs on this
rank's logits shard; ``benchmarks/bench_integrations.py`` measures them per rank.

- ``"slime"``: slime's own path, as read at THUDM/slime ``624b824``: Megatron's ``Float16Module``
  hands the loss an fp32 copy of the bf16 logits; ``calculate_log_probs_and_entropy`` (not
  chunked: ``--log-probs-chunk-size`` defaults to -1) forms the fp32 softmax of the whole
  ``[T, W]`` shard in one buffer (max subtracted, ``exp_``, ``div_`` in place), reads the entropy
  from ``sum p z`` (an einsum, as on CUDA: no product buffer) and keeps the softmax for
  backward, which turns it in place into the gradient. Written here from those conventions
  (no slime code).
- ``"ours unfused"``: the same fp32 copy, then the integration's replacement
  (:func:`megatron_vocabstats.integrations.slime_ops.calculate_log_probs_and_entropy`).

No ``"ours fused"``: slime has no fused path (docs/integrations.md says why none is offered).
The policy loss always asks for the entropy; it has a gradient only with ``--entropy-coef``
(default 0): :data:`ENTROPY_GRAD`. ``--rollout-temperature`` defaults to 1 (no division copy).

May import: torch and :mod:`megatron_vocabstats.integrations.slime_ops`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_vocabstats.integrations import slime_ops

ENTROPY_GRAD = False  # slime's default --entropy-coef 0


def _place(group):
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    if _place(group)[1] > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _SlimeLogProbs(torch.autograd.Function):
    """slime's memory behaviour: one fp32 ``[T, W]`` softmax kept for backward (and the fp32
    logits with an entropy gradient), its gradient formed in that buffer."""

    @staticmethod
    def forward(ctx, z, target, group, entropy_grad):
        rank, _ = _place(group)
        width = z.shape[1]
        local = target - rank * width
        outside = (local < 0) | (local >= width)
        local = torch.where(outside, 0, local)
        peak = _all_reduce(z.amax(-1, keepdim=True), group, dist.ReduceOp.MAX)
        probs = z - peak
        picked = probs.gather(1, local[:, None]).masked_fill_(outside[:, None], 0.0)
        total = _all_reduce(probs.exp_().sum(-1, keepdim=True), group)
        probs.div_(total)
        # slime's CUDA branch (einsum, no [T, W] product); its CPU branch forms the product.
        mean = _all_reduce(torch.einsum("ij,ij->i", probs, z).unsqueeze(-1), group)
        entropy = (peak + total.log() - mean)[:, 0]
        log_prob = _all_reduce(picked, group) - total.log()
        ctx.save_for_backward(probs, local, outside, mean if entropy_grad else None,
                              z if entropy_grad else None)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        probs, local, outside, mean, z = ctx.saved_tensors
        extra = None
        if z is not None and g_h is not None:
            extra = (mean - z).mul_(probs).mul_(g_h[:, None])
        grad = probs.neg_()
        grad.scatter_add_(1, local[:, None], (~outside[:, None]).to(grad.dtype))
        grad.mul_(g_lp)
        if extra is not None:
            grad.add_(extra)
        return grad, None, None, None


def cases(T: int, V: int, H: int, tp_group, dtype: torch.dtype) -> dict:
    """``{"slime", "ours unfused"}`` at slime's default (no entropy gradient) and the same two
    with ``--entropy-coef > 0`` (the entropy differentiated): each creates this rank's
    ``[T, V / tp]`` logits shard in ``dtype`` (the model output, a leaf), its targets, and runs
    forward + backward of the
    summed log-probs (the entropy as the policy loss asks for it). ``H`` is unused (no fused
    path)."""
    del H
    rank, tp = _place(tp_group)
    width = V // tp

    def inputs():  # each rank its own shard, the same targets on every rank
        shard = torch.Generator().manual_seed(1 + rank)
        logits = torch.randn(T, width, generator=shard, dtype=dtype).requires_grad_()
        ids = torch.Generator().manual_seed(0)
        return logits, torch.randint(0, width * tp, (T,), generator=ids)

    def step(fn, entropy_grad):
        def run():
            logits, tokens = inputs()
            log_prob, entropy = fn(logits.float(), tokens, entropy_grad)
            loss = log_prob.sum() + (entropy.sum() if entropy_grad else 0.0)
            loss.backward()
        return run

    def slime(z, tokens, entropy_grad):
        return _SlimeLogProbs.apply(z, tokens, tp_group, entropy_grad)

    def ours(z, tokens, entropy_grad):
        return slime_ops.calculate_log_probs_and_entropy(
            z, tokens, tp_group, with_entropy=True, with_entropy_grad=entropy_grad)

    coef = ", --entropy-coef > 0"
    return {"slime": step(slime, ENTROPY_GRAD), "ours unfused": step(ours, ENTROPY_GRAD),
            "slime" + coef: step(slime, True), "ours unfused" + coef: step(ours, True)}
