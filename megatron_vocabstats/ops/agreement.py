"""Cross-rank agreement of input checks, for the ops' checks and the packages above ``ops/``:
every rank decides locally, then one small int64 all-gather (an error flag, then values that
must be equal on every rank) makes a bad input on one rank raise on every rank instead of
leaving the others waiting in a collective (docs/checks.md).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import version_check
from . import _comm
from ._argtypes import check_int64
from .workspace import tracing

__all__ = [
    "CrossRankCheck",
    "Field",
    "agree_across_ranks",
    "agree_field",
    "as_field",
    "bits_float",
    "checked_on_every_rank",
    "float_bits",
    "host_checks_enabled",
    "target_checksum",
    "tensor_checksum",
]


def host_checks_enabled(validate: bool, device: torch.device) -> bool:
    """True when value checks may read tensors on the host: with ``validate``, never during
    CUDA graph capture nor while a tracer runs the call (:func:`tracing`)."""
    if not validate:
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    return not tracing()


def target_checksum(target: torch.Tensor | None) -> int:
    """An int64 checksum of the integer ``target`` (token ids; -1 for None): each value weighted
    by a hash of its flat position, summed in int64 (wrapping); reads the host."""
    if target is None:
        return -1
    flat = target.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
    weights = (weights * 2654435761) % 2147483647
    return int((flat * weights).sum())


def tensor_checksum(tensor: torch.Tensor, where: torch.Tensor | None = None) -> int:
    """An int64 checksum of ``tensor``'s values (floats by their fp32 bits) at the positions
    where the bool ``where`` (broadcast over trailing dims) holds; reads the host."""
    values = tensor.detach()
    if values.dtype.is_floating_point:
        values = values.float().contiguous().view(torch.int32)
    if where is not None:
        keep = where.reshape(*where.shape, *([1] * (values.dim() - where.dim())))
        values = torch.where(keep, values, 0)
    return target_checksum(values)


def float_bits(x: float) -> int:
    """The bits of ``x`` as a float64, as an int64 (a float compared in the agreement exchange;
    :func:`bits_float` prints it back)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(bits: int) -> float:
    """Inverse of :func:`float_bits`."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True, slots=True)
class Field:
    """One compared column of :func:`agree_across_ranks`: ``show`` maps the exchanged int to the
    value printed per rank; ``checksum=True`` prints only the ranks that differ from rank 0."""

    name: str
    show: Callable[[int], object] = int
    checksum: bool = False

    def difference(self, seen: list[int], group_name: str) -> str:
        if self.checksum:
            ranks = [r for r, v in enumerate(seen) if v != seen[0]]
            return (f"{self.name} differs across the ranks of {group_name}: ranks {ranks} "
                    "differ from rank 0")
        return (f"{self.name} differs across the ranks of {group_name}: "
                f"{[self.show(v) for v in seen]} (in rank order)")


def as_field(name) -> Field:
    """``name`` as a :class:`Field` (a string becomes ``Field(name)``)."""
    return name if isinstance(name, Field) else Field(str(name))


def agree_field(entry) -> Field:
    """The :class:`Field` of an ``agree=...`` entry: ``(name, value_fn)`` or
    ``(name, value_fn, show)``, the name a string or a :class:`Field`."""
    field = as_field(entry[0])
    if len(entry) > 2:
        field = Field(field.name, show=entry[2], checksum=field.checksum)
    return field


def agree_across_ranks(error: Exception | None, values: list[int] | None,
                       names: tuple[str | Field, ...], group: dist.ProcessGroup, *, device=None,
                       group_name: str, hint: str, extra: int = 0) -> list[list[int]]:
    """Make a local input error, or a disagreement between ranks, raise on every rank.

    One all-gather of ``[error flag, *values]`` (int64) over ``group``: this rank re-raises its
    own ``error``, the others raise a ``ValueError`` naming the ranks that rejected their inputs;
    else the first of ``names`` (strings or :class:`Field`) whose value differs raises with
    ``hint``. ``values`` (int64; None when ``error`` is set) ends with ``extra`` columns that are
    exchanged, not compared. ``device`` None: the group backend's (``_comm.exchange_device``).
    Returns every rank's row (flag first).
    """
    fields = tuple(as_field(name) for name in names)
    if device is None:
        device = _comm.exchange_device(group)
    row = values if values is not None else [-1] * (len(fields) + extra)
    table = _comm.all_gather_ints([int(error is not None), *row], group, device=device)
    if error is not None:
        raise error
    failed = [r for r, t in enumerate(table) if t[0]]
    if failed:
        raise ValueError(f"ranks {failed} of {group_name} rejected their inputs (see their errors)")
    for col, field in enumerate(fields, start=1):
        seen = [t[col] for t in table]
        if any(v != seen[0] for v in seen):
            raise ValueError(f"{field.difference(seen, group_name)}; {hint}")
    return table


class CrossRankCheck:
    """One call's rank-local checks, made to raise on every rank of ``group``.

    Collects this rank's first problem (from a check run by :meth:`run`, or handed to
    :meth:`fail`) and its row of values to agree on; :meth:`finish` does the single exchange
    (:func:`agree_across_ranks` over ``fields`` and ``extra``). The exchange runs (``enabled``)
    only with ``validate`` on a group of size > 1, outside CUDA graph capture and tracing;
    otherwise problems raise on this rank only, with no collective and no host read. Raises
    :class:`InputTypeError` if ``group`` is neither a ``ProcessGroup`` nor None.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, validate, device: torch.device | None,
                 hint: str, fields: tuple[str | Field, ...] = (), extra: int = 0,
                 group_name: str = "tp_group"):
        if not version_check.op_checked and not tracing():  # the first op call of the process
            version_check.at_first_op()
        _, self.size = _comm.group_rank_size(group)
        self.enabled = self.size > 1 and host_checks_enabled(
            validate, device or _comm.exchange_device(group))
        self.group, self.device, self.hint, self.group_name = group, device, hint, group_name
        self.fields, self.extra = tuple(as_field(name) for name in fields), extra
        self.error: Exception | None = None
        self.row: list[int] | None = None

    def fail(self, error: Exception | None) -> None:
        """Record a problem this rank found itself (None: none); the first problem is kept."""
        if self.error is None:
            self.error = error

    def run(self, check: Callable[[], object],
            row: Callable[[object], list[int]] | None = None) -> object:
        """``check()`` and, when the exchange runs, ``row(result)`` (this rank's int64 values of
        ``fields`` then ``extra``); returns ``check``'s result, or None once a problem is recorded
        (with the exchange an exception is recorded for :meth:`finish`; without, it raises)."""
        if self.error is not None:
            return None
        try:
            result = check()
            if self.enabled and row is not None:
                self.row = list(row(result))
        except Exception as exc:  # every local failure must reach the other ranks
            if not self.enabled:
                raise
            self.error = exc
            return None
        return result

    def finish(self) -> list[list[int]] | None:
        """The single exchange: raises, or returns every rank's row (flag first), or None when
        the exchange does not run."""
        if not self.enabled:
            if self.error is not None:
                raise self.error
            return None
        return agree_across_ranks(self.error, self.row, self.fields, self.group,
                                  device=self.device, group_name=self.group_name, hint=self.hint,
                                  extra=self.extra)


def checked_on_every_rank(check: Callable[[], object], tp_group: dist.ProcessGroup | None, *,
                          validate: bool, device: torch.device | None,
                          agree: tuple[tuple, ...] = (), hint: str) -> object:
    """``check()`` (a caller's input checks, run before any collective), made to raise on every
    rank of ``tp_group``; returns what it returns.

    With the exchange (as :class:`CrossRankCheck`) it costs one all-gather of
    ``1 + len(agree)`` int64; ``agree`` entries are ``checked_config``'s, but ``value_fn`` takes
    what ``check`` returned.
    """
    checks = CrossRankCheck(tp_group, validate=validate, device=device, hint=hint,
                            fields=tuple(agree_field(entry) for entry in agree))
    result = checks.run(check, row=lambda result: [
        check_int64(agree_field(entry).name, entry[1](result)) for entry in agree])
    checks.finish()
    return result
