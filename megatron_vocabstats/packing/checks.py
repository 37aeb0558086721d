"""Argument checks of the packing functions (shapes always, values with ``validate``)."""

from __future__ import annotations

import torch

from ..ops.agreement import host_checks_enabled
from ..ops.options import bool_error, check_number

INT64_MAX = 2**63 - 1


def _count(value, name: str, low: int = 1) -> int:
    """``value`` as an int in ``[low, 2**63 - 1]``, else an error naming ``name``."""
    return check_number(name, value, integer=True, low=low, high=INT64_MAX)


def _positive_int(value, name: str) -> int:
    return _count(value, name)


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
    """Host-read checks: from 0, non-decreasing, to ``total``, steps multiples of ``multiple``."""
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
    """Checked int64 ``(cu_seqlens, cu_seqlens_padded)`` of a row of ``total`` tokens; the padded
    one is ``cu_seqlens`` itself when None (which must then end at ``total``)."""
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
    try:
        dim = check_number("dim", dim, integer=True, low=-x.dim(), high=x.dim(), high_open=True)
    except ValueError:
        raise ValueError(f"dim={dim!r} is not a dimension of {name} with shape "
                         f"{tuple(x.shape)}") from None
    return dim % x.dim()


def _fill_value(name: str, value, dtype: torch.dtype) -> int | float | bool:
    """``value`` as a number ``dtype`` holds, else ``ValueError`` naming ``name`` (torch would wrap
    or truncate it: -100 to 156 in uint8, -0.5 to 0 in int64)."""
    if dtype == torch.bool:  # a bool, or the int 0 or 1
        if bool_error(name, value) is None:
            return bool(value)
        return bool(check_number(f"{name} (for bool values)", value, integer=True, low=0, high=1))
    if dtype.is_floating_point:
        top = torch.finfo(dtype).max
        return check_number(f"{name} (for {dtype} values)", value, low=-top, high=top,
                            finite=False)
    info = torch.iinfo(dtype)
    try:
        return check_number(name, value, integer=True, low=info.min, high=info.max)
    except ValueError as exc:
        raise type(exc)(f"{exc}: the dtype {dtype} holds [{info.min}, {info.max}] (use wider "
                        "token ids, e.g. int64)") from None
