"""Packing sequences into one THD row, and Megatron's ``PackedSeqParams`` for it."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from itertools import accumulate

import torch

from ..mcore import packed_seq_params_class
from ..ops.agreement import host_checks_enabled
from ..ops.options import IGNORE_INDEX, check_bool, number_problem
from .checks import _count, _fill_value, _is_int_tensor, _positive_int, _round_up
from .layout import PackedBatch, _segments, _shift


def _list_source(sequences):
    seqs = list(sequences)
    if not seqs:
        raise ValueError("sequences is empty: pass at least one sequence (it may be empty)")
    first = seqs[0]
    for i, s in enumerate(seqs):
        if not _is_int_tensor(s) or s.dim() != 1:
            got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"sequences[{i}] must be a 1-D integer tensor, got {got}")
        if s.device != first.device or s.dtype != first.dtype:
            raise ValueError(f"sequences[{i}] is {s.dtype} on {s.device} but sequences[0] "
                             f"{first.dtype} on {first.device}")
    host_lengths = [s.shape[0] for s in seqs]
    starts = torch.tensor(list(accumulate(host_lengths[:-1], initial=0)), device=first.device)
    return torch.cat(seqs), starts, host_lengths


def _padded_source(tokens: torch.Tensor, lengths):
    if not _is_int_tensor(tokens) or tokens.dim() != 2 or tokens.shape[0] == 0:
        raise ValueError(f"sequences as a padded batch must be integer token ids [B, S] with "
                         f"B >= 1, got {tuple(tokens.shape)} {tokens.dtype}")
    rows, width = tokens.shape
    starts = torch.arange(rows, device=tokens.device) * width
    if lengths is None:
        raise ValueError("lengths is required with a padded batch [B, S]: the real length of "
                         "each row")
    if isinstance(lengths, torch.Tensor):
        if not _is_int_tensor(lengths) or lengths.shape != (rows,):
            raise ValueError(f"lengths must be an integer tensor [B={rows}], got "
                             f"{tuple(lengths.shape)} {lengths.dtype}")
        if lengths.device != tokens.device:
            raise ValueError(f"lengths is on {lengths.device} but sequences on {tokens.device}")
        return tokens.reshape(-1), starts, None, lengths.to(torch.int64)
    host = list(lengths)
    if len(host) != rows or any(number_problem(n, integer=True) for n in host):
        raise ValueError(f"lengths must hold B={rows} ints, got {host!r}")
    host = [int(n) for n in host]
    bad = [n for n in host if not 0 <= n <= width]
    if bad:
        raise ValueError(f"lengths holds {bad[0]}, outside [0, S={width}] (the row length of "
                         "sequences)")
    return tokens.reshape(-1), starts, host, None


def pack_sequences(
    sequences: Sequence[torch.Tensor] | torch.Tensor,
    lengths: torch.Tensor | Sequence[int] | None = None,
    *,
    alignment: int = 1,
    total_length: int | None = None,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    seq_params: bool = True,
    validate: bool = True,
) -> PackedBatch:
    """Pack sequences into one THD row with per-sequence labels, masks, positions and cu_seqlens.

    Reference semantics (for a list of sequences ``x_i`` of lengths ``L_i``)::

        P_i = ceil(L_i / alignment) * alignment   # the last P_i also takes total_length padding
        tokens = cat([cat([x_i, full(P_i - L_i, pad_token_id)]) for i])
        labels = cat([cat([x_i[1:], full(P_i - L_i + 1, ignore_index)])[:P_i] for i])
        position_ids = cat([arange(P_i) for i]);  loss_mask = (labels != ignore_index)

    ``sequences``: a list of 1-D integer tensors (one dtype and device; empty ones allowed), or a
    padded batch ``[B, S]`` whose row b holds ``lengths[b]`` real tokens on the left (``lengths``:
    a ``[B]`` integer tensor on its device, or B ints). ``total_length``: the row length T, a
    multiple of ``alignment`` (:func:`sequence_alignment`); default the packed length with
    lengths on the host, else the bound ``B * ceil(S / alignment) * alignment``. ``seq_params``:
    build :func:`make_packed_seq_params`. Host syncs, ``max_seqlen`` and ``validate``:
    ``docs/ops.md``, "Packed sequences and context parallelism".

    Raises ``ValueError`` naming the argument: a malformed ``sequences`` or ``lengths`` (empty
    list, non-integer or non-1-D sequence, mixed dtypes or devices, a padded batch without
    ``lengths`` or with misshapen ones, ``lengths`` with a list), lengths outside ``[0, S]``, a bad
    ``alignment``, a ``total_length`` not a multiple of it or below the packed length (for a
    ``lengths`` tensor these two need ``validate``), a fill value the token dtype does not hold,
    a non-bool ``seq_params``/``validate``.
    """
    seq_params = check_bool("seq_params", seq_params)
    validate = check_bool("validate", validate)
    alignment = _positive_int(alignment, "alignment")
    if total_length is not None:
        total_length = _count(total_length, "total_length", low=0)
        if total_length % alignment:
            raise ValueError(f"total_length must be a non-negative multiple of alignment="
                             f"{alignment}, got {total_length!r}")
    if isinstance(sequences, torch.Tensor):
        flat, starts, host_lengths, lens = _padded_source(sequences, lengths)
    else:
        if lengths is not None:
            raise ValueError("lengths is only for a padded batch [B, S]; a list of sequences "
                             "carries its own lengths")
        flat, starts, host_lengths = _list_source(sequences)
        lens = None
    device = flat.device

    if host_lengths is not None:
        padded = [_round_up(n, alignment) for n in host_lengths]
        needed = sum(padded)
        total = needed if total_length is None else total_length
        if total < needed:
            raise ValueError(f"total_length={total} is smaller than the packed length {needed}")
        padded[-1] += total - needed
        lens = torch.tensor(host_lengths, dtype=torch.int64, device=device)
        cu = torch.tensor(list(accumulate(host_lengths, initial=0)), device=device)
        cu_p = torch.tensor(list(accumulate(padded, initial=0)), device=device)
        max_seqlen = max(padded)
        pad_between = padded != host_lengths
    else:
        rows, width = sequences.shape
        total = rows * _round_up(width, alignment) if total_length is None else total_length
        ends_p = _round_up(lens, alignment).cumsum(0)
        if host_checks_enabled(validate, device):
            bad = (lens < 0) | (lens > width)
            if bool(bad.any()):
                raise ValueError(f"lengths holds {int(lens[bad][0])}, outside [0, S={width}] "
                                 "(the row length of sequences)")
            if int(ends_p[-1]) > total:
                raise ValueError(f"total_length={total} is smaller than the packed length "
                                 f"{int(ends_p[-1])}")
        zero = lens.new_zeros(1)
        cu = torch.cat([zero, lens.cumsum(0)])
        cu_p = torch.cat([zero, ends_p[:-1], lens.new_full((1,), total)])
        max_seqlen = total
        pad_between = True

    seq, offset, real, next_real = _segments(cu_p, lens, total)
    pad_token_id = _fill_value("pad_token_id", pad_token_id, flat.dtype)
    source = torch.cat([flat, flat.new_full((1,), pad_token_id)])
    tokens = source[torch.where(real, starts[seq] + offset, flat.numel())]
    cu32, cu_p32 = cu.to(torch.int32), cu_p.to(torch.int32)
    params = (make_packed_seq_params(cu32, cu_p32, max_seqlen, pad_between_seqs=pad_between)
              if seq_params else None)
    return PackedBatch(
        tokens=tokens.unsqueeze(0),
        labels=_shift(tokens, next_real, ignore_index).unsqueeze(0),
        loss_mask=next_real.to(torch.float32).unsqueeze(0),
        position_ids=offset.unsqueeze(0),
        cu_seqlens=cu32,
        cu_seqlens_padded=cu_p32,
        max_seqlen=max_seqlen,
        packed_seq_params=params,
    )


def make_packed_seq_params(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                           max_seqlen: int, *, pad_between_seqs: bool | None = None):
    """Megatron's ``PackedSeqParams(qkv_format="thd", ...)``, or None without ``megatron.core``.

    ``cu_seqlens_{q,kv} = cu_seqlens``, ``cu_seqlens_{q,kv}_padded = cu_seqlens_padded``
    (``[N + 1]`` int32 on the attention device, unchecked), ``max_seqlen_{q,kv} = max_seqlen``
    (the largest padded length or a bound of it), and ``pad_between_seqs`` where the release has
    it (0.19; None leaves it unset). Under context parallelism pass the global (unsharded) values,
    as Megatron does. Raises ``ValueError`` for ``pad_between_seqs`` neither a bool nor None.
    """
    if pad_between_seqs is not None:
        pad_between_seqs = check_bool("pad_between_seqs", pad_between_seqs)
    cls = packed_seq_params_class()
    if cls is None:
        return None
    if dataclasses.is_dataclass(cls):
        fields = {f.name for f in dataclasses.fields(cls)}
    else:
        fields = set(inspect.signature(cls).parameters)
    wanted = {
        "qkv_format": "thd",
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_kv": cu_seqlens,
        "cu_seqlens_q_padded": cu_seqlens_padded,
        "cu_seqlens_kv_padded": cu_seqlens_padded,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
        "pad_between_seqs": pad_between_seqs,
    }
    return cls(**{k: v for k, v in wanted.items() if k in fields and v is not None})
