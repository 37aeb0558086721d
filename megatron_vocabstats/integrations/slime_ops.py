"""slime's ``calculate_log_probs_and_entropy`` on the ops, with slime's conventions as read at
THUDM/slime ``624b824`` (``slime/utils/ppo_utils.py``). Differences (:data:`NOTES`):
docs/integrations.md, "slime".
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..ops import vocab_parallel_stats
from ._options import IntegrationOptions

NAME = "calculate_log_probs_and_entropy"
NOTES = {
    NAME: (
        "runs on vocab_parallel_stats. Differences: no fp32 softmax of the shard is kept for "
        "backward (slime keeps [T, W], and its logits too when the entropy has a gradient); its "
        "chunk_size is not used (the op chunks by logprobs_chunk_size, auto by default; the "
        "values do not depend on it); with log_prob_keep_mask the masked copy of the logits is "
        "still made, as slime makes it; one host read per call of whether an id lies outside "
        "the shards"),
}
OPTIONS = IntegrationOptions("slime", NOTES, padding="slime normalises over all W*tp columns; an "
                           "id >= vocab_size is then outside the vocabulary")


def _group(tp_group):
    """slime's rule: a None group is the default one once torch.distributed is initialised."""
    if tp_group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return tp_group


def _check(logits, tokens, keep):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits: expected one packed row [T, W] of this rank's shard, got "
                         f"{type(logits).__name__}{tuple(getattr(logits, 'shape', ()))}")
    if (not isinstance(tokens, torch.Tensor) or tokens.shape != logits.shape[:1]
            or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool):
        raise ValueError(f"tokens: expected integer ids [{logits.shape[0]}], got "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)}"
                         f"{tuple(getattr(tokens, 'shape', ()))}")
    if keep is not None and (not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool
                             or keep.shape != logits.shape):
        raise ValueError(f"log_prob_keep_mask: expected a bool mask shaped like logits "
                         f"{tuple(logits.shape)}, got {getattr(keep, 'dtype', type(keep))}"
                         f"{tuple(getattr(keep, 'shape', ()))}")


def _peak(z, start, limit, group):
    """Per row: the global argmax below ``limit`` (lowest id on ties), and whether it is here."""
    real = max(0, min(z.shape[1], limit - start))
    values, index = z.detach()[:, :real].max(-1) if real else (
        z.new_full(z.shape[:1], float("-inf")), z.new_zeros(z.shape[:1], dtype=torch.long))
    ids = index + start
    if group is not None and dist.get_world_size(group) > 1:
        top = values.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        ids = torch.where(values == top, ids, torch.iinfo(torch.long).max)
        dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
    return ids, (ids >= start) & (ids < start + real)


def _outside(z, tokens, start, limit, group):
    """slime's rule for ids outside ``[0, limit)``, ``max z - logZ`` with gradient ``-p``: the
    targets (such ids as the row's argmax) and a zero correction cancelling the argmax's one-hot
    gradient (None when every id is inside)."""
    outside = (tokens < 0) | (tokens >= limit)
    count = outside.sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # every rank decides alike
    if not bool(count):  # the one host read
        return tokens, None
    ids, here = _peak(z, start, limit, group)
    picked = z.gather(1, torch.where(here, ids - start, 0).unsqueeze(1)).squeeze(1).float()
    take = outside & here
    picked = torch.where(take, picked, 0.0)
    return torch.where(outside, ids, tokens), picked.detach() - picked


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy: bool = False,
                                    chunk_size: int = -1, log_prob_keep_mask=None,
                                    with_entropy_grad: bool = True):
    """slime's ``calculate_log_probs_and_entropy`` on ``vocab_parallel_stats``: ``(log_prob
    [T, 1] fp32, entropy [T] fp32 or None)`` from this rank's shard ``logits [T, W]`` of one
    packed row and integer global ids ``tokens [T]`` (already shifted); ``chunk_size`` is not
    used; ``log_prob_keep_mask``: None or bool ``[T, W]``, the columns the log-prob (not the
    entropy) is normalised over. Raises ``ValueError`` naming the argument."""
    del chunk_size
    OPTIONS.note_once(NAME)
    _check(logits, tokens, log_prob_keep_mask)
    if logits.shape[0] == 0:
        return logits.new_zeros((0,)), logits.new_zeros((0,)) if with_entropy else None
    group = _group(tp_group)
    rank, tp = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    width = logits.shape[1]
    start, limit = rank * width, OPTIONS.settings.vocab_size or width * tp
    mode = ("grad" if with_entropy_grad else "metric") if with_entropy else "off"
    options = replace(OPTIONS.settings.stats_options(), entropy=mode)
    kwargs = options.op_kwargs(tp_group=group)
    tokens = tokens.long()
    z = logits
    if log_prob_keep_mask is not None:
        local = tokens - start
        inside = (local >= 0) & (local < width)
        column = torch.where(inside, local, 0).unsqueeze(1)
        keep = log_prob_keep_mask.scatter(
            1, column, log_prob_keep_mask.gather(1, column) | inside.unsqueeze(1))
        z = logits.masked_fill(~keep, float("-inf"))
    target, correction = _outside(z, tokens, start, limit, group)
    if log_prob_keep_mask is None:
        stats = vocab_parallel_stats(logits, target, **kwargs)
        log_prob, entropy = stats.logprobs, stats.entropy
    else:
        log_prob = vocab_parallel_stats(z, target, **{**kwargs, "entropy": "off"}).logprobs
        entropy = (vocab_parallel_stats(logits, None, **kwargs).entropy if with_entropy
                   else None)
    if correction is not None:
        log_prob = log_prob + correction
    return log_prob.unsqueeze(-1), entropy
