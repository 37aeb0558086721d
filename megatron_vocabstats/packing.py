"""Packed sequences (THD) and context parallelism, vectorised and free of host syncs.

A packed batch is one row ``[1, T]`` holding N sequences back to back, each padded to a multiple
of an alignment; ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (padded lengths) are the
``[N + 1]`` int32 cumulative sums that Megatron's ``PackedSeqParams(qkv_format="thd")`` and
transformer-engine read. Padding added to reach a requested total is part of the last padded
sequence, so ``cu_seqlens_padded[-1] == T`` always holds.

Labels shift inside each sequence: ``labels[p] = tokens[p + 1]`` when p + 1 is a real token of
the same sequence, else ``ignore_index`` (the last real token of each sequence and all padding).

Context parallelism (cp ranks) cuts every padded sequence into ``2 * cp`` equal chunks; rank r
keeps chunks r and ``2 * cp - 1 - r`` of each, in that order ("load-balanced" or zigzag order of
Megatron / transformer-engine ``thd_get_partitioned_indices``), so every rank gets an equal share
of the causal-attention work. A ``[b, s]`` batch is the case of one sequence of length s per row.

Everything is computed with tensor ops (``searchsorted`` over the cumulative lengths, masks as
``arange < lengths``): no Python loop over sequences or rows, no ``.item()``/``.tolist()``, no
data-dependent shape. The one exception is ``validate=True`` (the default, as in the ops): its
value checks read a few numbers on the host. Pass ``validate=False`` in hot or graph-captured code
(the checks are skipped anyway while a CUDA graph is being captured);
``megatron_vocabstats.testing.forbid_host_sync`` proves the rest syncs nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import zlib
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from .ops import _comm
from .megatron.compat import packed_seq_params_class
from .ops._checks import Field, agree_across_ranks, host_checks_enabled

IGNORE_INDEX = -100

__all__ = [
    "IGNORE_INDEX",
    "PackedBatch",
    "context_parallel_indices",
    "gather_from_context_parallel",
    "make_packed_seq_params",
    "pack_sequences",
    "sequence_alignment",
    "shard_for_context_parallel",
    "shift_packed_labels",
    "unpack_sequences",
]


# ----------------------------------------------------------------------------- argument checks


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _round_up(n, multiple):
    return (n + multiple - 1) // multiple * multiple


def _is_int_tensor(t) -> bool:
    return (isinstance(t, torch.Tensor) and not t.dtype.is_floating_point
            and not t.dtype.is_complex and t.dtype != torch.bool)


def _cumulative(cu, name: str, device: torch.device) -> torch.Tensor:
    """Shape/dtype checks of a cumulative-lengths argument; returns it as int64 on ``device``."""
    if not _is_int_tensor(cu) or cu.dim() != 1 or cu.numel() < 2:
        got = (f"{tuple(cu.shape)} {cu.dtype}" if isinstance(cu, torch.Tensor)
               else type(cu).__name__)
        raise ValueError(f"{name} must be a 1-D integer tensor [N + 1] with N >= 1, got {got}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but the packed tensor on {device}")
    return cu.to(torch.int64)


def _check_cumulative(cu: torch.Tensor, name: str, *, total: int | None = None,
                      multiple: int = 1, why: str = "") -> None:
    """Value checks (host read): starts at 0, non-decreasing, ends at ``total``, every step a
    multiple of ``multiple``."""
    steps = cu[1:] - cu[:-1]
    end_ok = cu[-1] == total if total is not None else cu.new_ones((), dtype=torch.bool)
    flags = torch.stack([cu[0] != 0, (steps < 0).any(), ~end_ok, (steps % multiple != 0).any()])
    first, decreasing, end, misaligned = flags.tolist()
    if first:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    if decreasing:
        k = int((steps < 0).nonzero()[0, 0])
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths): entry {k + 1} is "
                         f"{int(cu[k + 1])} after {int(cu[k])}")
    if end:
        raise ValueError(f"{name} must end at the packed length T={total}, got {int(cu[-1])}")
    if misaligned:
        k = int((steps % multiple != 0).nonzero()[0, 0])
        raise ValueError(f"{name}: sequence {k} has padded length {int(steps[k])}, not a multiple "
                         f"of {multiple}{why}")


def _cu_pair(cu_seqlens, cu_seqlens_padded, total: int, device, *, validate: bool):
    """Checked int64 ``(cu_seqlens, cu_seqlens_padded)`` of a packed row of ``total`` tokens;
    the padded one is ``cu_seqlens`` itself when None (which must then end at ``total``)."""
    cu = _cumulative(cu_seqlens, "cu_seqlens", device)
    if cu_seqlens_padded is None:
        if host_checks_enabled(validate, device):
            _check_cumulative(cu, "cu_seqlens", total=total)
        return cu, cu
    cu_p = _cumulative(cu_seqlens_padded, "cu_seqlens_padded", device)
    if cu_p.numel() != cu.numel():
        raise ValueError(f"cu_seqlens_padded has {cu_p.numel()} entries but cu_seqlens "
                         f"{cu.numel()}: both are [N + 1]")
    if host_checks_enabled(validate, device):
        _check_cumulative(cu, "cu_seqlens")
        _check_cumulative(cu_p, "cu_seqlens_padded", total=total)
        over = (cu[1:] - cu[:-1]) > (cu_p[1:] - cu_p[:-1])
        if bool(over.any()):
            k = int(over.nonzero()[0, 0])
            raise ValueError(f"cu_seqlens: sequence {k} is longer than its padded length in "
                             "cu_seqlens_padded")
    return cu, cu_p


def _seq_dim(x, dim: int, name: str = "x") -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of {name} with shape {tuple(x.shape)}")
    return dim % x.dim()


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
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
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


def _fill_value(name: str, value, dtype: torch.dtype) -> int | float | bool:
    """``value`` (a pad id, ``ignore_index``, a padding value) as a number that ``dtype`` holds,
    else ``ValueError`` naming ``name`` (torch would wrap or truncate it: -100 to 156 in uint8,
    -0.5 to 0 in int64)."""
    if dtype.is_floating_point:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a real number, got {value!r} "
                             f"({type(value).__name__})")
        if math.isfinite(value) and abs(value) > torch.finfo(dtype).max:
            raise ValueError(f"{name}={value} overflows {dtype}")
        return float(value)
    if dtype == torch.bool:
        if value not in (0, 1):
            raise ValueError(f"{name} must be a bool for bool values, got {value!r}")
        return bool(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int for {dtype} values, got {value!r} "
                         f"({type(value).__name__})")
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise ValueError(f"{name}={value} does not fit the dtype {dtype} "
                         f"([{info.min}, {info.max}]): use wider token ids (e.g. int64)")
    return int(value)


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
    if not _is_int_tensor(tokens) or tokens.dim() not in (1, 2) or (
            tokens.dim() == 2 and tokens.shape[0] != 1):
        got = (f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor)
               else type(tokens).__name__)
        raise ValueError(f"tokens must be integer token ids [T] or [1, T], got {got}")
    total = tokens.shape[-1]
    cu, cu_p = _cu_pair(cu_seqlens, cu_seqlens_padded, total, tokens.device, validate=validate)
    _, _, _, next_real = _segments(cu_p, cu[1:] - cu[:-1], total)
    return _shift(tokens, next_real, ignore_index), next_real.to(torch.float32).view_as(tokens)


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
    if len(host) != rows or any(isinstance(n, bool) or not isinstance(n, int) for n in host):
        raise ValueError(f"lengths must hold B={rows} ints, got {host!r}")
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

    Reference semantics (one Python loop, for a list of sequences ``x_i`` of lengths ``L_i``)::

        P_i = ceil(L_i / alignment) * alignment   # the last P_i also takes total_length padding
        tokens = cat([cat([x_i, full(P_i - L_i, pad_token_id)]) for i])
        labels = cat([cat([x_i[1:], full(P_i - L_i + 1, ignore_index)])[:P_i] for i])
        position_ids = cat([arange(P_i) for i]);  loss_mask = (labels != ignore_index)

    computed with tensor ops over all positions at once. Choose ``alignment`` with
    :func:`sequence_alignment` (``2 * cp`` at least for context parallelism).

    Data preparation, not a hot path: it may synchronise with the host (``validate=True`` with a
    ``lengths`` tensor reads it; a list of sequences copies its lengths to the device). It is
    sync-free with a ``lengths`` tensor and ``validate=False`` (output shapes from the static
    bound ``total_length``), so it can run inside a captured step in that form. The per-step
    functions (:func:`shift_packed_labels`, :func:`shard_for_context_parallel`,
    :func:`gather_from_context_parallel`, :func:`unpack_sequences`) never sync with
    ``validate=False``.

    Args:
        sequences: a list of 1-D integer tensors (same dtype and device; empty ones allowed), or a
            padded batch ``[B, S]`` whose row b holds ``lengths[b]`` real tokens on the left.
        lengths: with a padded batch only: ``[B]`` integer tensor on its device, or B ints.
        alignment: every sequence is padded to a multiple of it.
        total_length: pad the row to exactly this T (a multiple of ``alignment``); the padding is
            part of the last sequence. Default: the packed length when lengths are known on the
            host (a list, or ``lengths`` as ints), else the static bound ``B * ceil(S/alignment)
            * alignment``, so that no device value is read.
        pad_token_id: token id of padding positions.
        ignore_index: label of positions without a next token.
        seq_params: build ``packed_seq_params`` (imports megatron-core on first use; None when it
            is not importable). ``total_tokens``/``seq_idx`` (Mamba only) are left unset: Megatron
            derives them with a host sync.
        validate: with a ``lengths`` tensor, check ``0 <= lengths <= S`` and that the packed
            length fits ``total_length`` (reads them on the host; skipped during CUDA graph
            capture). Without it such input gives wrong tokens.

    Returns:
        :class:`PackedBatch`. ``max_seqlen`` is exact when lengths are known on the host; with a
        ``lengths`` tensor it is the bound T (any padded length is <= T), and
        ``pad_between_seqs`` is set True.

    Raises:
        ValueError: naming the argument: empty ``sequences``, a non-integer or non-1-D sequence,
            mixed dtypes/devices, a padded batch without ``lengths`` or with lengths of the wrong
            shape, device or dtype, lengths outside ``[0, S]`` (a tensor: with ``validate``), a
            non-positive ``alignment``, ``total_length`` not a multiple of ``alignment`` or smaller
            than the packed length (a tensor: with ``validate``), a ``pad_token_id`` or
            ``ignore_index`` that is not an int or does not fit the token dtype.
    """
    alignment = _positive_int(alignment, "alignment")
    if total_length is not None and (isinstance(total_length, bool)
                                     or not isinstance(total_length, int)
                                     or total_length < 0 or total_length % alignment):
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
    """Megatron's ``PackedSeqParams(qkv_format="thd", ...)`` for the installed megatron-core.

    Sets ``cu_seqlens_q = cu_seqlens_kv = cu_seqlens``, ``cu_seqlens_{q,kv}_padded =
    cu_seqlens_padded``, ``max_seqlen_{q,kv} = max_seqlen``, and ``pad_between_seqs`` where the
    release has it (0.19; transformer-engine otherwise infers it by comparing the two tensors on
    the host). Fields are found by feature detection (dataclass fields, else the signature), so
    0.16 (no ``pad_between_seqs``) and 0.19 both work. The cu tensors are used as given (TE wants
    int32 on the attention device). Under context parallelism pass the global (unsharded) values,
    as Megatron does.

    Args:
        cu_seqlens: ``[N + 1]`` int32 cumulative real lengths.
        cu_seqlens_padded: ``[N + 1]`` int32 cumulative padded lengths (``[-1] == T``).
        max_seqlen: Python int, the largest padded length (or an upper bound of it).
        pad_between_seqs: whether any sequence is padded; None leaves the field unset.

    Returns:
        The ``PackedSeqParams``, or None when ``megatron.core`` is not importable (no error: THD
        packing itself does not need Megatron).

    Raises:
        Nothing of its own; the values are passed through unchecked (:func:`pack_sequences`
        builds them consistent).
    """
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


# ----------------------------------------------------------------------------- context parallel


def _cp_positions(cu_padded: torch.Tensor, total: int, cp: int, ranks: torch.Tensor):
    """Packed positions held by each of ``ranks`` ([K] int64): int64 ``[K, total // cp]``.

    Local position j of rank r lies in sequence i (found on ``cu_padded // cp``) at offset o; with
    half = (padded length of i) / (2 cp), it is chunk r of i for o < half, else chunk 2cp-1-r.
    """
    local = cu_padded // cp
    j = torch.arange(total // cp, device=cu_padded.device)
    seq = torch.searchsorted(local[1:], j, right=True).clamp_(max=local.numel() - 2)
    start = local[seq]
    half = (local[seq + 1] - start) // 2
    offset = j - start
    second = offset >= half
    chunk = torch.where(second, 2 * cp - 1 - ranks.unsqueeze(1), ranks.unsqueeze(1))
    return start * cp + chunk * half + offset - torch.where(second, half, 0)


def _cp_layout(cu_seqlens_padded, total: int, cp: int, device, *, validate: bool,
               what: str) -> torch.Tensor:
    """Checked int64 cumulative padded lengths (``[0, total]`` when None) for a cp split."""
    multiple = 2 * cp if cp > 1 else 1
    why = f" (= 2 * cp_size for cp_size={cp}; pad with pack_sequences(alignment=...))"
    if total % multiple:
        raise ValueError(f"{what} has {total} tokens in all, not a multiple of {multiple}{why}")
    if cu_seqlens_padded is None:
        return torch.arange(2, device=device) * total  # a kernel, not a host-to-device copy
    cu = _cumulative(cu_seqlens_padded, "cu_seqlens_padded", device)
    if host_checks_enabled(validate, device):
        _check_cumulative(cu, "cu_seqlens_padded", total=total, multiple=multiple, why=why)
    return cu


def context_parallel_indices(cu_seqlens_padded: torch.Tensor | None, total_tokens: int, *,
                             cp_size: int, cp_rank: int, device=None,
                             validate: bool = True) -> torch.Tensor:
    """Packed positions that context-parallel rank ``cp_rank`` of ``cp_size`` keeps, in its order.

    Each padded sequence is cut into ``2 * cp_size`` chunks; the rank keeps chunk ``cp_rank`` then
    chunk ``2 * cp_size - 1 - cp_rank`` of every sequence, sequence after sequence. Equals
    transformer-engine's ``thd_get_partitioned_indices(cu_seqlens_padded, total_tokens, cp_size,
    cp_rank)`` (as int64); with ``cu_seqlens_padded=None`` the whole dimension is one sequence
    (Megatron's split of a ``[b, s]`` batch).

    Args:
        cu_seqlens_padded: ``[N + 1]`` integer cumulative padded lengths ending at
            ``total_tokens``, every step a multiple of ``2 * cp_size``; or None.
        total_tokens: T, a multiple of ``2 * cp_size``.
        cp_size, cp_rank: the split; ``0 <= cp_rank < cp_size``.
        device: where to build the indices when ``cu_seqlens_padded`` is None (default CPU).
        validate: check the values of ``cu_seqlens_padded`` (host read; skipped during CUDA graph
            capture).

    Returns:
        int64 ``[total_tokens // cp_size]`` on the device of ``cu_seqlens_padded``.

    Raises:
        ValueError: bad sizes or rank; T not a multiple of ``2 * cp_size``; with ``validate``,
            ``cu_seqlens_padded`` not starting at 0, decreasing, not ending at T, or a sequence
            whose padded length is not a multiple of ``2 * cp_size`` (naming it).
    """
    cp = _positive_int(cp_size, "cp_size")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be an int in [0, {cp}), got {cp_rank!r}")
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
        raise ValueError(f"total_tokens must be a non-negative int, got {total_tokens!r}")
    if cu_seqlens_padded is not None:
        device = cu_seqlens_padded.device if isinstance(cu_seqlens_padded, torch.Tensor) else None
    return _rank_positions(cu_seqlens_padded, total_tokens, cp, cp_rank,
                           torch.device(device or "cpu"), validate=validate, what="total_tokens")


def _rank_positions(cu_seqlens_padded, total, cp, rank, device, *, validate, what):
    cu = _cp_layout(cu_seqlens_padded, total, cp, device, validate=validate, what=what)
    ranks = torch.full((1,), rank, dtype=torch.int64, device=device)
    return _cp_positions(cu, total, cp, ranks)[0]


def shard_for_context_parallel(
    x: torch.Tensor | PackedBatch,
    cp_group: dist.ProcessGroup | None,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    dim: int = 1,
    validate: bool = True,
) -> torch.Tensor | PackedBatch:
    """This context-parallel rank's load-balanced share of ``x`` along the sequence dimension.

    Equals ``x.index_select(dim, context_parallel_indices(cu_seqlens_padded, x.shape[dim],
    cp_size=cp, cp_rank=rank))`` (see there for the order). No communication.

    Args:
        x: a tensor with T tokens along ``dim`` (THD ``[1, T]``, ``[b, s]``, hidden ``[T, 1, h]``
            with ``dim=0``), or a :class:`PackedBatch`, whose tokens, labels, loss_mask and
            position_ids are sharded along dim 1 with its own ``cu_seqlens_padded``; its
            cu_seqlens, max_seqlen and packed_seq_params stay global, as Megatron passes them to
            transformer-engine under context parallelism.
        cp_group: the context-parallel group; None (or size 1) returns ``x`` itself.
        cu_seqlens_padded: for THD, ``[N + 1]`` cumulative padded lengths ending at T; None
            treats the dimension as one sequence (a ``[b, s]`` batch). Not with a PackedBatch.
        dim: the sequence dimension of a tensor ``x``.
        validate: check the values of ``cu_seqlens_padded`` (host read; skipped during CUDA graph
            capture). Every rank holds the same values, so every rank raises alike.

    Returns:
        ``x`` with ``T / cp`` tokens along ``dim`` (same dtype and device), or a PackedBatch.

    Raises:
        ValueError: ``dim`` out of range; T not a multiple of ``2 * cp``; with ``validate``,
            ``cu_seqlens_padded`` not starting at 0, decreasing, not ending at T, or a sequence
            not padded to a multiple of ``2 * cp`` (naming ``cu_seqlens_padded``).
    """
    rank, cp = _comm.group_rank_size(cp_group)
    if isinstance(x, PackedBatch):
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded: a PackedBatch carries its own")
        if cp == 1:
            return x
        index = _rank_positions(x.cu_seqlens_padded, x.tokens.shape[1], cp, rank, x.tokens.device,
                                validate=validate, what="x.tokens")
        return dataclasses.replace(
            x, **{name: getattr(x, name).index_select(1, index)
                  for name in ("tokens", "labels", "loss_mask", "position_ids")})
    dim = _seq_dim(x, dim)
    if cp == 1:
        return x
    index = _rank_positions(cu_seqlens_padded, x.shape[dim], cp, rank, x.device,
                            validate=validate, what=f"x (dim {dim})")
    return x.index_select(dim, index)


class _GatherFromContextParallel(torch.autograd.Function):
    """All-gather the cp shards and put every token back at its packed position.

    Backward: this rank's slice of the upstream gradient (no collective); see
    :func:`gather_from_context_parallel`.
    """

    @staticmethod
    def forward(ctx, x, inverse, own, dim, group):
        ctx.dim = dim
        ctx.save_for_backward(own)
        local = x.movedim(dim, 0)
        gathered = _comm.all_gather_flat(local, group)
        full = gathered.reshape(-1, *local.shape[1:]).index_select(0, inverse)
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        (own,) = ctx.saved_tensors
        return grad.index_select(ctx.dim, own), None, None, None, None


def _signature(*parts) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


_GATHER_AGREEMENT = ("local token count", Field("dtype", checksum=True),
                     Field("other dimensions", checksum=True),
                     Field("cu_seqlens_padded", checksum=True))


def gather_from_context_parallel(
    x: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    *,
    cu_seqlens_padded: torch.Tensor | None = None,
    dim: int = 1,
    validate: bool = True,
) -> torch.Tensor:
    """Per-token values of all context-parallel ranks, back in packed order: the inverse of
    :func:`shard_for_context_parallel`.

    ``gather_from_context_parallel(shard_for_context_parallel(v, g, ...), g, ...)`` equals ``v``
    bitwise on every rank (values are only moved). Differentiable: the backward hands each rank
    the upstream gradient at its own positions, with no collective. That is the exact gradient
    when every cp rank computes the same function of the gathered tensor (a loss replicated over
    cp); summing parameter gradients over cp, as Megatron's data-parallel reduction over dp x cp
    does, then counts each token once.

    Args:
        x: this rank's shard, ``T / cp`` tokens along ``dim`` (e.g. logprobs ``[1, T/cp]``), any
            dtype; the same shape and dtype on every rank.
        cp_group: the context-parallel group; None (or size 1) returns ``x`` itself.
        cu_seqlens_padded: the global ``[N + 1]`` cumulative padded lengths used to shard, or
            None for the one-sequence (``[b, s]``) split.
        dim: the sequence dimension.
        validate: check ``cu_seqlens_padded`` (host read) and, with one all-gather of a few int64
            numbers, that all ranks agree on shard size, dtype, other dimensions and
            ``cu_seqlens_padded``, so that bad input raises on every rank instead of hanging.
            Skipped during CUDA graph capture. Must be equal on all ranks.

    Returns:
        ``[..., T, ...]`` (T = cp * local count along ``dim``), identical on every rank.

    Communication: one all-gather of ``x`` (plus one of 3 int64 with ``validate``); none in
    backward.

    Raises:
        ValueError: ``dim`` out of range, an odd local token count (T not a multiple of 2 cp);
            with ``validate``, bad ``cu_seqlens_padded`` (as in :func:`context_parallel_indices`)
            or shards that differ across ranks, on all ranks.
    """
    rank, cp = _comm.group_rank_size(cp_group)
    if cp == 1:
        _seq_dim(x, dim)
        return x
    device = x.device if isinstance(x, torch.Tensor) else None
    exchange = host_checks_enabled(validate, device or torch.device("cpu"))
    error, cu, row = None, None, [-1] * len(_GATHER_AGREEMENT)
    try:
        dim = _seq_dim(x, dim)
        total = x.shape[dim] * cp
        cu = _cp_layout(cu_seqlens_padded, total, cp, device, validate=validate,
                        what=f"x (dim {dim}, times cp_size={cp})")
        if exchange:
            others = x.shape[:dim] + x.shape[dim + 1:]
            row = [x.shape[dim], _signature(x.dtype), _signature(tuple(others)),
                   _signature(cu.tolist())]
    except Exception as exc:  # noqa: BLE001 - every local failure must reach the other ranks
        if not exchange:
            raise
        error = exc
    if exchange:
        agree_across_ranks(error, row, _GATHER_AGREEMENT, cp_group, device=device,
                           group_name="cp_group",
                           hint="every rank must pass its own shard of the same packed layout")
    positions = _cp_positions(cu, total, cp, torch.arange(cp, device=device)).reshape(-1)
    inverse = torch.zeros_like(positions).scatter_(
        0, positions, torch.arange(total, device=device))
    return _GatherFromContextParallel.apply(x, inverse, positions[rank * (total // cp):
                                                                  (rank + 1) * (total // cp)],
                                            dim, cp_group)


# ----------------------------------------------------------------------------- unpacking


def unpack_sequences(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int,
    cu_seqlens_padded: torch.Tensor | None = None,
    dim: int = -1,
    padding_value: float | int = 0,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed per-token values to a padded ``[B, S_max]`` batch plus its mask.

    Reference semantics (``s_i = cu_seqlens_padded[i]``, ``L_i`` the real lengths)::

        out[i, :L_i] = values[s_i:s_i + L_i];  out[i, L_i:] = padding_value
        mask = arange(S_max) < L[:, None]

    Differentiable w.r.t. ``values`` (gradient 0 at padding and at tokens past ``max_seqlen``).

    Args:
        values: per-token values with T packed tokens along ``dim`` (``[T]``, ``[1, T]``,
            ``[T, k]`` with ``dim=0``), any dtype.
        cu_seqlens: ``[N + 1]`` cumulative real lengths (ending at T when ``cu_seqlens_padded``
            is None).
        max_seqlen: S_max, a Python int (static shape; no device value is read for it).
        cu_seqlens_padded: ``[N + 1]`` cumulative padded lengths ending at T, or None.
        dim: the packed dimension; it becomes the two dimensions ``(N, S_max)``.
        padding_value: value at masked positions.
        validate: check the cumulative lengths and that no sequence exceeds ``max_seqlen``
            (host read; skipped during CUDA graph capture).

    Returns:
        ``(out, mask)``: ``out`` is ``values.shape[:dim] + (N, S_max) + values.shape[dim+1:]`` in
        the values' dtype; ``mask`` bool ``[N, S_max]``, True at real tokens.

    Raises:
        ValueError: bad shapes/dtypes, ``dim`` out of range, ``max_seqlen`` not a non-negative
            int, a ``padding_value`` that the values' dtype does not hold (a fraction or a value
            out of range for integer values, a non-number); with ``validate``, cumulative
            lengths not starting at 0, decreasing, not ending at T, a sequence longer than its
            padded length or than ``max_seqlen``.
    """
    dim = _seq_dim(values, dim, "values")
    padding_value = _fill_value("padding_value", padding_value, values.dtype)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    total = values.shape[dim]
    cu, cu_p = _cu_pair(cu_seqlens, cu_seqlens_padded, total, values.device, validate=validate)
    lengths = cu[1:] - cu[:-1]
    if host_checks_enabled(validate, values.device) and bool((lengths > max_seqlen).any()):
        raise ValueError(f"max_seqlen={max_seqlen} is shorter than the longest sequence "
                         f"({int(lengths.max())} tokens)")
    num = lengths.numel()
    pos = torch.arange(max_seqlen, device=values.device)
    mask = pos < lengths.unsqueeze(1)
    src = (cu_p[:-1].unsqueeze(1) + pos).clamp_(max=max(total - 1, 0)).reshape(-1)
    if total == 0:
        shape = values.shape[:dim] + (num * max_seqlen,) + values.shape[dim + 1:]
        picked = values.new_zeros(shape)
    else:
        picked = values.index_select(dim, src)
    out = picked.unflatten(dim, (num, max_seqlen))
    keep = mask.view((1,) * dim + mask.shape + (1,) * (values.dim() - dim - 1))
    return torch.where(keep, out, out.new_full((), padding_value)), mask
