"""Input checks and the frozen option bundle of the vocab-parallel ops.

Shape, dtype and argument checks always run. Checks that read tensor values on the host (target
range, cross-rank agreement, finite results) run only with ``validate=True`` and never while a CUDA
graph is being captured. Under tensor parallelism every rank first decides locally, then all ranks
exchange one small int64 vector (sizes, a target checksum and an error flag) so that a bad input on
one rank raises on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

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


def shard_layout(width: int, rank: int, tp: int, vocab_size: int | None) -> ShardLayout:
    """The :class:`ShardLayout` of rank ``rank`` of ``tp`` equal shards of ``width`` columns.

    The padding (global columns ``>= vocab_size``) may fill whole shards, as Megatron's padding to
    a multiple of ``make_vocab_size_divisible_by * tp`` does for small vocabularies. Raises
    ``ValueError`` if ``vocab_size`` is not an int in ``[1, width * tp]``.
    """
    if width == 0:
        raise ValueError("logits: the vocabulary dimension (last) is empty")
    padded = width * tp
    if vocab_size is None:
        vocab_size = padded
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise ValueError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit {tp} shard(s) of width {width}: it must lie in "
            f"[1, {padded}] (the shards hold the padded vocabulary)"
        )
    start = rank * width
    real = max(0, min(width, vocab_size - start))
    return ShardLayout(vocab_start=start, width=width, real_width=real, vocab_size=vocab_size)


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


def _batch_invariant_mode(value, width: int, tp: int):
    value = check_batch_invariant(value)
    if value == "tp" and tp > 1 and width % BLOCK:
        raise ValueError(
            f"batch_invariant='tp' needs a vocabulary shard width that is a multiple of {BLOCK} "
            f"under tensor parallelism (got {width}, tp={tp}): pad the vocabulary to a multiple "
            f"of {BLOCK} * tp, as Megatron's make_vocab_size_divisible_by=128 does"
        )
    return value


def _check_local(logits, target, tp_group, *, vocab_size, chunk_size, entropy, temperature,
                 ignore_index, label_smoothing, validate, batch_invariant=False) -> StatsConfig:
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary, last)")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if target is not None:
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"target must be an int64 tensor, got {type(target).__name__}")
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
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if not (0.0 < temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (0.0 <= label_smoothing < 1.0):
        raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing!r}")
    rank, tp = _comm.group_rank_size(tp_group)
    cfg = StatsConfig(
        batch_invariant=_batch_invariant_mode(batch_invariant, logits.shape[-1], tp),
        layout=shard_layout(logits.shape[-1], rank, tp, vocab_size),
        chunk_size=chunk_size,
        entropy=entropy,
        temperature=float(temperature),
        ignore_index=int(ignore_index),
        label_smoothing=float(label_smoothing),
        validate=bool(validate),
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


_AGREEMENT = ("logits shard width", "token count", "vocab_size", "logits dtype", "target",
              "entropy mode", "ignore_index", "temperature", "label_smoothing", "batch_invariant")


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def agree_across_ranks(error: ValueError | None, values: list[int] | None,
                       names: tuple[str, ...], group: dist.ProcessGroup, *, device,
                       group_name: str, hint: str, extra: int = 0) -> list[list[int]]:
    """Make a local input error, or a disagreement between ranks, raise on every rank.

    One all-gather of ``[error flag, *values]`` (int64) over ``group``: this rank re-raises its
    own ``error``; the others raise a ``ValueError`` naming the ranks that rejected their inputs;
    otherwise the first of ``names`` whose value differs across ranks is reported, with ``hint``.
    ``values`` may be None when ``error`` is set; its last ``extra`` columns are exchanged but not
    compared. Returns the table of every rank's row (flag first).
    """
    row = values if values is not None else [-1] * (len(names) + extra)
    table = _comm.all_gather_ints([int(error is not None), *row], group, device=device)
    if error is not None:
        raise error
    failed = [r for r, t in enumerate(table) if t[0]]
    if failed:
        raise ValueError(f"ranks {failed} of {group_name} rejected their inputs (see their errors)")
    for col, name in enumerate(names, start=1):
        seen = [t[col] for t in table]
        if any(v != seen[0] for v in seen):
            raise ValueError(f"{name} differs across the ranks of {group_name} (in rank order: "
                             f"{seen}); {hint}")
    return table


def checked_config(logits, target, tp_group: dist.ProcessGroup | None, *,
                   local_error: ValueError | None = None,
                   agree: tuple[tuple[str, Callable[[], int]], ...] = (),
                   **options) -> StatsConfig:
    """Validate the inputs of one call and return its :class:`StatsConfig`.

    Raises ``ValueError`` naming the argument (see :func:`vocab_parallel_stats`). With
    ``validate`` on a group of size > 1, costs one all-gather of a few int64 numbers, through
    which an error on one rank (its own check, or ``local_error`` found by a caller such as the
    fused op) raises on every rank. ``agree``: a caller's own ``(name, value_fn)`` pairs that
    must be equal on every rank, compared in that same all-gather (``value_fn()`` returns an int
    and is called only there, when this rank's checks passed; e.g. ``k`` and id checksums of the
    top-k ops).
    """
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a tensor [..., V/tp], got {type(logits).__name__}")
    _, tp = _comm.group_rank_size(tp_group)
    if tp == 1 or not host_checks_enabled(bool(options["validate"]), logits.device):
        if local_error is not None:
            raise local_error
        return _check_local(logits, target, tp_group, **options)

    error, cfg = local_error, None
    if error is None:
        try:
            cfg = _check_local(logits, target, tp_group, **options)
        except (ValueError, TypeError) as exc:  # a TypeError too must not leave the others waiting
            error = exc
    mine = None
    if cfg is not None:
        mine = [
            cfg.layout.width,
            logits.numel() // cfg.layout.width,
            cfg.layout.vocab_size,
            LOGITS_DTYPES.index(logits.dtype),
            _target_checksum(target),
            ENTROPY_MODES.index(cfg.entropy),
            cfg.ignore_index,
            _float_bits(cfg.temperature),
            _float_bits(cfg.label_smoothing),
            BATCH_INVARIANT_MODES.index(cfg.batch_invariant),
            *(int(value()) for _, value in agree),
        ]
    # A shard as wide as the real vocabulary may be a Megatron shard (small vocabulary, whole
    # shards of padding) or the full logits replicated on every rank: the first row tells (equal
    # on every rank only if replicated, or if that row is constant). The fused op passes a
    # stride-0 stand-in with no data: nothing to sample there.
    ambiguous = (cfg is not None and cfg.layout.width >= cfg.layout.vocab_size
                 and logits.numel() > 0 and logits.stride(-1) != 0)
    sample = 0
    if ambiguous:
        first_row = logits.detach().reshape(-1, cfg.layout.width)[0]
        sample = _float_bits(float(first_row.double().sum()))
    names = _AGREEMENT + tuple(name for name, _ in agree)
    table = agree_across_ranks(error, None if mine is None else [*mine, sample], names,
                               tp_group, device=logits.device, group_name="tp_group",
                               hint="every tensor-parallel rank must pass the same tokens, "
                               "targets and options, and its own equal-width vocabulary shard",
                               extra=1)
    if ambiguous and all(row[-1] == table[0][-1] for row in table):
        raise ValueError(
            f"logits: every rank of the tp={tp} group holds the same [..., {cfg.layout.width}] "
            f"logits, as wide as vocab_size={cfg.layout.vocab_size}: pass this rank's vocabulary "
            "shard [..., V/tp], not the full replicated logits"
        )
    return cfg


def check_finite(lse: torch.Tensor, valid: torch.Tensor | None) -> None:
    """Raise ``ValueError`` if a scored row has no finite logsumexp (NaN, +inf or all -inf)."""
    bad = ~torch.isfinite(lse)
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"logits: the row at flat position {first} has no finite logsumexp (NaN or +inf "
            "logits, or every real vocabulary column at -inf); such a row cannot be scored"
        )
