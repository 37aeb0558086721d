"""The packed (THD) layout: :class:`PackedBatch`, :func:`sequence_alignment` (the padding multiple
of a parallel layout), the per-position segment arithmetic and the label shift inside sequences
(:func:`shift_packed_labels`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..ops.options import IGNORE_INDEX, check_bool
from .checks import _cu_pair, _fill_value, _is_int_tensor, _positive_int

# ----------------------------------------------------------------------------- alignment


def sequence_alignment(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False,
                       fp8_multiple: int = 1) -> int:
    """Multiple every packed sequence is padded to, for the given parallel layout.

    Returns ``lcm(2 * cp, cp * t * f)`` where ``cp = cp_size``, ``t = tp_size`` with sequence
    parallelism (else 1) and ``f = fp8_multiple``; the ``2 * cp`` term only when ``cp_size > 1``.
    It is the smallest multiple such that, whatever the number of sequences,

    * each sequence splits into ``2 * cp`` equal chunks (context-parallel load balancing);
    * each cp rank's token count ``T / cp`` splits evenly over the tp ranks (sequence parallel);
    * each rank's final token count ``T / (cp * t)`` is a multiple of ``f`` (FP8 GEMMs want the
      per-shard token count divisible by 16 for tensorwise/delayed scaling, 32 for MXFP8, 128
      for blockwise: pass that as ``fp8_multiple``).

    This contains the plain ``lcm(2 * cp, t, f)`` and is larger only where that one is too small
    (e.g. cp=2, tp=4 with sequence parallel: a sequence of 4 tokens gives each cp rank 2 tokens,
    which do not split over 4 tp ranks). Megatron's multimodal ``get_padding`` uses
    ``2 * cp * tp`` under CP + SP, a multiple of this value.

    Args:
        cp_size: context-parallel size, >= 1.
        tp_size: tensor-parallel size, >= 1 (only matters with ``sequence_parallel``).
        sequence_parallel: whether activations are split over tp along the sequence.
        fp8_multiple: per-shard token multiple FP8 needs (1 without FP8).

    Returns:
        A positive int, for ``pack_sequences(..., alignment=...)``.

    Raises:
        ValueError: a size that is not a positive int, or ``sequence_parallel`` not a bool.
    """
    cp = _positive_int(cp_size, "cp_size")
    tp = _positive_int(tp_size, "tp_size")
    fp8 = _positive_int(fp8_multiple, "fp8_multiple")
    sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
    shard = cp * (tp if sequence_parallel else 1) * fp8
    return math.lcm(2 * cp if cp > 1 else 1, shard)


# ----------------------------------------------------------------------------- packing


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """A packed (THD) batch of N sequences in one row of T tokens.

    ``tokens``: ``[1, T]`` token ids, the dtype of the input (padding: ``pad_token_id``).
    ``labels``: ``[1, T]`` same dtype: next token inside each sequence, else ``ignore_index``.
    ``loss_mask``: ``[1, T]`` float32, 1.0 where ``labels`` is a real next token, else 0.0.
    ``position_ids``: ``[1, T]`` int64, restarting at 0 at each padded sequence start (padding
    continues the count).
    ``cu_seqlens`` / ``cu_seqlens_padded``: ``[N + 1]`` int32 cumulative real / padded lengths;
    ``cu_seqlens_padded[-1] == T``.
    ``max_seqlen``: Python int, the largest padded length, or an upper bound when the lengths
    were only known on the device (see :func:`pack_sequences`).
    ``packed_seq_params``: Megatron's ``PackedSeqParams(qkv_format="thd", ...)`` for the
    installed megatron-core, or None (megatron-core not importable, or not asked for).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    packed_seq_params: Any = None


def _segments(cu_padded: torch.Tensor, lengths: torch.Tensor, total: int):
    """Per packed position ``p < total``: ``(offset in its padded sequence, is a real token,
    next position is a real token of the same sequence)``. ``cu_padded`` int64 [N + 1]."""
    pos = torch.arange(total, device=cu_padded.device)
    seq = torch.searchsorted(cu_padded[1:], pos, right=True).clamp_(max=lengths.numel() - 1)
    offset = pos - cu_padded[seq]
    length = lengths[seq]
    return seq, offset, offset < length, offset + 1 < length


def _shift(tokens: torch.Tensor, next_real: torch.Tensor, ignore_index: int) -> torch.Tensor:
    ignore_index = _fill_value("ignore_index", ignore_index, tokens.dtype)
    return torch.where(next_real, tokens.roll(-1, dims=-1), ignore_index)


def shift_packed_labels(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token labels of already packed tokens, never crossing a sequence boundary.

    Reference semantics, per sequence i with real tokens ``x = tokens[..., s:s + L]``
    (``s = cu_seqlens_padded[i]``, ``L = cu_seqlens[i + 1] - cu_seqlens[i]``)::

        labels[..., s:s + L - 1] = x[1:];  every other position = ignore_index

    Args:
        tokens: ``[T]`` or ``[1, T]`` integer token ids.
        cu_seqlens: ``[N + 1]`` integer cumulative real lengths; must end at T when
            ``cu_seqlens_padded`` is None.
        cu_seqlens_padded: ``[N + 1]`` cumulative padded lengths ending at T, or None (no padding).
        ignore_index: label of positions without a next token.
        validate: check the cumulative lengths' values (reads them on the host; skipped during
            CUDA graph capture). Without it, bad input gives wrong labels.

    Returns:
        ``(labels, loss_mask)`` shaped like ``tokens``: labels in the tokens' dtype, loss_mask
        float32 (1.0 where the label is a real next token).

    Raises:
        ValueError: non-integer or wrongly shaped ``tokens``/``cu_seqlens``, an
            ``ignore_index`` that is not an int or does not fit the tokens' dtype; with
            ``validate``, ``cu_seqlens``/``cu_seqlens_padded`` not starting at 0, decreasing, not
            ending at T, or a sequence longer than its padded length.
    """
    validate = check_bool("validate", validate)
    if not _is_int_tensor(tokens) or tokens.dim() not in (1, 2) or (
            tokens.dim() == 2 and tokens.shape[0] != 1):
        got = (f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor)
               else type(tokens).__name__)
        raise ValueError(f"tokens must be integer token ids [T] or [1, T], got {got}")
    total = tokens.shape[-1]
    cu, cu_p = _cu_pair(cu_seqlens, cu_seqlens_padded, total, tokens.device, validate=validate)
    _, _, _, next_real = _segments(cu_p, cu[1:] - cu[:-1], total)
    return _shift(tokens, next_real, ignore_index), next_real.to(torch.float32).view_as(tokens)
