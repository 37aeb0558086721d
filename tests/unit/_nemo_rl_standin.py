"""Test support: a stand-in for NeMo-RL (which ships no installable package), written for these
tests from the signatures and conventions read at NVIDIA-NeMo/RL ``7ea279a``; no NeMo-RL code.

:func:`install` puts modules named as NeMo-RL's into ``sys.modules``:
``nemo_rl`` (``__version__``), ``nemo_rl.distributed.model_utils`` (the six functions the
integration replaces, same parameter names, same conventions: the unshifted ids rolled left by
one and the last position dropped, fp32 upcast, the padded W·tp columns, ids outside the shards
giving 0, NeMo-RL's load-balanced cp split with the gathered result's gradient all-reduced over
cp, ``H_all = sum p log p``, the hidden-state path all-gathering the sequence-parallel shard and
reduce-scattering its gradient), and ``nemo_rl.algorithms.loss.utils`` /
``nemo_rl.models.megatron.train`` binding those names as NeMo-RL's do. Plain autograd, float32
throughout: slow and memory-hungry like the original, which is the point of the comparison.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

from _standin_comm import summed

VERSION = "0.6.0"
LOSS_NAMES = ("_get_tokens_on_this_cp_rank", "from_parallel_logits_to_logprobs_packed_sequences",
              "get_distillation_topk_logprobs_from_logits", "get_next_token_logprobs_from_logits")
TRAIN_NAMES = ("distributed_vocab_topk", "from_parallel_logits_to_logprobs",
               "from_parallel_logits_to_logprobs_packed_sequences")


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def _normaliser(z, group):
    """``(logZ [..., 1], U/S [..., 1])`` of the shards ``z [..., W]`` (fp32) over the W·tp
    columns: the log-partition function and the expected logit, differentiable; built only from
    sums over the group, so that every rank's graph carries the whole gradient."""
    peak = z.detach().amax(-1, keepdim=True)
    if _size(group) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    e = (z - peak).exp()
    total = summed(e.sum(-1, keepdim=True), group)
    mean = summed((e * z).sum(-1, keepdim=True), group) / total
    return peak + total.log(), mean


def _pick(values, ids, start, group):
    """``values[..., id - start]`` summed over the shards (0 where no shard holds the id)."""
    width = values.shape[-1]
    inside = (ids >= start) & (ids < start + width)
    local = torch.where(inside, ids - start, 0)
    picked = values.gather(-1, local.unsqueeze(-1) if ids.dim() < values.dim() else local)
    picked = picked.squeeze(-1) if ids.dim() < values.dim() else picked
    return summed(picked * inside, group)


def _logprob(z, ids, start, group):
    """``z_id - logZ``; an id outside every shard gives 0 whose gradient is still ``-p g``, as
    NeMo-RL's backward gives it."""
    out = _pick(z, ids, start, group) - _normaliser(z, group)[0][..., 0]
    outside = (ids < 0) | (ids >= z.shape[-1] * _size(group))
    return out - out.detach() * outside


def cp_split(x, cp, rank, dim):
    """NeMo-RL's load-balanced split: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    if cp == 1:
        return x
    parts = x.chunk(2 * cp, dim=dim)
    return torch.cat([parts[rank], parts[2 * cp - 1 - rank]], dim=dim)


class _CPGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        cp = _size(group)
        pieces = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        order = [None] * (2 * cp)
        for r, piece in enumerate(pieces):
            order[r], order[2 * cp - 1 - r] = piece.chunk(2, dim=dim)
        return torch.cat(order, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # NeMo-RL sums the gradient over cp
        return cp_split(grad, _size(ctx.group), dist.get_rank(ctx.group), ctx.dim), None, None


def _next_ids(target, width, cp_group):
    cp = _size(cp_group)
    target = target.roll(-1, -1)
    pad = width * cp - target.shape[1]
    if pad > 0:
        target = torch.nn.functional.pad(target, (0, pad))
    rank = dist.get_rank(cp_group) if cp > 1 else 0
    return cp_split(target, cp, rank, 1), pad


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index,
                                     vocab_end_index, tp_group, inference_only=False,
                                     cp_group=None, chunk_size=None, sampling_params=None):
    if sampling_params is not None and (sampling_params.top_k or 0) > 0:
        raise NotImplementedError("the stand-in has no sampling path")
    ids, pad = _next_ids(target, vocab_parallel_logits.shape[1], cp_group)
    z = vocab_parallel_logits.float()
    out = _logprob(z, ids, vocab_start_index, tp_group)
    if _size(cp_group) > 1:
        out = _CPGather.apply(out, cp_group, 1)
    if pad > 0:
        out = out[:, :-pad]
    return out[:, :-1]


def from_parallel_logits_to_logprobs_packed_sequences(
        vocab_parallel_logits, target, cu_seqlens_padded, unpacked_seqlen, vocab_start_index,
        vocab_end_index, group, inference_only=False, cp_group=None, chunk_size=None,
        sampling_params=None, target_is_pre_rolled=False):
    cp = _size(cp_group)
    rank = dist.get_rank(cp_group) if cp > 1 else 0
    bounds = [int(b) for b in cu_seqlens_padded]
    if not target_is_pre_rolled:
        flat = target.reshape(-1)
        rolled = torch.zeros_like(flat[: flat.numel() // cp])
        for a, b in zip(bounds[:-1], bounds[1:]):
            rolled[a // cp: b // cp] = cp_split(flat[a:b].roll(-1, 0), cp, rank, 0)
        target = rolled[None]
    z = vocab_parallel_logits.float()
    values = _logprob(z, target, vocab_start_index, group)[0]
    if cp > 1:
        values = torch.cat([_CPGather.apply(values[a // cp: b // cp], cp_group, 0)
                            for a, b in zip(bounds[:-1], bounds[1:])]
                           + [values.new_zeros(values.shape[0] * cp - bounds[-1])])
    rows = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        row = values[a: max(b - 1, a)][: unpacked_seqlen - 1]
        rows.append(torch.nn.functional.pad(row, (0, unpacked_seqlen - 1 - row.shape[0])))
    return torch.stack(rows)


def get_next_token_logprobs_from_logits(input_ids, next_token_logits, seq_index=None,
                                        vocab_parallel_rank=None, vocab_parallel_group=None,
                                        context_parallel_group=None, sampling_params=None,
                                        chunk_size=None):
    logits = next_token_logits.float()
    if vocab_parallel_group is None:
        return torch.log_softmax(logits[:, :-1], -1).gather(
            -1, input_ids[:, 1:, None]).squeeze(-1)
    width = logits.shape[-1]
    out = sys.modules["nemo_rl.distributed.model_utils"].from_parallel_logits_to_logprobs(
        logits, input_ids, vocab_parallel_rank * width, (vocab_parallel_rank + 1) * width,
        vocab_parallel_group, cp_group=context_parallel_group)
    return out[:, : input_ids.shape[1] - 1]


def get_distillation_topk_logprobs_from_logits(student_logits, teacher_topk_logits,
                                               teacher_topk_indices, zero_outside_topk,
                                               calculate_entropy, vocab_parallel_rank=None,
                                               vocab_parallel_group=None,
                                               context_parallel_group=None):
    z, group, cp = student_logits.float(), vocab_parallel_group, _size(context_parallel_group)
    ids = teacher_topk_indices
    start = 0 if group is None else vocab_parallel_rank * z.shape[-1]
    pad = max(z.shape[1] * cp - ids.shape[1], 0)
    if cp > 1:
        ids = cp_split(torch.nn.functional.pad(ids, (0, 0, 0, pad)), cp,
                       dist.get_rank(context_parallel_group), 1)
    h_all = None
    if zero_outside_topk:
        log_z, mean = _normaliser(z, group)
        student = _pick(z, ids, start, group) - log_z
        if calculate_entropy:
            h_all = (mean - log_z)[..., 0]  # sum p log p
    else:
        student = _pick(z, ids, start, group)
    if cp > 1:
        keep = student.shape[1] * cp - pad
        student = _CPGather.apply(student, context_parallel_group, 1)[:, :keep]
        if h_all is not None:
            h_all = _CPGather.apply(h_all, context_parallel_group, 1)[:, :keep]
    if not zero_outside_topk:
        student = torch.log_softmax(student, -1)
    teacher = torch.log_softmax(teacher_topk_logits.float(), -1)
    return student[:, :-1], teacher[:, :-1], None if h_all is None else h_all[:, :-1]


@torch.no_grad()
def distributed_vocab_topk(vocab_parallel_logits, k, tp_group, *, vocab_start_index,
                           vocab_end_index, chunk_size=None):
    z = vocab_parallel_logits.float()
    vals, ids = z.topk(min(k, z.shape[-1]), -1)
    ids = ids + vocab_start_index
    if _size(tp_group) > 1:
        vals_all = [torch.empty_like(vals) for _ in range(_size(tp_group))]
        ids_all = [torch.empty_like(ids) for _ in range(_size(tp_group))]
        dist.all_gather(vals_all, vals, group=tp_group)
        dist.all_gather(ids_all, ids, group=tp_group)
        vals, ids = torch.cat(vals_all, -1), torch.cat(ids_all, -1)
    top, where = vals.topk(min(k, vals.shape[-1]), -1)
    return top, ids.gather(-1, where)


class _SPGather(torch.autograd.Function):
    """All-gather of the sequence-parallel shard along dim 0; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(_size(ctx.group))[dist.get_rank(ctx.group)].clone(), None


def from_parallel_hidden_states_to_logprobs(tensor_parallel_hidden_states, output_weight_layer,
                                            runtime_gather_output, target, vocab_start_index,
                                            vocab_end_index, tp_group, inference_only=False,
                                            cp_group=None, chunk_size=None):
    assert _size(cp_group) == 1
    hidden = tensor_parallel_hidden_states
    if _size(tp_group) > 1:
        hidden = _SPGather.apply(hidden, tp_group)
    logits = (hidden @ output_weight_layer.T).float().transpose(0, 1)  # [b, s, W]
    out = _logprob(logits, target.roll(-1, -1), vocab_start_index, tp_group)
    return out[:, :-1]


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def install() -> dict[str, types.ModuleType]:
    """Put the stand-in's modules into ``sys.modules``; returns them by name."""
    mu = _module("nemo_rl.distributed.model_utils", _get_tokens_on_this_cp_rank=cp_split)
    for name in ("from_parallel_logits_to_logprobs",
                 "from_parallel_logits_to_logprobs_packed_sequences",
                 "get_next_token_logprobs_from_logits",
                 "get_distillation_topk_logprobs_from_logits", "distributed_vocab_topk",
                 "from_parallel_hidden_states_to_logprobs"):
        mu.__dict__[name] = globals()[name]  # called through the module, as NeMo-RL's are
    modules = {"nemo_rl": _module("nemo_rl", __version__=VERSION, __path__=[]),
               "nemo_rl.distributed": _module("nemo_rl.distributed", __path__=[]),
               "nemo_rl.distributed.model_utils": mu,
               "nemo_rl.algorithms": _module("nemo_rl.algorithms", __path__=[]),
               "nemo_rl.algorithms.loss": _module("nemo_rl.algorithms.loss", __path__=[]),
               "nemo_rl.models": _module("nemo_rl.models", __path__=[]),
               "nemo_rl.models.megatron": _module("nemo_rl.models.megatron", __path__=[])}
    modules["nemo_rl.algorithms.loss.utils"] = _module(
        "nemo_rl.algorithms.loss.utils", **{n: mu.__dict__[n] for n in LOSS_NAMES})
    modules["nemo_rl.models.megatron.train"] = _module(
        "nemo_rl.models.megatron.train", **{n: mu.__dict__[n] for n in TRAIN_NAMES})
    sys.modules.update(modules)
    return modules


def uninstall() -> None:
    """Take the stand-in's modules out of ``sys.modules``."""
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        del sys.modules[name]
