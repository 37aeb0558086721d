"""AReaL's ``gather_logprobs`` and ``gather_logprobs_entropy`` on the ops, as read from the
``areal-1.0.4`` wheel (``areal/utils/functional/vocab_parallel.py``); differences
(:data:`NOTES`): docs/integrations.md, "AReaL".
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..ops import vocab_parallel_stats
from ..ops.options import check_number
from ._options import IntegrationOptions

_DIFFERENCES = (
    "runs on vocab_parallel_stats, without an fp32 copy of the logits or a saved softmax. "
    "Differences: chunk_size is checked and not used (the op chunks by logprobs_chunk_size; the "
    "values do not depend on it); an id outside [0, W*tp) gives max - logsumexp and the "
    "gradient -p at tp = 1 too (AReaL's tp = 1 path raises an indexing error)")
NOTES = {
    "gather_logprobs": _DIFFERENCES,
    "gather_logprobs_entropy": _DIFFERENCES + "; -inf-masked columns add 0 to the entropy "
                                              "(AReaL's gives NaN)",
}

OPTIONS = IntegrationOptions(
    "AReaL", NOTES, names=("logprobs_chunk_size", "validate", "batch_invariant", "kernel"))


def _check(logits, labels, chunk_size) -> None:
    check_number("chunk_size", chunk_size, integer=True, low=1, high=2**63 - 1)
    if not isinstance(logits, torch.Tensor) or logits.dim() == 0:
        raise ValueError(f"logits must be a tensor [..., W], got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be a tensor of integer token ids, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must have the shape of logits without its last dim, "
                         f"{tuple(logits.shape[:-1])}, got {tuple(labels.shape)}")
    if logits.shape[0] == 0:
        raise ValueError(f"logits is an empty micro-batch, shape {tuple(logits.shape)} (AReaL "
                         "asserts at least one row)")


def _row_argmax(logits, rank, group):
    """Global id of each row's largest logit (lowest id on ties), ``labels``-shaped int64."""
    values, index = logits.detach().max(dim=-1)
    if group is None:
        return index
    values = values.float()
    top = values.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    ids = torch.where(values == top, index + rank * logits.shape[-1],
                      torch.iinfo(torch.int64).max)
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
    return ids


def _stats(name, logits, labels, temperature, tp_group, chunk_size, entropy):
    OPTIONS.note_once(name)
    _check(logits, labels, chunk_size)
    group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    rank = 0 if group is None else dist.get_rank(group)
    settings = OPTIONS.settings
    options = replace(settings.stats_options(), entropy=entropy, temperature=temperature)
    width = logits.shape[-1]
    tp = 1 if group is None else dist.get_world_size(group)
    outside = (labels < 0) | (labels >= width * tp)
    if settings.validate and not bool(outside.any()):
        stats = vocab_parallel_stats(logits, labels, **options.op_kwargs(tp_group=group))
        return stats.logprobs, stats.entropy
    # AReaL's rule for an id outside the shards: max - logsumexp, gradient -p. The row's argmax
    # as the target gives that value and onehot(argmax) - p; the owner of the argmax takes the
    # onehot term back out (a zero-valued term whose gradient is -onehot).
    top = _row_argmax(logits, rank, group)
    stats = vocab_parallel_stats(logits, torch.where(outside, top, labels),
                                 **options.op_kwargs(tp_group=group))
    local = top - rank * width
    mine = outside & (local >= 0) & (local < width)
    picked = logits.gather(-1, local.clamp(0, max(width - 1, 0)).unsqueeze(-1)).squeeze(-1)
    picked = picked.float() / temperature
    logprobs = stats.logprobs - torch.where(mine, picked - picked.detach(), 0.0)
    return logprobs, stats.entropy


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    tp_group: dist.ProcessGroup | None = None,
                    chunk_size: int = 1024) -> torch.Tensor:
    """AReaL's ``gather_logprobs`` on :func:`~megatron_vocabstats.vocab_parallel_stats`: fp32
    ``log p(labels)`` in nats, differentiable, from this rank's shard ``logits [..., W]`` (dim 0
    not empty) and integer global ids ``labels`` shaped ``logits.shape[:-1]``; an id outside
    ``[0, W tp)`` gives ``max - logsumexp`` (AReaL's rule, here at tp = 1 too). ``chunk_size``:
    a positive int, not used. Raises ``ValueError`` naming the argument."""
    return _stats("gather_logprobs", logits, labels, temperature, tp_group, chunk_size,
                  "off")[0]


def gather_logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                            tp_group: dist.ProcessGroup | None = None,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's ``gather_logprobs_entropy``: :func:`gather_logprobs` and the entropy
    ``-sum p log p`` (nats) of the tempered logits, both fp32, differentiable."""
    return _stats("gather_logprobs_entropy", logits, labels, temperature, tp_group, chunk_size,
                  "grad")
