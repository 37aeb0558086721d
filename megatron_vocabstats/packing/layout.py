"""The packed (THD) layout: :class:`PackedBatch`, its padding multiple and its label shift."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..ops.options import IGNORE_INDEX, check_bool
from .checks import _cu_pair, _fill_value, _is_int_tensor, _positive_int


def sequence_alignment(cp_size: int = 1, tp_size: int = 1, sequence_parallel: bool = False,
                       fp8_multiple: int = 1) -> int:
    """Multiple every packed sequence is padded to: ``lcm(2 * cp, cp * t * f)``.

    ``cp = cp_size`` (the ``2 * cp`` term only when ``cp > 1``), ``t = tp_size`` under sequence
    parallelism (else 1), ``f = fp8_multiple`` (FP8 GEMMs: 16 for tensorwise/delayed scaling, 32
    for MXFP8, 128 for blockwise): the smallest multiple that cuts each sequence into ``2 * cp``
    equal chunks and leaves each rank ``T / (cp * t)`` tokens divisible by ``f``. Raises
    ``ValueError`` for a size that is not a positive int or a non-bool ``sequence_parallel``.
    """
    cp = _positive_int(cp_size, "cp_size")
    tp = _positive_int(tp_size, "tp_size")
    fp8 = _positive_int(fp8_multiple, "fp8_multiple")
    sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
    shard = cp * (tp if sequence_parallel else 1) * fp8
    return math.lcm(2 * cp if cp > 1 else 1, shard)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PackedBatch:
    """A packed (THD) batch of N sequences in one row of T tokens.

    ``tokens``: ``[1, T]`` token ids, the input's dtype (padding: ``pad_token_id``); ``labels``:
    ``[1, T]`` same dtype, the next token inside each sequence, else ``ignore_index``;
    ``loss_mask``: ``[1, T]`` float32, 1.0 where ``labels`` is a real next token;
    ``position_ids``: ``[1, T]`` int64, from 0 at each padded sequence start (padding continues);
    ``cu_seqlens`` / ``cu_seqlens_padded``: ``[N + 1]`` int32 cumulative real / padded lengths,
    ``cu_seqlens_padded[-1] == T`` (padding up to a given total belongs to the last sequence);
    ``max_seqlen``: int, the largest padded length or a bound of it; ``packed_seq_params``:
    Megatron's ``PackedSeqParams(qkv_format="thd", ...)``, or None.
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
    """Per packed position: ``(sequence, offset in it, real token, next one a real token too)``."""
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

    ``tokens``: ``[T]`` or ``[1, T]`` integer ids; ``cu_seqlens`` / ``cu_seqlens_padded``:
    ``[N + 1]`` integer cumulative real / padded lengths, the latter (or, when None, the former)
    ending at T. Returns ``(labels, loss_mask)`` shaped like ``tokens``: labels in its dtype,
    loss_mask float32 (1.0 where the label is a real next token).

    Raises ``ValueError`` for non-integer or misshapen ``tokens``/``cu_seqlens``, an
    ``ignore_index`` the tokens' dtype does not hold, and with ``validate`` bad cumulative lengths
    (:mod:`~megatron_vocabstats.packing`).
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
