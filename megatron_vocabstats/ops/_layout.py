"""Where a rank's logits columns sit in the global vocabulary, and where its targets fall.

Pure host logic and elementwise tensor ops, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._argtypes import check_integer

# Columns per block of the batch-invariant reductions: Megatron pads the vocabulary to a multiple
# of 128 * tp, so blocks never straddle two shards.
BLOCK = 128
# Token ids are int32-ranked in the top-k keys: no vocabulary (or shard start) beyond it.
MAX_ID = 2**31


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where this rank's logits columns sit in the global vocabulary.

    ``vocab_start``: global id of local column 0; ``width``: local (padded) width W;
    ``real_width``: local columns with global id < ``vocab_size``, the real global size V (the
    rest are padding); ``even``: rank r holds ``[r * W, (r + 1) * W)`` (Megatron's split), else
    ranges given per rank (``vocab_start``, e.g. torchtitan's ``ceil(V / tp)`` split)."""

    vocab_start: int
    width: int
    real_width: int
    vocab_size: int
    even: bool = True


def padded_width(width: int, batch_invariant: bool) -> int:
    """Columns of the fp32 chunk buffer: ``width``, rounded up to whole blocks of :data:`BLOCK`
    in batch-invariant mode."""
    return -(-width // BLOCK) * BLOCK if batch_invariant else width


def shard_layout(width: int, rank: int, tp: int, vocab_size: int | None,
                 vocab_start: int | None = None) -> ShardLayout:
    """The :class:`ShardLayout` of rank ``rank`` of ``tp`` shards, this one ``width`` columns.

    Without ``vocab_start``: equal shards, rank r from ``r * width`` (Megatron), the padding
    (global columns ``>= vocab_size``) possibly filling whole shards. With it: this shard holds
    ``[vocab_start, vocab_start + width)``, ``vocab_size`` required (contiguity is checked across
    ranks by ``checked_config``). Raises ``ValueError`` if ``width`` is 0, ``vocab_size`` is
    outside ``[1, width * tp]`` (even shards; ``[1, 2**31]`` with ``vocab_start``), or
    ``vocab_start`` outside ``[0, 2**31)`` or without ``vocab_size``; :class:`InputTypeError` for
    a non-int."""
    if width == 0:
        raise ValueError("logits: the vocabulary dimension (last) is empty: every rank must hold "
                         "a non-empty vocabulary shard")
    if vocab_start is not None:
        start = check_integer("vocab_start", vocab_start)
        if vocab_size is None:
            raise ValueError("vocab_start needs vocab_size: with ranges given per rank the real "
                             "vocabulary size cannot be derived from one shard's width")
        vocab_size = check_integer("vocab_size", vocab_size)
        if not (0 <= start < MAX_ID and 1 <= vocab_size <= MAX_ID):
            raise ValueError(f"vocab_start={start} and vocab_size={vocab_size} must satisfy "
                             f"0 <= vocab_start < 2**31 and 1 <= vocab_size <= 2**31")
        real = max(0, min(width, vocab_size - start))
        return ShardLayout(vocab_start=start, width=width, real_width=real,
                           vocab_size=vocab_size, even=False)
    padded = width * tp
    vocab_size = padded if vocab_size is None else check_integer("vocab_size", vocab_size)
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit {tp} shard(s) of width {width}: it must lie in "
            f"[1, {padded}] (the shards hold the padded vocabulary; pass vocab_start for shards "
            "of unequal widths)"
        )
    start = rank * width
    real = max(0, min(width, vocab_size - start))
    return ShardLayout(vocab_start=start, width=width, real_width=real, vocab_size=vocab_size)


def check_contiguous(starts: list[int], widths: list[int], vocab_size: int) -> None:
    """``ValueError`` unless the shards ``[starts[r], starts[r] + widths[r])`` tile
    ``[0, end)`` in rank order with ``end >= vocab_size`` (ranges given with ``vocab_start``)."""
    ends = [s + w for s, w in zip(starts, widths)]
    if starts[0] == 0 and all(starts[r] == ends[r - 1] for r in range(1, len(starts))) \
            and ends[-1] >= vocab_size:
        return
    ranges = ", ".join(f"rank {r}: [{s}, {e})" for r, (s, e) in enumerate(zip(starts, ends)))
    raise ValueError(f"vocab_start: the shards must cover [0, vocab_size={vocab_size}) in rank "
                     f"order without gaps or overlaps, got {ranges}")


def target_in_range(target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[T]`` bool: the target id lies in ``[0, vocab_size)`` (no host sync). Other rows not
    ignored get a NaN logprob and no logprob gradient (``merge_stats``, ``grad_coefficients``)."""
    return (target >= 0) & (target < vocab_size)


def local_target_index(target: torch.Tensor, valid: torch.Tensor, layout: ShardLayout):
    """Map global target ids to local columns: ``(index clamped to [0, W), owned mask)``."""
    local = target.long() - layout.vocab_start  # gather/scatter index with int64
    owned = valid & (local >= 0) & (local < layout.width)
    return local.clamp(0, layout.width - 1), owned


def put_first_max_ids(z: torch.Tensor, out: torch.Tensor, vocab_start: int) -> None:
    """Write the global id of the first maximum of each row of ``z`` ``[n, W]`` (or each block of
    ``[n, nb, BLOCK]``) into the fp32 statistics row ``out`` ``[n]`` (``[n, nb]``) as int32 bits:
    bit-cast, not converted, so every id below :data:`MAX_ID` survives the all-gather exactly
    (an fp32 value stops at 2**24). Ties go to the lowest column, as ``torch.argmax``."""
    ids = z.argmax(dim=-1)
    if z.dim() == 3:
        ids = ids + torch.arange(z.shape[1], device=z.device) * z.shape[2]
    out.view(torch.int32).copy_(ids + vocab_start)


def merge_first_max(maxima: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64 ``torch.argmax`` of each whole row (ties to the lowest id; -1 where the
    maximum is NaN) from parts covering the columns: their ``maxima`` ``[P, T]`` fp32 (-inf: no
    live column) and :func:`put_first_max_ids` rows ``ids`` ``[P, T]``. The lowest id among the
    parts whose maximum equals the row's (exact comparisons)."""
    top = maxima.amax(dim=0)
    candidates = torch.where(maxima == top, ids.view(torch.int32).long(), MAX_ID)
    best = candidates.amin(dim=0)
    return torch.where(best == MAX_ID, -1, best)
