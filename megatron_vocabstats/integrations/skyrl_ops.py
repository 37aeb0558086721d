"""SkyRL's Megatron log-prob and entropy functions on the ops, as read from the ``skyrl==0.3.0``
wheel (``skyrl/backends/skyrl_train/distributed/megatron/model_utils.py``); its layout helpers
(:data:`HELPERS`) stay SkyRL's code. Differences (:data:`NOTES`): docs/integrations.md, "SkyRL".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from ..mcore import default_tp_group
from ..ops import linear_vocab_parallel_stats, vocab_parallel_stats
from ._options import IntegrationOptions

IGNORE = -100  # the ops' default ignore_index; an id outside the vocabulary becomes it

# SkyRL's own layout code (model_utils' private helpers) and the two packed entropy functions
# kept whole: set by skyrl.apply() before anything is patched.
HELPERS = ("_get_tokens_on_this_cp_rank", "allgather_cp_sharded_tensor",
           "_packed_sequence_indices", "_packed_cp_rank_and_local_indices",
           "allgather_cp_sharded_packed_tensor", "_packed_subseq_row_indices_offsets_and_lens",
           "vocab_parallel_entropy_packed_sequences",
           "from_parallel_hidden_to_entropy_packed_sequences")
_helpers: dict[str, Callable] = {}

_IDS = ("an id outside the vocabulary gives 0 as SkyRL's, with no gradient (SkyRL's passes "
        "-softmax as if the id were in another shard)")
_LOGITS = ("runs on vocab_parallel_stats; SkyRL's target roll, CP split/gather and packing kept. "
           "Differences: " + _IDS + "; chunk_size is not used (the op chunks by "
           "logprobs_chunk_size; values do not depend on it); nothing fp32 of [B, S, W] is "
           "saved or preallocated")
_HIDDEN = ("runs on linear_vocab_parallel_stats (partial d hidden, SkyRL's contract); SkyRL's "
           "target roll, CP split/gather and packing kept. Differences: " + _IDS + "; the "
           "temperature divides the fp32 logits (SkyRL divides a copy of the weight, rounded to "
           "its dtype); fused_backend and chunk_size are not used (lm_head_chunk_size chunks)")
NOTES = {
    "from_parallel_logits_to_logprobs": _LOGITS,
    "from_parallel_logits_to_logprobs_packed_sequences": _LOGITS,
    "from_parallel_hidden_to_logprobs": _HIDDEN,
    "from_parallel_hidden_to_logprobs_packed_sequences": _HIDDEN,
    "vocab_parallel_entropy": (
        "runs on vocab_parallel_stats. Differences: computed from fp32 chunks and rounded once "
        "to the logits' dtype (SkyRL computes in that dtype); a -inf-masked vocabulary gives a "
        "finite entropy (SkyRL's: NaN, 0 * -inf)"),
    "vocab_parallel_entropy_packed_sequences": (
        "SkyRL's own, on the replaced vocab_parallel_entropy"),
    "_fused_vocab_parallel_entropy_from_hidden": (
        "runs on linear_vocab_parallel_stats. Differences: with gradients enabled (SkyRL's "
        "use_entropy_loss) the entropy has the exact gradient, d hidden this rank's share "
        "(SkyRL's gives a metric only); chunk_size is not used; temperature as for the "
        "log-probs"),
    "from_parallel_hidden_to_entropy_packed_sequences": (
        "SkyRL's own, on the replaced _fused_vocab_parallel_entropy_from_hidden (a gradient "
        "when its loss asks for one)"),
}
OPTIONS = IntegrationOptions("SkyRL", NOTES, padding="SkyRL normalises over all W*tp columns")


def set_helpers(helpers: dict[str, Callable]) -> None:
    """Hand over SkyRL's own functions named in :data:`HELPERS`."""
    _helpers.update(helpers)


def _helper(name: str) -> Callable:
    try:
        return _helpers[name]
    except KeyError:
        raise RuntimeError(f"megatron-vocabstats' SkyRL integration: SkyRL's {name} was not "
                           "resolved; call megatron_vocabstats.integrations.skyrl.apply()"
                           ) from None


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _in_vocabulary(target, width, tp_group, vocab_start_index, vocab_end_index):
    """``target`` with ids outside the vocabulary as :data:`IGNORE`; ``ValueError`` unless the
    window is Megatron's equal split."""
    rank = _rank(tp_group)
    if (int(vocab_start_index), int(vocab_end_index)) != (rank * width, (rank + 1) * width):
        raise ValueError(
            f"vocab_start_index, vocab_end_index: ({vocab_start_index}, {vocab_end_index}) on "
            f"tp rank {rank}; the integration takes Megatron's equal split of the {width}-wide "
            f"shards, ({rank * width}, {(rank + 1) * width})")
    vocab = OPTIONS.settings.vocab_size or width * _size(tp_group)
    return torch.where((target >= 0) & (target < vocab), target, torch.full_like(target, IGNORE))


def _grad_context(inference_only: bool):
    return torch.no_grad() if inference_only else contextlib.nullcontext()


def _logits_core(logits, target, vocab_start_index, vocab_end_index, group, inference_only):
    """fp32 ``log p(target)`` of the rank's rows (SkyRL's ``DistributedLogprob``)."""
    labels = _in_vocabulary(target, logits.shape[-1], group, vocab_start_index, vocab_end_index)
    options = replace(OPTIONS.settings.stats_options(), entropy="off")
    with _grad_context(inference_only):
        return vocab_parallel_stats(logits, labels, **options.op_kwargs(tp_group=group)).logprobs


def _fused_kwargs(group, temperature, entropy: str) -> dict:
    options = replace(OPTIONS.settings.stats_options(fused=True), entropy=entropy,
                      temperature=temperature)
    return options.op_kwargs(tp_group=group)


def _hidden_core(hidden, weight, target, vocab_start_index, vocab_end_index, group,
                 inference_only, temperature):
    """fp32 ``log p(target)`` of ``hidden @ weight.T`` (SkyRL's fused Function)."""
    labels = _in_vocabulary(target, weight.shape[0], group, vocab_start_index, vocab_end_index)
    lead = hidden.shape[:-1]
    with _grad_context(inference_only):
        stats = linear_vocab_parallel_stats(
            hidden.to(weight.dtype).reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
            partial_hidden_grad=True, **_fused_kwargs(group, temperature, "off"))
    return stats.logprobs.reshape(lead)


def _unpadded(row_fn, target, local_len, cp_group):
    """SkyRL's non-packed layout (roll, pad, cp split) around ``row_fn(target)``."""
    cp = _size(cp_group)
    target = target.roll(shifts=-1, dims=-1)
    pad = local_len * cp - target.shape[1]
    if pad > 0:
        target = torch.nn.functional.pad(target, (0, pad), value=0)
    if cp > 1:
        target = _helper("_get_tokens_on_this_cp_rank")(target, _rank(cp_group), cp, seq_dim=1)
    logprobs = row_fn(target).contiguous()
    if cp > 1:
        logprobs = _helper("allgather_cp_sharded_tensor")(logprobs, cp_group, seq_dim=1)
    if pad > 0:
        logprobs = logprobs[:, :-pad]
    return logprobs[:, :-1]


def _packed(row_fn, target, cu_seqlens_padded, unpacked_seqlen, cp_group, attention_mask,
            sub_seq_lengths):
    """SkyRL's packed layout around ``row_fn(targets [1, T/cp])``."""
    indices = _helper("_packed_sequence_indices")
    target = target.squeeze(0)
    total, device = target.shape[0], target.device
    cu, _, seq, offset, padded_len = indices(cu_seqlens_padded, total, device)
    rolled = target[cu[seq] + torch.remainder(offset + 1, padded_len[seq])]
    cp = _size(cp_group)
    if cp > 1:
        owner, local = _helper("_packed_cp_rank_and_local_indices")(cu, seq, offset, padded_len, cp)
        mine = owner == _rank(cp_group)
        rolled = torch.empty(total // cp, dtype=target.dtype, device=device).index_put_(
            (local[mine],), rolled[mine])
    probs = row_fn(rolled.unsqueeze(0)).contiguous().squeeze(0)
    if cp > 1:
        probs = _helper("allgather_cp_sharded_packed_tensor")(probs, cu, cp_group)
    batch = len(sub_seq_lengths) if sub_seq_lengths is not None else cu.shape[0] - 1
    out = torch.zeros((batch, unpacked_seqlen - 1), dtype=probs.dtype, device=probs.device)
    if sub_seq_lengths is not None:
        rows, starts, lengths = _helper("_packed_subseq_row_indices_offsets_and_lens")(
            cu, sub_seq_lengths, device)
        keep = offset < (lengths - 1).clamp(min=0)[seq]
        col = starts[seq] + offset
        keep &= col < unpacked_seqlen - 1
        out[rows[seq][keep], col[keep]] = probs[keep]
    elif attention_mask is not None:
        mask = attention_mask.to(device=device, dtype=torch.bool)
        lengths = mask.sum(dim=1, dtype=torch.long)
        ordinal = mask.long().cumsum(dim=1)
        where = mask[:, :-1] & (ordinal[:, :-1] < lengths[:, None])
        out[where] = probs[offset < (lengths - 1).clamp(min=0)[seq]]
    else:
        keep = (offset < (padded_len - 1).clamp(min=0)[seq]) & (offset < unpacked_seqlen - 1)
        out[seq[keep], offset[keep]] = probs[keep]
    return out


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index,
                                     vocab_end_index, tp_group, inference_only=False,
                                     cp_group=None, chunk_size=None):
    """SkyRL's ``from_parallel_logits_to_logprobs``: fp32 ``[B, S - 1]`` log-probs of the next
    token of ``target [B, S]`` from this rank's shard ``[B, S/cp, W]``; an id outside the
    vocabulary gives 0. Raises ``ValueError`` naming the argument."""
    del chunk_size
    OPTIONS.note_once("from_parallel_logits_to_logprobs")
    return _unpadded(lambda t: _logits_core(vocab_parallel_logits, t, vocab_start_index,
                                            vocab_end_index, tp_group, inference_only),
                     target, vocab_parallel_logits.shape[1], cp_group)


def from_parallel_logits_to_logprobs_packed_sequences(
        vocab_parallel_logits, target, cu_seqlens_padded, unpacked_seqlen, vocab_start_index,
        vocab_end_index, group, inference_only=False, cp_group=None, chunk_size=None,
        attention_mask=None, sub_seq_lengths=None):
    """SkyRL's packed variant: ``vocab_parallel_logits [1, T/cp, W]``, ``target [1, T]``; fp32
    ``[B, unpacked_seqlen - 1]``, zeros where no next token is known."""
    del chunk_size
    OPTIONS.note_once("from_parallel_logits_to_logprobs_packed_sequences")
    logits = vocab_parallel_logits.squeeze(0).unsqueeze(0)
    return _packed(lambda t: _logits_core(logits, t, vocab_start_index, vocab_end_index, group,
                                          inference_only),
                   target, cu_seqlens_padded, unpacked_seqlen, cp_group, attention_mask,
                   sub_seq_lengths)


def from_parallel_hidden_to_logprobs(hidden, lm_head_weight, target, vocab_start_index,
                                     vocab_end_index, tp_group, inference_only=False,
                                     cp_group=None, chunk_size=None, temperature=1.0,
                                     fused_backend="torch"):
    """SkyRL's fused ``from_parallel_hidden_to_logprobs``: :func:`from_parallel_logits_to_logprobs`
    of ``hidden [B, S/cp, H] @ lm_head_weight.T / temperature``, ``d hidden`` this rank's share."""
    del chunk_size, fused_backend
    OPTIONS.note_once("from_parallel_hidden_to_logprobs")
    return _unpadded(lambda t: _hidden_core(hidden, lm_head_weight, t, vocab_start_index,
                                            vocab_end_index, tp_group, inference_only,
                                            temperature),
                     target, hidden.shape[1], cp_group)


def from_parallel_hidden_to_logprobs_packed_sequences(
        hidden, lm_head_weight, target, cu_seqlens_padded, unpacked_seqlen, vocab_start_index,
        vocab_end_index, group, inference_only=False, cp_group=None, chunk_size=None,
        attention_mask=None, sub_seq_lengths=None, temperature=1.0, fused_backend="torch"):
    """SkyRL's fused packed variant (``hidden [1, T/cp, H]``)."""
    del chunk_size, fused_backend
    OPTIONS.note_once("from_parallel_hidden_to_logprobs_packed_sequences")
    rows = hidden.squeeze(0).unsqueeze(0)
    return _packed(lambda t: _hidden_core(rows, lm_head_weight, t, vocab_start_index,
                                          vocab_end_index, group, inference_only, temperature),
                   target, cu_seqlens_padded, unpacked_seqlen, cp_group, attention_mask,
                   sub_seq_lengths)


def vocab_parallel_entropy(vocab_parallel_logits):
    """SkyRL's ``vocab_parallel_entropy``: ``-sum p log p`` (nats) of the shard ``[..., W]`` on
    Megatron's tp group, shaped like its leading dims, in the logits' dtype, differentiable."""
    OPTIONS.note_once("vocab_parallel_entropy")
    options = replace(OPTIONS.settings.stats_options(), entropy="grad")
    stats = vocab_parallel_stats(vocab_parallel_logits, None,
                                 **options.op_kwargs(tp_group=default_tp_group()))
    return stats.entropy.to(vocab_parallel_logits.dtype)


def vocab_parallel_entropy_packed_sequences(vocab_parallel_logits, cu_seqlens_padded,
                                            unpacked_seqlen, num_actions, attention_mask,
                                            loss_mask, cp_group, sub_seq_lengths=None):
    """SkyRL's own function, on :func:`vocab_parallel_entropy`."""
    OPTIONS.note_once("vocab_parallel_entropy_packed_sequences")
    return _helper("vocab_parallel_entropy_packed_sequences")(
        vocab_parallel_logits, cu_seqlens_padded, unpacked_seqlen, num_actions, attention_mask,
        loss_mask, cp_group, sub_seq_lengths=sub_seq_lengths)


def _fused_vocab_parallel_entropy_from_hidden(hidden, lm_head_weight, tp_group, chunk_size=None,
                                              temperature=1.0):
    """SkyRL's fused per-token entropy, fp32 ``[B, S]``: differentiable under grad mode (SkyRL's
    ``use_entropy_loss``; ``d hidden`` this rank's share), else a metric."""
    del chunk_size
    OPTIONS.note_once("_fused_vocab_parallel_entropy_from_hidden")
    mode = "grad" if torch.is_grad_enabled() else "metric"
    stats = linear_vocab_parallel_stats(
        hidden.to(lm_head_weight.dtype).reshape(-1, hidden.shape[-1]), lm_head_weight, None,
        partial_hidden_grad=True, **_fused_kwargs(tp_group, temperature, mode))
    return stats.entropy.reshape(hidden.shape[:-1])


def from_parallel_hidden_to_entropy_packed_sequences(
        hidden, lm_head_weight, cu_seqlens_padded, unpacked_seqlen, num_actions, attention_mask,
        loss_mask, cp_group, tp_group, sub_seq_lengths=None, chunk_size=None, temperature=1.0):
    """SkyRL's own function, on :func:`_fused_vocab_parallel_entropy_from_hidden`."""
    OPTIONS.note_once("from_parallel_hidden_to_entropy_packed_sequences")
    return _helper("from_parallel_hidden_to_entropy_packed_sequences")(
        hidden, lm_head_weight, cu_seqlens_padded, unpacked_seqlen, num_actions, attention_mask,
        loss_mask, cp_group, tp_group=tp_group, sub_seq_lengths=sub_seq_lengths,
        chunk_size=chunk_size, temperature=temperature)
