"""Input checks of the top-k ops: ``indices``, ``mask`` and ``k`` and the cross-rank agreement
on them. Problems are returned, not raised, for the core checks' one cross-rank exchange
(``_checks.checked_config(local_error=..., agree=...)``) to raise on every rank.
"""

from __future__ import annotations

import numbers

import torch

from .. import _comm
from .._argtypes import InputTypeError, check_bool, check_number
from .._checks import checked_config
from ..agreement import Field, host_checks_enabled, target_checksum

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def index_problem(indices, mask, lead_shape, device, vocab_size: int | None,
                  host_checks: bool) -> ValueError | None:
    """The first problem with ``indices`` ``[*lead_shape, k]`` and ``mask`` ``lead_shape``, or None;
    with ``host_checks`` also ids at unmasked rows outside ``[0, vocab_size)``."""
    if not isinstance(indices, torch.Tensor):
        return InputTypeError(f"indices must be an int64 tensor [..., k], got "
                              f"{type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        return ValueError(f"indices must hold integer token ids (int64), got {indices.dtype}")
    if indices.dim() < 1 or indices.shape[-1] < 1 or tuple(indices.shape[:-1]) != tuple(lead_shape):
        return ValueError(f"indices shape {tuple(indices.shape)} must be [..., k] with k >= 1 and "
                          f"leading shape {tuple(lead_shape)} (that of the logits)")
    if indices.device != device:
        return ValueError(f"indices is on {indices.device} but the logits on {device}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(lead_shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            return ValueError(f"mask must be a tensor shaped {tuple(lead_shape)}, got {got}")
        if mask.device != device:
            return ValueError(f"mask is on {mask.device} but the logits on {device}")
    if host_checks and isinstance(vocab_size, int) and indices.numel():
        rows = indices.reshape(-1, indices.shape[-1]).long()
        bad = (rows < 0) | (rows >= vocab_size)
        if mask is not None:
            bad &= mask.reshape(-1, 1) != 0
        if bool(bad.any()):
            value = int(rows[bad][0])
            return ValueError(f"indices holds id {value}, outside [0, vocab_size={vocab_size}) at "
                              "an unmasked position (teacher and student must share the "
                              "vocabulary)")
    return None


def k_problem(k, vocab_size: int) -> ValueError | None:
    """A ``ValueError`` for a ``k`` that is not an int in ``[1, vocab_size]``, else None."""
    try:
        check_number("k", k, integer=True, low=1, high=vocab_size)
    except ValueError as exc:
        return type(exc)(f"{exc} (1 <= k <= vocab_size={vocab_size})")
    return None


def real_vocab(width: int, tp_group, vocab_size) -> int | None:
    """``vocab_size``, or ``width * tp`` when None (None if it is not an int or the shard is
    empty: the core checks then name it)."""
    if width == 0:
        return None
    if vocab_size is None:
        return width * _comm.group_rank_size(tp_group)[1]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        return None
    return int(vocab_size)  # any integral number, as the core checks accept (numpy ints too)


def agreement(k, indices=None, mask=None) -> tuple:
    """``checked_config(agree=...)`` pairs: ``k`` (a callable or an int), and with ``indices``
    checksums of ``mask != 0`` and of the ids at unmasked rows, computed only in the exchange."""
    pairs = [("k", k if callable(k) else (lambda: k))]
    if indices is not None:
        def keep():
            return valid_rows(mask, indices.numel() // indices.shape[-1], indices.device)

        def ids():
            return torch.where(keep().view(*indices.shape[:-1], 1), indices.long(), -1)

        pairs += [(Field("mask", checksum=True), lambda: target_checksum(keep())),
                  (Field("indices", checksum=True), lambda: target_checksum(ids()))]
    return tuple(pairs)


def valid_rows(mask, num_tokens: int, device) -> torch.Tensor:
    """``mask != 0`` flattened to ``[T]`` bool (all True for None)."""
    if mask is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    return mask.reshape(-1) != 0


def picked_config(logits, indices, mask, tp_group, *, vocab_size=None, validate=True,
                  **options):
    """``(StatsConfig, valid rows [T])`` of an op reading the logits at ``indices``, checked
    (:func:`index_problem`, :func:`agreement`) through the core checks' exchange."""
    problem = None
    if isinstance(logits, torch.Tensor) and logits.dim():  # else the core checks name logits
        try:
            problem = index_problem(indices, mask, logits.shape[:-1], logits.device,
                                    real_vocab(logits.shape[-1], tp_group, vocab_size),
                                    host_checks_enabled(check_bool("validate", validate),
                                                        logits.device))
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the core exchange
            problem = exc
    cfg = checked_config(logits, None, tp_group, local_error=problem,
                         agree=agreement(lambda: indices.shape[-1], indices, mask),
                         vocab_size=vocab_size, entropy="off", kernel="torch",
                         validate=validate, **options)
    return cfg, valid_rows(mask, logits.numel() // cfg.layout.width, logits.device)
