"""Peak-memory cases for NeMo-RL (issue 30, item 5): one training step's log-probs (forward +
backward) per tp rank, NeMo-RL's own way against the integration, unfused and fused.

``cases(T, V, H, tp_group, dtype)`` returns zero-argument callables (the driver,
``benchmarks/bench_integrations.py``, measures each with torch's MemTracker); each makes its own
inputs:

* ``"nemo_rl"``: NeMo-RL's default path at NVIDIA-NeMo/RL ``7ea279a`` (``logprob_chunk_size``
  unset, as its shipped configs leave it): ``get_next_token_logprobs_from_logits`` upcasts the
  ``[1, T, V/tp]`` logits to fp32, ``DistributedLogprob`` takes the fp32 log-softmax over the
  shards, keeps its ``exp`` for backward and builds an fp32 gradient there. Written here from the
  read code (same tensors alive at the same times), not NeMo-RL's code;
* ``"ours unfused"``: ``nemo_rl_ops.from_parallel_logits_to_logprobs`` (what the integration
  binds) on the same logits;
* ``"ours fused"``: ``nemo_rl_ops.from_parallel_hidden_states_to_logprobs`` (NeMo-RL's fused
  hidden-state path, bound by the integration) from the sequence-parallel hidden shard
  ``[T/tp, 1, H]`` and the output-layer shard ``[V/tp, H]``.

May import: megatron_vocabstats and torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_vocabstats.integrations import nemo_rl_ops


def _rank_size(group):
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


class _NemoRLLogprob(torch.autograd.Function):
    """NeMo-RL's unchunked ``DistributedLogprob`` memory behaviour: fp32 log-softmax of the
    shard, its exp saved for backward, an fp32 gradient built from it."""

    @staticmethod
    def forward(ctx, logits, target, start, group):
        inside = (target >= start) & (target < start + logits.shape[-1])
        local = torch.where(inside, target - start, 0)
        peak = logits.amax(-1, keepdim=True)
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak
        total = shifted.exp().sum(-1, keepdim=True)
        if group is not None:
            dist.all_reduce(total, group=group)
        log_softmax = shifted - total.log()
        picked = log_softmax.gather(-1, local[..., None])[..., 0] * inside
        if group is not None:
            dist.all_reduce(picked, group=group)
        ctx.save_for_backward(log_softmax.exp(), inside, local)
        return picked

    @staticmethod
    def backward(ctx, grad):
        softmax, inside, local = ctx.saved_tensors
        grad_logits = softmax.neg().mul_(grad[..., None])
        grad_logits.scatter_add_(-1, local[..., None], (grad * inside)[..., None])
        return grad_logits, None, None, None


def cases(T: int, V: int, H: int, tp_group, dtype: torch.dtype) -> dict:
    """``{"nemo_rl", "ours unfused", "ours fused"}``: zero-argument callables, each one forward
    and backward of this rank's log-probs of ``T`` tokens over a vocabulary of ``V`` (a multiple
    of the tp size) with hidden size ``H``, logits/weights in ``dtype``."""
    rank, size = _rank_size(tp_group)
    width = V // size
    start = rank * width

    def inputs():
        generator = torch.Generator().manual_seed(rank)
        logits = torch.randn(1, T, width, generator=generator, dtype=dtype).requires_grad_()
        ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(0))
        return logits, ids

    def nemo_rl():
        logits, ids = inputs()
        full = logits.to(torch.float32)  # get_next_token_logprobs_from_logits, unchunked
        out = _NemoRLLogprob.apply(full, ids.roll(-1, -1), start, tp_group)[:, :-1]
        out.sum().backward()

    def ours_unfused():
        logits, ids = inputs()
        out = nemo_rl_ops.from_parallel_logits_to_logprobs(logits, ids, start, start + width,
                                                           tp_group)
        out.sum().backward()

    def ours_fused():
        generator = torch.Generator().manual_seed(rank)
        hidden = torch.randn(T // size, 1, H, generator=generator, dtype=dtype).requires_grad_()
        weight = (torch.randn(width, H, generator=generator) / H**0.5).to(dtype)
        weight.requires_grad_()
        ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(0))
        out = nemo_rl_ops.from_parallel_hidden_states_to_logprobs(
            hidden, weight, False, ids, start, start + width, tp_group)
        out.sum().backward()

    return {"nemo_rl": nemo_rl, "ours unfused": ours_unfused, "ours fused": ours_fused}
