"""Test support: a stand-in for slime (which ships no installable package), written for these
tests from the signature and conventions read at THUDM/slime ``624b824``; no slime code.

:func:`install` puts modules named as slime's into ``sys.modules``: ``slime`` (``__version__``),
``slime.utils.ppo_utils.calculate_log_probs_and_entropy`` (same parameters and conventions:
fp32 upcast, normalised over the W·tp columns, an id outside every shard giving ``max - logZ``
with gradient ``-p``, the keep mask applied to the log-prob only with the target's column kept,
entropy from ``sum p z`` (NaN beside a ``-inf`` logit, as slime's), no entropy gradient unless
``with_entropy_grad``, ``[T, 1]`` log-probs, ``[0]`` tensors in the logits' dtype for an empty
row, a None group meaning the default one), and ``slime.backends.megatron_utils.loss``, which
binds that name and calls it from a reduced ``get_log_probs_and_entropy`` (cp 1: temperature
division, the targets shifted inside each sequence, the response slices). Plain autograd: it
keeps the fp32 softmax, as slime's does.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

from _standin_comm import summed

VERSION = "0.3.1"
TP_GROUP: list = [None]  # what the loss stand-in's mpu.get_tensor_model_parallel_group returns


def _group(group):
    if group is None and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return group


def _place(group):
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def _normaliser(z, group):
    """``(max [T, 1] detached, S [T, 1])`` over the shards: ``logZ = max + log S``."""
    peak = z.detach().amax(-1, keepdim=True)
    if _place(group)[1] > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak, summed((z - peak).exp().sum(-1, keepdim=True), group)


def _one(z, tokens, group, with_entropy, keep, entropy_grad):
    rank, size = _place(group)
    width = z.shape[-1]
    local = tokens - rank * width
    inside = (local >= 0) & (local < width)
    column = torch.where(inside, local, 0).unsqueeze(-1)
    entropy = None
    if with_entropy:
        peak, total = _normaliser(z, group)
        mean = summed(((z - peak).exp() * z).sum(-1, keepdim=True), group) / total
        entropy = (peak + total.log() - mean).squeeze(-1)
        entropy = entropy if entropy_grad else entropy.detach()
    if keep is not None:
        keep = keep.scatter(1, column, keep.gather(1, column) | inside.unsqueeze(-1))
        z = z.masked_fill(~keep, float("-inf"))
    peak, total = _normaliser(z, group)
    picked = torch.where(inside.unsqueeze(-1), z.gather(1, column) - peak, 0.0)
    return summed(picked, group) - total.log(), entropy


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy: bool = False,
                                    chunk_size: int = -1, log_prob_keep_mask=None,
                                    with_entropy_grad: bool = True):
    if logits.size(0) == 0:
        return logits.new_zeros((0,)), logits.new_zeros((0,)) if with_entropy else None
    group, z = _group(tp_group), logits.float()
    pieces = max(1, -(-logits.size(0) // chunk_size)) if chunk_size > 0 else 1
    masks = (log_prob_keep_mask.chunk(pieces) if log_prob_keep_mask is not None
             else [None] * pieces)
    outs = [_one(a, b, group, with_entropy, m, with_entropy and with_entropy_grad)
            for a, b, m in zip(z.chunk(pieces), tokens.chunk(pieces), masks)]
    log_prob = torch.cat([o[0] for o in outs])
    return log_prob, torch.cat([o[1] for o in outs]) if with_entropy else None


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False):
    """The loss's caller, reduced to cp 1: ``[1, T, W]`` fp32 logits divided by the rollout
    temperature, each sequence's targets its next tokens (0 at its last position), the
    response positions of each sequence returned."""
    assert logits.dtype == torch.float32 and logits.dim() == 3 and logits.size(0) == 1
    logits = logits.squeeze(0)
    if args.rollout_temperature != 1.0:
        logits = logits / args.rollout_temperature
    targets = torch.zeros(logits.size(0), dtype=torch.long)
    offset = 0
    for tokens, length in zip(unconcat_tokens, total_lengths):
        targets[offset:offset + length - 1] = tokens[1:length]
        offset += length
    module = sys.modules["slime.backends.megatron_utils.loss"]
    log_prob, entropy = module.calculate_log_probs_and_entropy(
        logits, targets, module.mpu.get_tensor_model_parallel_group(), with_entropy=with_entropy,
        with_entropy_grad=with_entropy and args.entropy_coef != 0,
        chunk_size=args.log_probs_chunk_size)
    log_prob = log_prob.squeeze(-1)
    res = {"log_probs": [], "entropy": []}
    offset = 0
    for length, response in zip(total_lengths, response_lengths):
        end = offset + length
        res["log_probs"].append(log_prob[end - response - 1:end - 1])
        if with_entropy:
            res["entropy"].append(entropy[end - response - 1:end - 1])
        offset = end
    return res


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install() -> dict[str, types.ModuleType]:
    """Put the stand-in's modules into ``sys.modules``; returns them by name."""
    ppo = _module("slime.utils.ppo_utils",
                  calculate_log_probs_and_entropy=calculate_log_probs_and_entropy)
    mpu = types.SimpleNamespace(get_tensor_model_parallel_group=lambda: TP_GROUP[0])
    loss = _module("slime.backends.megatron_utils.loss", mpu=mpu,
                   calculate_log_probs_and_entropy=calculate_log_probs_and_entropy,
                   get_log_probs_and_entropy=get_log_probs_and_entropy)
    modules = {"slime": _module("slime", __version__=VERSION, __path__=[]),
               "slime.utils": _module("slime.utils", __path__=[]),
               "slime.utils.ppo_utils": ppo,
               "slime.backends": _module("slime.backends", __path__=[]),
               "slime.backends.megatron_utils": _module("slime.backends.megatron_utils",
                                                        __path__=[]),
               "slime.backends.megatron_utils.loss": loss}
    sys.modules.update(modules)
    return modules


def uninstall() -> None:
    """Take the stand-in's modules out of ``sys.modules``."""
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]
