"""Input checks and the frozen option bundle of the vocab-parallel ops.

Shape, dtype and argument checks always run. Checks that read tensor values on the host (target
range, cross-rank agreement, finite results) run only with ``validate=True`` and never while a CUDA
graph is being captured. Under tensor parallelism every rank first decides locally, then all ranks
exchange one small int64 vector (sizes, a target checksum and an error flag) so that a bad input on
one rank raises on every rank instead of leaving the others waiting in a collective. Every
exception of the local checks (not only ``ValueError``) goes through that exchange.

Wrong Python types raise :class:`InputTypeError`, a ``TypeError`` that is also a ``ValueError``.
Backward functions call :func:`refuse_double_backward` (or use :func:`first_order_backward`).
"""

from __future__ import annotations

import functools
import math
import numbers
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _comm
from ._math import BLOCK, ShardLayout

ENTROPY_MODES = ("off", "metric", "grad")
# Values of ``batch_invariant``: off, batch-invariant, batch- and tensor-parallel-invariant.
BATCH_INVARIANT_MODES = (False, True, "tp")

# Auto chunking: each of the two fp32 [chunk, W] buffers is about this size. On CPU a few MiB
# keeps them in cache (every pass over a chunk after the first is a cache hit, and no fresh pages
# are faulted in); on GPU larger chunks amortise kernel launches.
CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def auto_chunk_size(width: int, device: torch.device) -> int:
    """Tokens per chunk used when ``chunk_size=None``: ``CHUNK_BYTES[device] // (4 * width)``."""
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * width))


LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max
# The logits and their gradient are scaled by 1/temperature in fp32: below this it overflows.
MIN_TEMPERATURE = 1.0 / FP32_MAX
_INT64 = (-(2**63), 2**63 - 1)
# Token ids are int32-ranked in the top-k keys: no vocabulary (or shard start) beyond it.
_MAX_ID = 2**31


class InputTypeError(TypeError, ValueError):
    """An argument of the wrong Python type. A ``TypeError``, and a ``ValueError`` too, so that
    code catching the ops' ``ValueError`` for bad input catches it as well."""


def check_integer(name: str, value) -> int:
    """``value`` as an int (any integral number but a bool), else :class:`InputTypeError`
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def check_real(name: str, value) -> float:
    """``value`` as a float (any real number but a bool; not a tensor), else
    :class:`InputTypeError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name} must be a real number (a Python float), got {value!r} "
                             f"({type(value).__name__})")
    return float(value)


def refuse_double_backward(op: str) -> None:
    """Raise ``RuntimeError`` when called from a backward that builds a graph.

    The ops' backward functions are hand-written closed forms that are not themselves
    differentiable; under ``create_graph=True`` (the only time autograd runs a backward with grad
    mode on) the second-order term would otherwise be dropped without a word.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op} does not support double backward (create_graph=True): its backward is a "
            "closed form that is not itself differentiable, so second-order terms would be "
            "silently wrong. Call backward / torch.autograd.grad without create_graph=True")


def first_order_backward(op: str):
    """Decorator for an autograd Function's ``backward`` (in place of ``once_differentiable``):
    :func:`refuse_double_backward` first, so the backward then always runs with grad mode off."""
    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            refuse_double_backward(op)
            return backward(ctx, *grads)
        return checked
    return wrap


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsConfig:
    """Options of one call, validated; passed to the autograd Function as a single argument."""

    layout: ShardLayout
    chunk_size: int
    entropy: str
    temperature: float
    ignore_index: int
    label_smoothing: float
    validate: bool
    batch_invariant: bool | str = False


def host_checks_enabled(validate: bool, device: torch.device) -> bool:
    """True when value checks may read tensors on the host (never during CUDA graph capture)."""
    if not validate:
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def shard_layout(width: int, rank: int, tp: int, vocab_size: int | None,
                 vocab_start: int | None = None) -> ShardLayout:
    """The :class:`ShardLayout` of rank ``rank`` of ``tp`` shards of which this one is ``width``
    columns wide.

    Without ``vocab_start`` the shards are equal and rank r starts at ``r * width`` (Megatron).
    The padding (global columns ``>= vocab_size``) may fill whole shards, as Megatron's padding to
    a multiple of ``make_vocab_size_divisible_by * tp`` does for small vocabularies. With
    ``vocab_start`` this shard holds ``[vocab_start, vocab_start + width)`` and ``vocab_size`` is
    required (the shards' contiguity is checked across ranks in :func:`checked_config`). Raises
    ``ValueError`` if ``width`` is 0, ``vocab_size`` is not in ``[1, width * tp]`` (even shards),
    ``vocab_start`` is negative or comes without ``vocab_size``; :class:`InputTypeError` if either
    is not an int.
    """
    if width == 0:
        raise ValueError("logits: the vocabulary dimension (last) is empty: every rank must hold "
                         "a non-empty vocabulary shard")
    if vocab_start is not None:
        start = check_integer("vocab_start", vocab_start)
        if vocab_size is None:
            raise ValueError("vocab_start needs vocab_size: with ranges given per rank the real "
                             "vocabulary size cannot be derived from one shard's width")
        vocab_size = check_integer("vocab_size", vocab_size)
        if not (0 <= start < _MAX_ID and 1 <= vocab_size <= _MAX_ID):
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


# The flag's spellings (--vocab-stats-batch-invariant off|batch|tp) are accepted as well.
_BATCH_INVARIANT_NAMES = {"off": False, "batch": True, "tp": "tp"}


def check_batch_invariant(value) -> bool | str:
    """``value`` as one of False, True, ``"tp"`` (``"off"``/``"batch"`` map to False/True), else
    ``ValueError``."""
    if value is True or value is False:
        return value
    if isinstance(value, str) and value in _BATCH_INVARIANT_NAMES:
        return _BATCH_INVARIANT_NAMES[value]
    raise ValueError(f"batch_invariant must be False, True or 'tp' (or 'off', 'batch'), "
                     f"got {value!r}")


def _batch_invariant_mode(value, width: int, tp: int, even: bool = True):
    value = check_batch_invariant(value)
    if value == "tp" and not even:
        raise ValueError("batch_invariant='tp' needs equal shards (Megatron's split): with "
                         "vocab_start the ranks' blocks of columns do not line up")
    if value == "tp" and tp > 1 and width % BLOCK:
        raise ValueError(
            f"batch_invariant='tp' needs a vocabulary shard width that is a multiple of {BLOCK} "
            f"under tensor parallelism (got {width}, tp={tp}): pad the vocabulary to a multiple "
            f"of {BLOCK} * tp, as Megatron's make_vocab_size_divisible_by=128 does"
        )
    return value


def _check_local(logits, target, tp_group, *, vocab_size, chunk_size, entropy, temperature,
                 ignore_index, label_smoothing, validate, batch_invariant=False,
                 vocab_start=None) -> StatsConfig:
    if not isinstance(logits, torch.Tensor):
        raise InputTypeError(f"logits must be a tensor [..., V/tp], got {type(logits).__name__}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary, last)")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: the vocabulary dimension (last) is empty (shape "
                         f"{tuple(logits.shape)}): every rank must hold a non-empty shard")
    if not isinstance(validate, bool):
        raise InputTypeError(f"validate must be a bool, got {validate!r}")
    if target is not None:
        if not isinstance(target, torch.Tensor):
            raise InputTypeError(f"target must be an int64 tensor, got {type(target).__name__}")
        if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
            raise ValueError(f"target must hold integer token ids (int64), got {target.dtype}")
        if target.shape != logits.shape[:-1]:
            raise ValueError(
                f"target shape {tuple(target.shape)} must equal the leading shape of logits "
                f"{tuple(logits.shape[:-1])}"
            )
        if target.device != logits.device:
            raise ValueError(f"target is on {target.device} but logits on {logits.device}")
    if chunk_size is None:
        chunk_size = auto_chunk_size(logits.shape[-1], logits.device)
    if check_integer("chunk_size", chunk_size) <= 0:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if not isinstance(entropy, str) or entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    temperature = check_real("temperature", temperature)
    if not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        raise ValueError(
            f"temperature must be a finite number >= {MIN_TEMPERATURE:.3g} (the logits and "
            f"their gradient are scaled by 1/temperature in fp32), got {temperature!r}")
    label_smoothing = check_real("label_smoothing", label_smoothing)
    if not (0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing!r}")
    ignore_index = check_integer("ignore_index", ignore_index)
    if not _INT64[0] <= ignore_index <= _INT64[1]:
        raise ValueError(f"ignore_index must fit int64, got {ignore_index}")
    rank, tp = _comm.group_rank_size(tp_group)
    layout = shard_layout(logits.shape[-1], rank, tp, vocab_size, vocab_start)
    if tp == 1 and not layout.even:
        check_contiguous([layout.vocab_start], [layout.width], layout.vocab_size)
    cfg = StatsConfig(
        batch_invariant=_batch_invariant_mode(batch_invariant, logits.shape[-1], tp, layout.even),
        layout=layout,
        chunk_size=int(chunk_size),
        entropy=entropy,
        temperature=temperature,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        validate=validate,
    )
    if host_checks_enabled(cfg.validate, logits.device) and target is not None:
        bad = (target != cfg.ignore_index) & ((target < 0) | (target >= cfg.layout.vocab_size))
        if bool(bad.any()):
            value = int(target[bad].reshape(-1)[0])
            raise ValueError(
                f"target holds id {value}, outside [0, vocab_size={cfg.layout.vocab_size}) and "
                f"not ignore_index={cfg.ignore_index}"
            )
    return cfg


def _target_checksum(target: torch.Tensor | None) -> int:
    if target is None:
        return -1
    flat = target.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
    weights = (weights * 2654435761) % 2147483647
    return int((flat * weights).sum())


def float_bits(x: float) -> int:
    """The bits of ``x`` as a float64, as an int64 (a float compared in the agreement exchange;
    :func:`bits_float` prints it back)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(bits: int) -> float:
    """Inverse of :func:`float_bits`."""
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True, slots=True)
class Field:
    """One compared column of :func:`agree_across_ranks` and how a difference is reported.

    ``show`` maps the exchanged int back to the value printed for each rank (default: the int);
    ``checksum=True`` prints no values (they are meaningless hashes), only the ranks whose value
    differs from rank 0's.
    """

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


_AGREEMENT = (
    Field("vocab_start", show=lambda given: "given" if given else None),
    Field("logits shard width"), Field("token count"), Field("vocab_size"),
    Field("logits dtype", show=LOGITS_DTYPES.__getitem__),
    Field("target (token ids)", checksum=True),
    Field("entropy mode", show=ENTROPY_MODES.__getitem__),
    Field("ignore_index"),
    Field("temperature", show=bits_float),
    Field("label_smoothing", show=bits_float),
    Field("batch_invariant", show=BATCH_INVARIANT_MODES.__getitem__),
)


def _as_field(name) -> Field:
    return name if isinstance(name, Field) else Field(str(name))


def agree_across_ranks(error: Exception | None, values: list[int] | None,
                       names: tuple[str | Field, ...], group: dist.ProcessGroup, *, device=None,
                       group_name: str, hint: str, extra: int = 0) -> list[list[int]]:
    """Make a local input error, or a disagreement between ranks, raise on every rank.

    One all-gather of ``[error flag, *values]`` (int64) over ``group``: this rank re-raises its
    own ``error`` (any exception); the others raise a ``ValueError`` naming the ranks that
    rejected their inputs; otherwise the first of ``names`` whose value differs across ranks is
    reported with ``hint``. A name is a string (the ints are printed) or a :class:`Field` (printed
    through its ``show``, or as a checksum). ``values`` may be None when ``error`` is set; its
    last ``extra`` columns are exchanged but not compared; each must fit int64. ``device``: where
    the exchange runs; None picks it from the group's backend (``_comm.exchange_device``).
    Returns the table of every rank's row (flag first).
    """
    fields = tuple(_as_field(name) for name in names)
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


def _agree_field(entry) -> Field:
    """The :class:`Field` of a ``checked_config(agree=...)`` entry: ``(name, value_fn)`` or
    ``(name, value_fn, show)``, the name a string or a :class:`Field`."""
    field = _as_field(entry[0])
    if len(entry) > 2:
        field = Field(field.name, show=entry[2], checksum=field.checksum)
    return field


def _int64(name: str, value) -> int:
    value = int(value)
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{name}={value} does not fit int64")
    return value


def _agreement_row(logits, target, cfg: StatsConfig, agree) -> list[int]:
    """This rank's values of :data:`_AGREEMENT`, then of ``agree``, then the replicated-logits
    sample (see :func:`checked_config`)."""
    layout = cfg.layout
    row = [
        int(not layout.even),
        layout.width if layout.even else -1,  # ranges given per rank: checked for contiguity
        logits.numel() // layout.width,
        layout.vocab_size,
        LOGITS_DTYPES.index(logits.dtype),
        _target_checksum(target),
        ENTROPY_MODES.index(cfg.entropy),
        cfg.ignore_index,
        float_bits(cfg.temperature),
        float_bits(cfg.label_smoothing),
        BATCH_INVARIANT_MODES.index(cfg.batch_invariant),
        *(_int64(_agree_field(entry).name, entry[1]()) for entry in agree),
    ]
    sample = 0
    if _ambiguous(logits, cfg):
        first_row = logits.detach().reshape(-1, layout.width)[0]
        sample = float_bits(float(first_row.double().sum()))
    return [*row, sample, layout.vocab_start, layout.width]


def _ambiguous(logits, cfg: StatsConfig) -> bool:
    # A shard as wide as the real vocabulary may be a Megatron shard (small vocabulary, whole
    # shards of padding) or the full logits replicated on every rank: the first row tells (equal
    # on every rank only if replicated, or if that row is constant). The fused op passes a
    # stride-0 stand-in with no data: nothing to sample there.
    return (cfg.layout.width >= cfg.layout.vocab_size and logits.numel() > 0
            and logits.stride(-1) != 0)


def _truthy(value) -> bool:
    try:
        return bool(value)
    except Exception:  # noqa: BLE001 - e.g. a tensor of several values: rejected by the checks
        return True


def checked_config(logits, target, tp_group: dist.ProcessGroup | None, *,
                   local_error: Exception | None = None,
                   agree: tuple[tuple, ...] = (),
                   **options) -> StatsConfig:
    """Validate the inputs of one call and return its :class:`StatsConfig`.

    Raises ``ValueError`` (:class:`InputTypeError` for wrong Python types) naming the argument
    (see :func:`vocab_parallel_stats`). With ``validate`` on a group of size > 1, costs one
    all-gather of a few int64 numbers, through which an error on one rank (any exception of its
    own checks, e.g. a list passed as ``logits`` or an empty shard, or ``local_error`` found by a
    caller such as the fused op) raises on every rank. ``agree``: a caller's own
    ``(name, value_fn)`` or ``(name, value_fn, show)`` entries that must be equal on every rank,
    compared in that same all-gather (``value_fn()`` returns an int and is called only there,
    when this rank's checks passed; e.g. ``k`` and id checksums of the top-k ops); ``name`` may
    be a :class:`Field` (e.g. ``Field("indices", checksum=True)``), ``show`` maps the int back to
    the value printed in the error.
    """
    _, tp = _comm.group_rank_size(tp_group)
    device = logits.device if isinstance(logits, torch.Tensor) else None
    exchange = tp > 1 and host_checks_enabled(
        _truthy(options.get("validate")), device or _comm.exchange_device(tp_group))
    error, cfg, row = local_error, None, None
    if error is None:
        try:
            cfg = _check_local(logits, target, tp_group, **options)
            if exchange:
                row = _agreement_row(logits, target, cfg, agree)
        except Exception as exc:  # every local failure must reach the other ranks
            if not exchange:
                raise
            error = exc
    if not exchange:
        if error is not None:
            raise error
        return cfg
    names = _AGREEMENT + tuple(_agree_field(entry) for entry in agree)
    table = agree_across_ranks(error, row, names, tp_group, device=device,
                               group_name="tp_group",
                               hint="every tensor-parallel rank must pass the same tokens, "
                               "targets and options, and its own equal-width vocabulary shard",
                               extra=3)
    if not cfg.layout.even:
        check_contiguous([r[-2] for r in table], [r[-1] for r in table], cfg.layout.vocab_size)
    if _ambiguous(logits, cfg) and all(r[-3] == table[0][-3] for r in table):
        raise ValueError(
            f"logits: every rank of the tp={tp} group holds the same [..., {cfg.layout.width}] "
            f"logits, as wide as vocab_size={cfg.layout.vocab_size}: pass this rank's vocabulary "
            "shard [..., V/tp], not the full replicated logits"
        )
    return cfg


def checked_on_every_rank(check: Callable[[], object], tp_group: dist.ProcessGroup | None, *,
                          validate: bool, device: torch.device | None,
                          agree: tuple[tuple, ...] = (), hint: str) -> object:
    """``check()`` (a caller's own input checks, run before any collective of the call), made to
    raise on every rank of ``tp_group``; returns what it returns.

    With ``validate`` on a group of size > 1 (and not under CUDA graph capture) this costs one
    all-gather of ``1 + len(agree)`` int64 numbers: an exception of ``check`` on one rank raises
    there and a ``ValueError`` naming that rank on the others, instead of leaving them blocked in
    the op's collectives; ``agree`` entries (as :func:`checked_config`'s, but ``value_fn`` takes
    what ``check`` returned) must be equal on every rank. Otherwise ``check()`` runs alone
    and its exception raises on this rank only (no collective, no host read).
    """
    _, tp = _comm.group_rank_size(tp_group)
    if tp == 1 or not host_checks_enabled(validate, device or _comm.exchange_device(tp_group)):
        return check()
    error, result, row = None, None, None
    try:
        result = check()
        row = [_int64(_agree_field(entry).name, entry[1](result)) for entry in agree]
    except Exception as exc:  # noqa: BLE001 - every local failure must reach the other ranks
        error = exc
    agree_across_ranks(error, row, tuple(_agree_field(entry) for entry in agree), tp_group,
                       device=device, group_name="tp_group", hint=hint)
    return result


def tensor_checksum(tensor: torch.Tensor, where: torch.Tensor | None = None) -> int:
    """An int64 checksum of ``tensor``'s values (floats by their fp32 bits) at the positions
    where the bool ``where`` (broadcast over trailing dims) holds; reads the host."""
    values = tensor.detach()
    if values.dtype.is_floating_point:
        values = values.float().contiguous().view(torch.int32)
    if where is not None:
        keep = where.reshape(*where.shape, *([1] * (values.dim() - where.dim())))
        values = torch.where(keep, values, 0)
    return _target_checksum(values)


def check_finite(lse: torch.Tensor, valid: torch.Tensor | None, *,
                 logits2d: torch.Tensor | None = None, temperature: float = 1.0) -> None:
    """Raise ``ValueError`` if a scored row has no finite logsumexp (NaN, +inf or all -inf).

    ``logits2d`` (the ``[T, W]`` logits, optional) and ``temperature`` only sharpen the message:
    a row of finite logits that ``/ temperature`` turned into +-inf is reported as a too small
    ``temperature``, not as bad logits.
    """
    bad = ~torch.isfinite(lse)
    if valid is not None:
        bad &= valid
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    cause = "NaN or +inf logits, or every real vocabulary column at -inf"
    if temperature < 1.0:  # (another rank's shard may be the one that overflowed)
        row = None if logits2d is None else logits2d[first]
        if (row is not None and bool(torch.isfinite(row).all())
                and bool((row.float() / temperature).isinf().any())):
            raise ValueError(f"temperature={temperature!r} is too small for these logits: logits / "
                             f"temperature overflows fp32 (the row at flat position {first})")
        cause += f", or logits / temperature={temperature!r} overflowing fp32"
    raise ValueError(f"logits: the row at flat position {first} has no finite logsumexp ({cause});"
                     " such a row cannot be scored")
