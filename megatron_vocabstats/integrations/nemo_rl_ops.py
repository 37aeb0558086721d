"""NeMo-RL's vocab-parallel log-prob, entropy and top-k functions on the ops, as read at
NVIDIA-NeMo/RL ``7ea279a`` (``nemo_rl/distributed/model_utils.py``); top-k/top-p sampling,
DTensor and single-device logits go to NeMo-RL's own function. Differences (:data:`NOTES`):
docs/integrations.md, "NeMo-RL".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from ..ops import (
    linear_vocab_parallel_stats,
    vocab_parallel_gather_logits,
    vocab_parallel_stats,
    vocab_parallel_topk_logits,
    vocab_parallel_topk_logprobs,
)
from ..packing import gather_from_context_parallel, shard_for_context_parallel
from ._options import IntegrationOptions

_OUTSIDE = ("an id outside [0, W*tp) gives 0 as in NeMo-RL, but no gradient (NeMo-RL's backward "
            "still passes -p*g to that row)")
NOTES = {
    "from_parallel_logits_to_logprobs": (
        "runs on vocab_parallel_stats: no fp32 copy or softmax of the logits is kept for "
        "backward; chunk_size is not used (the op chunks itself, the values do not depend on "
        "it); " + _OUTSIDE + "; top-k/top-p sampling_params go to NeMo-RL's own function"),
    "from_parallel_logits_to_logprobs_packed_sequences": (
        "runs on vocab_parallel_stats, with the per-sequence roll, cp split and unpacking "
        "vectorised (no Python loop, no .item()); " + _OUTSIDE),
    "get_next_token_logprobs_from_logits": (
        "vocab-parallel logits are not upcast to fp32 first; DTensor and single-device logits "
        "and top-k/top-p sampling go to NeMo-RL's own function"),
    "get_distillation_topk_logprobs_from_logits": (
        "the student's logits are not upcast to fp32 (NeMo-RL #3495): the k columns are picked "
        "in their dtype; H_all (sum p log p) from vocab_parallel_stats; an out-of-range id "
        "gives 0 without gradient; DTensor and single-device logits go to NeMo-RL's own "
        "function"),
    "distributed_vocab_topk": (
        "runs on vocab_parallel_topk_logits: no fp32 copy of the logits; tied logits come "
        "lowest id first (NeMo-RL: torch.topk's order)"),
    "from_parallel_hidden_states_to_logprobs": (
        "runs on the fused head linear_vocab_parallel_stats (sequence-parallel shard in, its "
        "reduce-scattered dX out, as NeMo-RL's): the [s, b, W] fp32 logits never exist whole; "
        "chunk_size is not used (lm_head_chunk_size is); " + _OUTSIDE),
}
IGNORE = -100  # the ops' ignore_index: logprob 0, zero gradient

OPTIONS = IntegrationOptions("NeMo-RL", NOTES, padding="NeMo-RL normalises over all W*tp columns")
_fallbacks: dict[str, Callable] = {}


def set_fallbacks(originals: dict[str, Callable]) -> None:
    """NeMo-RL's own functions by name, for the cases left to them."""
    _fallbacks.clear()
    _fallbacks.update(originals)


def _fallback(name: str) -> Callable:
    if name not in _fallbacks:
        raise RuntimeError(f"megatron-vocabstats (NeMo-RL): {name}: this case is NeMo-RL's own "
                           "and the integration is not applied (apply() hands it over)")
    return _fallbacks[name]


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _sampling(params) -> bool:
    """NeMo-RL's ``need_top_k_or_top_p_filtering``: top_k > 0 or top_p not 1."""
    if params is None:
        return False
    top_k, top_p = getattr(params, "top_k", None), getattr(params, "top_p", None)
    return (top_k is not None and top_k > 0) or (top_p is not None and top_p != 1.0)


def _check_range(width: int, vocab_start_index, vocab_end_index, tp_group) -> None:
    """``ValueError`` unless the range is ``rank * W`` to ``(rank + 1) * W`` (NeMo-RL's)."""
    start = (0 if tp_group is None else dist.get_rank(tp_group)) * width
    if (int(vocab_start_index), int(vocab_end_index)) != (start, start + width):
        raise ValueError(
            f"vocab_start_index={vocab_start_index}, vocab_end_index={vocab_end_index}: the "
            f"range must be this rank's {width} columns, {start} to {start + width} (NeMo-RL's "
            "rank * W to (rank + 1) * W)")


def _inside(ids: torch.Tensor, total: int) -> torch.Tensor:
    return (ids >= 0) & (ids < total)


class _SumGradOverCP(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over cp, as NeMo-RL's
    ``AllGatherCPTensor`` does before slicing out this rank's chunks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _cp_gather(x, cp_group, *, cu_seqlens_padded=None, dim=1):
    """NeMo-RL's ``allgather_cp_sharded_tensor``: its layout, the gradient summed over cp."""
    full = gather_from_context_parallel(x, cp_group, cu_seqlens_padded=cu_seqlens_padded,
                                        dim=dim)
    return _SumGradOverCP.apply(full, cp_group) if torch.is_grad_enabled() else full


def _no_grad_if(inference_only: bool):
    return torch.no_grad() if inference_only else contextlib.nullcontext()


def _logprobs(logits, target, tp_group, inference_only):
    """fp32 log-probs of global ids ``target [B, S]``; ids outside the W·tp columns give 0."""
    total = logits.shape[-1] * _size(tp_group)
    target = torch.where(_inside(target, total), target, IGNORE)
    options = replace(OPTIONS.settings.stats_options(), entropy="off")
    with _no_grad_if(inference_only):
        return vocab_parallel_stats(logits, target,
                                    **options.op_kwargs(tp_group=tp_group)).logprobs


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index,
                                     vocab_end_index, tp_group, inference_only=False,
                                     cp_group=None, chunk_size=None, sampling_params=None):
    """NeMo-RL's ``from_parallel_logits_to_logprobs``: fp32 ``log p(target[:, t+1])``
    ``[B, S-1]`` from this rank's logits ``[B, S/cp, W]``, ``target [B, S]`` unshifted; ids
    outside ``[0, W·tp)`` give 0. Raises ``ValueError`` naming the argument."""
    if _sampling(sampling_params):
        return _fallback("from_parallel_logits_to_logprobs")(
            vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
            inference_only, cp_group, chunk_size, sampling_params)
    OPTIONS.note_once("from_parallel_logits_to_logprobs")
    _check_range(vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, tp_group)
    cp = _size(cp_group)
    target = target.roll(shifts=-1, dims=-1)
    pad = vocab_parallel_logits.shape[1] * cp - target.shape[1]
    if pad > 0:
        target = torch.nn.functional.pad(target, (0, pad), value=0)
    if cp > 1:
        target = shard_for_context_parallel(target, cp_group, dim=1)
    logprobs = _logprobs(vocab_parallel_logits, target, tp_group, inference_only)
    if cp > 1:
        logprobs = _cp_gather(logprobs, cp_group, dim=1)
    if pad > 0:
        logprobs = logprobs[:, :-pad]
    return logprobs[:, :-1]


def get_next_token_logprobs_from_logits(input_ids, next_token_logits, seq_index=None,
                                        vocab_parallel_rank=None, vocab_parallel_group=None,
                                        context_parallel_group=None, sampling_params=None,
                                        chunk_size=None):
    """NeMo-RL's ``get_next_token_logprobs_from_logits``: with ``vocab_parallel_group``,
    :func:`from_parallel_logits_to_logprobs` (logits not upcast); otherwise NeMo-RL's own."""
    if vocab_parallel_group is None or _sampling(sampling_params):
        return _fallback("get_next_token_logprobs_from_logits")(
            input_ids, next_token_logits, seq_index, vocab_parallel_rank, vocab_parallel_group,
            context_parallel_group, sampling_params, chunk_size)
    if vocab_parallel_rank is None:
        raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
    OPTIONS.note_once("get_next_token_logprobs_from_logits")
    width = next_token_logits.shape[-1]
    logprobs = from_parallel_logits_to_logprobs(
        next_token_logits, input_ids, vocab_parallel_rank * width,
        (vocab_parallel_rank + 1) * width, vocab_parallel_group, inference_only=False,
        cp_group=context_parallel_group)
    return logprobs[:, : input_ids.shape[1] - 1]


def _roll_within(target: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Each packed sequence of ``target [T]`` rolled left by one; 0 after ``cu[-1]``."""
    pos = torch.arange(target.shape[0], device=target.device)
    seq = torch.searchsorted(cu[1:], pos, right=True).clamp(max=cu.shape[0] - 2)
    nxt = pos + 1
    src = torch.where(nxt < cu[seq + 1], nxt, cu[seq]).clamp(max=max(target.shape[0] - 1, 0))
    return torch.where(pos < cu[-1], target[src], torch.zeros_like(target))


def _unpack(values: torch.Tensor, cu: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, length-1]``: row ``i`` holds ``values[cu[i] : cu[i+1]-1]``, zeros after it."""
    cols = torch.arange(max(length - 1, 0), device=values.device)
    index = cu[:-1, None] + cols
    keep = cols < (cu[1:] - cu[:-1] - 1)[:, None]
    if values.numel() == 0:
        return values.new_zeros(keep.shape)
    picked = values[index.clamp(max=values.shape[0] - 1)]
    return torch.where(keep, picked, torch.zeros_like(picked))


def from_parallel_logits_to_logprobs_packed_sequences(
        vocab_parallel_logits, target, cu_seqlens_padded, unpacked_seqlen, vocab_start_index,
        vocab_end_index, group, inference_only=False, cp_group=None, chunk_size=None,
        sampling_params=None, target_is_pre_rolled=False):
    """NeMo-RL's ``from_parallel_logits_to_logprobs_packed_sequences``: fp32 ``[B,
    unpacked_seqlen-1]`` from packed logits ``[1, T/cp, W]`` and ``target [1, T]`` unshifted
    (``target_is_pre_rolled``: ``[1, T/cp]``, rolled and split). Positions past a sequence: 0."""
    if _sampling(sampling_params):
        return _fallback("from_parallel_logits_to_logprobs_packed_sequences")(
            vocab_parallel_logits, target, cu_seqlens_padded, unpacked_seqlen,
            vocab_start_index, vocab_end_index, group, inference_only, cp_group, chunk_size,
            sampling_params, target_is_pre_rolled)
    OPTIONS.note_once("from_parallel_logits_to_logprobs_packed_sequences")
    _check_range(vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, group)
    cu = cu_seqlens_padded.to(device=vocab_parallel_logits.device, dtype=torch.int64)
    if not target_is_pre_rolled:
        target = _roll_within(target.reshape(-1), cu.to(target.device))[None]
        if _size(cp_group) > 1:
            target = shard_for_context_parallel(target, cp_group, cu_seqlens_padded=cu, dim=1)
    logprobs = _logprobs(vocab_parallel_logits, target, group, inference_only).squeeze(0)
    if logprobs.dim() != 1:
        raise ValueError(f"vocab_parallel_logits: expected one packed row [1, T, W], got "
                         f"{tuple(vocab_parallel_logits.shape)}")
    if _size(cp_group) > 1:
        logprobs = _cp_gather(logprobs, cp_group, cu_seqlens_padded=cu, dim=0)
    return _unpack(logprobs, cu, int(unpacked_seqlen))


def _topk_options() -> dict:
    settings = OPTIONS.settings
    return dict(vocab_size=settings.vocab_size, chunk_size=settings.logprobs_chunk_size,
                validate=settings.validate)


def _cp_split(ids, logits, cp_group):
    """``(this cp rank's chunks of the padded ids [B, S, k], pad)``, as NeMo-RL splits them."""
    if _size(cp_group) == 1:
        return ids, 0
    pad = logits.shape[1] * _size(cp_group) - ids.shape[1]
    if pad > 0:
        ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=0)
    return shard_for_context_parallel(ids, cp_group, dim=1), max(pad, 0)


def _cp_join(x, cp_group, pad):
    if x is None or _size(cp_group) == 1:
        return x
    x = _cp_gather(x, cp_group, dim=1)
    return x[:, : x.shape[1] - pad]


def get_distillation_topk_logprobs_from_logits(student_logits, teacher_topk_logits,
                                               teacher_topk_indices, zero_outside_topk,
                                               calculate_entropy, vocab_parallel_rank=None,
                                               vocab_parallel_group=None,
                                               context_parallel_group=None):
    """NeMo-RL's ``get_distillation_topk_logprobs_from_logits`` for student logits
    ``[B, S/cp, W]`` and the teacher's ``[B, S, k]`` logits and ids: fp32 ``(student [B, S-1, k],
    teacher [B, S-1, k], H_all = sum p log p [B, S-1] or None)``. ``zero_outside_topk``: the
    student's log-probs over the full vocabulary, else over the k gathered logits. Without
    ``vocab_parallel_group``: NeMo-RL's own function."""
    if vocab_parallel_group is None:
        return _fallback("get_distillation_topk_logprobs_from_logits")(
            student_logits, teacher_topk_logits, teacher_topk_indices, zero_outside_topk,
            calculate_entropy, vocab_parallel_rank, vocab_parallel_group,
            context_parallel_group)
    if teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(f"teacher_topk_indices: topk must be positive, got "
                         f"{teacher_topk_indices.shape[-1]}")
    if vocab_parallel_rank is None:
        raise ValueError("vocab_parallel_rank must be given with vocab_parallel_group")
    if calculate_entropy and not zero_outside_topk:
        raise ValueError("calculate_entropy needs zero_outside_topk (NeMo-RL has no H_all "
                         "without it)")
    OPTIONS.note_once("get_distillation_topk_logprobs_from_logits")
    width = student_logits.shape[-1]
    _check_range(width, vocab_parallel_rank * width, (vocab_parallel_rank + 1) * width,
                 vocab_parallel_group)
    total = width * _size(vocab_parallel_group)
    ids, pad = _cp_split(teacher_topk_indices.to(student_logits.device), student_logits,
                         context_parallel_group)
    inside = _inside(ids, total)
    ids = torch.where(inside, ids, 0)
    kwargs = dict(tp_group=vocab_parallel_group, **_topk_options())
    h_all = None
    if zero_outside_topk:
        student = vocab_parallel_topk_logprobs(student_logits, ids, **kwargs)
        if calculate_entropy:
            options = replace(OPTIONS.settings.stats_options(), entropy="grad")
            h_all = -vocab_parallel_stats(student_logits, None, **options.op_kwargs(
                tp_group=vocab_parallel_group)).entropy
    else:
        student = vocab_parallel_gather_logits(student_logits, ids, **kwargs)
    student = torch.where(inside, student, torch.zeros_like(student))
    student = _cp_join(student, context_parallel_group, pad)
    h_all = _cp_join(h_all, context_parallel_group, pad)
    if not zero_outside_topk:
        student = torch.log_softmax(student, dim=-1)
    teacher = torch.log_softmax(teacher_topk_logits.to(student.device, student.dtype), dim=-1)
    return (student[:, :-1], teacher[:, :-1], None if h_all is None else h_all[:, :-1])


@torch.no_grad()
def distributed_vocab_topk(vocab_parallel_logits, k, tp_group, *, vocab_start_index,
                           vocab_end_index, chunk_size=None):
    """NeMo-RL's ``distributed_vocab_topk``: the global top-``min(k, W·tp)`` of this rank's
    logits ``[B, S, W]``, ``(fp32 values [B, S, k], int64 global ids [B, S, k])``."""
    OPTIONS.note_once("distributed_vocab_topk")
    width = vocab_parallel_logits.shape[-1]
    _check_range(width, vocab_start_index, vocab_end_index, tp_group)
    k = int(min(k, max(1, width * _size(tp_group))))
    top = vocab_parallel_topk_logits(vocab_parallel_logits, k, tp_group=tp_group,
                                     **_topk_options())
    return top.logits, top.indices


def from_parallel_hidden_states_to_logprobs(tensor_parallel_hidden_states, output_weight_layer,
                                            runtime_gather_output, target, vocab_start_index,
                                            vocab_end_index, tp_group, inference_only=False,
                                            cp_group=None, chunk_size=None):
    """NeMo-RL's ``from_parallel_hidden_states_to_logprobs`` on the fused head: fp32 ``[b, s-1]``
    log-probs of ``target [b, s]`` rolled left by one, from this rank's hidden states
    ``[s/tp, b, H]`` and weight shard ``[W, H]``. ``ValueError`` for ``cp_group`` > 1 rank."""
    if _size(cp_group) > 1:
        raise ValueError("cp_group: context parallelism is not supported with the fused "
                         "log-probs from hidden states (NeMo-RL: the same)")
    OPTIONS.note_once("from_parallel_hidden_states_to_logprobs")
    _check_range(output_weight_layer.shape[0], vocab_start_index, vocab_end_index, tp_group)
    tp = _size(tp_group)
    target = target.roll(shifts=-1, dims=-1)
    target = torch.where(_inside(target, output_weight_layer.shape[0] * tp), target, IGNORE)
    settings = OPTIONS.settings
    options = replace(settings.stats_options(fused=True), entropy="off",
                      chunk_size=settings.lm_head_chunk_size or None)
    with _no_grad_if(inference_only):
        stats = linear_vocab_parallel_stats(
            tensor_parallel_hidden_states, output_weight_layer, target.transpose(0, 1),
            sequence_parallel=tp > 1, **options.op_kwargs(tp_group=tp_group))
    return stats.logprobs.transpose(0, 1)[:, :-1]
