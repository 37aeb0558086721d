"""Input checks of the vocab-parallel ops: the logits (a tensor, or a :class:`LogitsSpec` from a
caller that never materialises them), target and options of one call, validated into a
:class:`StatsConfig`.

Shape, dtype and argument checks always run. Checks that read tensor values on the host (target
range, cross-rank agreement, finite results) run only with ``validate=True`` and never while a CUDA
graph is being captured or a tracer runs the call (``torch.compile``, ``make_fx``). Under tensor
parallelism every exception of the local checks (not only ``ValueError``) goes through the one
cross-rank exchange of :mod:`.agreement`, so a bad input on one rank raises on every rank instead
of leaving the others waiting in a collective. Backward functions refuse double backward
(:func:`refuse_double_backward`, :func:`first_order_backward`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..mcore import megatron_tp_size
from . import _comm
from ._argtypes import InputTypeError, check_int64
from ._layout import check_contiguous, shard_layout
from ._replicated import identical_shards
from .agreement import (
    CrossRankCheck,
    Field,
    bits_float,
    float_bits,
    host_checks_enabled,
    tensor_checksum,
)
from .agreement import agree_field as _agree_field
from .agreement import target_checksum as _target_checksum
from .kernels import resolve_kernel
from .options import (
    LAYOUT_OPTIONS,
    LOGITS_DTYPES,
    STATS_OPTIONS,
    Option,
    StatsConfig,
    auto_chunk_size,
    batch_invariant_mode,
)

__all__ = [
    "LogitsSpec",
    "check_finite",
    "checked_config",
    "first_order_backward",
    "refuse_double_backward",
]


class LogitsSpec(NamedTuple):
    """The shape, dtype and device of logits ``[..., V/tp]`` that a caller does not hold as a
    tensor (the fused LM-head op computes them chunk by chunk from hidden states): accepted by
    :func:`checked_config` in place of the logits tensor, with the same checks and exchange.
    ``shape``: a ``torch.Size`` or tuple of ints; ``device``: as ``tensor.device`` reports it.
    ``sample``: optional, a 1-D tensor that differs across the vocabulary shards (the fused
    op's first weight row), compared in place of the logits' first row by the wrong-group
    check (equal on every rank: the same shard everywhere)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    sample: torch.Tensor | None = None


def _as_spec(logits: LogitsSpec) -> LogitsSpec:
    return LogitsSpec(torch.Size(logits.shape), logits.dtype, torch.device(logits.device),
                      logits.sample)


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
    :func:`refuse_double_backward` first, so the backward then always runs with grad mode off;
    then, when no output gradient arrives (all None: the ops' Functions do not materialise
    them), no gradient for any input without running ``backward``."""
    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            refuse_double_backward(op)
            if all(grad is None for grad in grads):
                return (None,) * len(ctx.needs_input_grad)
            return backward(ctx, *grads)
        return checked
    return wrap


def _check_local(logits, target, tp_group, options: dict) -> StatsConfig:
    """This rank's checks of :func:`checked_config` (no collective); ``logits`` a tensor or a
    normalised :class:`LogitsSpec`, ``options`` keywords of :data:`STATS_OPTIONS` (the others
    take their declared defaults)."""
    if not isinstance(logits, (torch.Tensor, LogitsSpec)):
        raise InputTypeError(f"logits must be a tensor [..., V/tp], got {type(logits).__name__}")
    if len(logits.shape) < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary, last)")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError(f"logits: the vocabulary dimension (last) is empty (shape "
                         f"{tuple(logits.shape)}): every rank must hold a non-empty shard")
    if target is not None:
        if not isinstance(target, torch.Tensor):
            raise InputTypeError("target must be a tensor of integer token ids, got "
                                 f"{type(target).__name__}")
        if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
            raise ValueError("target must hold integer token ids (an integer dtype: int64, "
                             f"int32, ...), got {target.dtype}")
        if target.shape != logits.shape[:-1]:
            raise ValueError(
                f"target shape {tuple(target.shape)} must equal the leading shape of logits "
                f"{tuple(logits.shape[:-1])}"
            )
        if target.device != logits.device:
            raise ValueError(f"target is on {target.device} but logits on {logits.device}")
    unknown = [name for name in options if name not in STATS_OPTIONS]
    if unknown:  # (an internal caller's slip: the ops' own keywords are checked by takes_options)
        raise TypeError(f"checked_config got an unknown option {unknown[0]!r}")
    values = {name: options.get(name, option.default) for name, option in STATS_OPTIONS.items()}
    for name, option in STATS_OPTIONS.items():
        if option.check is not None:
            values[name] = option.check(name, values[name])
    if values["chunk_size"] is None:
        values["chunk_size"] = auto_chunk_size(logits.shape[-1], logits.device)
    vocab_size, vocab_start = (values.pop(name) for name in LAYOUT_OPTIONS)
    rank, tp = _comm.group_rank_size(tp_group)
    if tp_group is None and vocab_size is None and vocab_start is None:
        _check_no_missing_group(logits.shape[-1])
    try:
        layout = shard_layout(logits.shape[-1], rank, tp, vocab_size, vocab_start)
    except ValueError as exc:
        if tp_group is None and "does not fit" in str(exc):
            raise ValueError(f"{exc}; tp_group is None (no tensor parallelism: {_holder(logits)} "
                             "hold the whole vocabulary): pass tp_group for a vocabulary-parallel "
                             "shard") from None
        raise
    if tp == 1 and not layout.even:
        check_contiguous([layout.vocab_start], [layout.width], layout.vocab_size)
    values["batch_invariant"] = batch_invariant_mode(values["batch_invariant"],
                                                     logits.shape[-1], tp, layout.even)
    values["kernel"] = resolve_kernel(values["kernel"], logits.device)
    if values["argmax"] and values["kernel"] != "torch":
        raise ValueError(f"argmax=True is computed by the torch statistics only; the resolved "
                         f"kernel is {values['kernel']!r}: pass kernel='torch'")
    cfg = StatsConfig(layout=layout, **values)
    if host_checks_enabled(cfg.validate, logits.device) and target is not None:
        bad = (target != cfg.ignore_index) & ((target < 0) | (target >= cfg.layout.vocab_size))
        if bool(bad.any()):
            value = int(target[bad].reshape(-1)[0])
            hint = (f"; tp_group is None, so {_holder(logits)} must hold the whole vocabulary: "
                    "for one rank's vocabulary shard pass its tp_group"
                    if tp_group is None and value >= logits.shape[-1] else "")
            raise ValueError(
                f"target holds id {value}, outside [0, vocab_size={cfg.layout.vocab_size}) and "
                f"not ignore_index={cfg.ignore_index}{hint}"
            )
    return cfg


def _holder(logits) -> str:
    """What holds the vocabulary in an error message: the logits, or (the fused LM head's
    :class:`LogitsSpec`) the output layer's weight."""
    if isinstance(logits, LogitsSpec):
        return "the output layer's weight rows"
    return "these logits"


def _check_no_missing_group(width: int) -> None:
    """``ValueError`` naming ``tp_group`` for a call without a group (and without
    ``vocab_size``, which would say that the logits hold the whole vocabulary) inside a run
    whose Megatron parallel state is initialised with tensor parallelism: these logits are then
    almost surely one rank's shard, and without the group its statistics are per-shard (off by
    up to the log of the other shards' mass), with no error."""
    tp = megatron_tp_size()
    if tp is not None and tp > 1:
        raise ValueError(
            f"tp_group is None (no tensor parallelism), but Megatron's tensor-parallel group has "
            f"{tp} ranks: these logits [..., {width}] look like one rank's vocabulary shard. Pass "
            "tp_group (e.g. parallel_state.get_tensor_model_parallel_group()), or vocab_size "
            "if they really hold the whole vocabulary")


def agreed_options(options: dict[str, Option]) -> tuple[tuple[str, Field, Callable], ...]:
    """``(name, Field, encode)`` of each of ``options`` that the ranks must agree on: its
    agreement column and the encoding of its checked value as an int64 (see
    :class:`~.options.Option`)."""
    def column(option: Option) -> tuple[Field, Callable[[object], int]]:
        if option.kind == "choice":
            return Field(option.agree, show=option.choices.__getitem__), option.choices.index
        if option.kind == "float":
            return Field(option.agree, show=bits_float), float_bits
        return Field(option.agree, show=bool if option.kind == "bool" else int), int

    return tuple((name, *column(option)) for name, option in options.items() if option.agree)


_AGREED = agreed_options(STATS_OPTIONS)
_AGREEMENT = (
    Field("vocab_start", show=lambda given: "given" if given else None),
    Field("logits shard width"), Field("token count"), Field("vocab_size"),
    Field("logits dtype", show=LOGITS_DTYPES.__getitem__),
    Field("target (token ids)", checksum=True),
    *(field for _, field, _ in _AGREED),
)


def _agreement_row(logits, target, cfg: StatsConfig, agree) -> list[int]:
    """This rank's values of :data:`_AGREEMENT`, then of ``agree``, then the replicated-logits
    sample (see :func:`checked_config`)."""
    layout = cfg.layout
    row = [
        int(not layout.even),
        layout.width if layout.even else -1,  # ranges given per rank: checked for contiguity
        math.prod(logits.shape) // layout.width,
        layout.vocab_size,
        LOGITS_DTYPES.index(logits.dtype),
        _target_checksum(target),
        *(encode(getattr(cfg, name)) for name, _, encode in _AGREED),
        *(check_int64(_agree_field(entry).name, entry[1]()) for entry in agree),
    ]
    return [*row, _first_row_sample(logits, layout.width), layout.vocab_start, layout.width]


def _first_row_sample(logits, width: int) -> int:
    """A checksum of the logits' first row (0: nothing to compare). Equal on every rank, the
    ranks hold the same logits (:func:`._replicated.identical_shards`: the full logits
    replicated, a group other than the one the vocabulary was split over, or equal shards). A
    constant row tells nothing (a shard of padding, all-equal logits); a LogitsSpec gives its
    ``sample`` (the fused op: the first weight row), a stride-0 stand-in has no data."""
    if isinstance(logits, LogitsSpec):
        row = logits.sample
        if row is None or row.numel() == 0:
            return 0
    elif isinstance(logits, torch.Tensor) and logits.numel() > 0 and logits.stride(-1) != 0:
        row = logits.detach().reshape(-1, width)[0]
    else:
        return 0
    if not bool((row != row[0]).any()):
        return 0
    return tensor_checksum(row) or 1


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
    ``logits`` may be a :class:`LogitsSpec` (shape, dtype, device) in place of the tensor, for a
    caller that never materialises the logits: the same checks and exchange, with no sample of
    values (also with ``local_error``, where only its device is used).
    """
    if isinstance(logits, LogitsSpec):
        logits = _as_spec(logits)
    device = logits.device if isinstance(logits, (torch.Tensor, LogitsSpec)) else None
    checks = CrossRankCheck(
        tp_group, validate=_truthy(options.get("validate", True)), device=device,
        fields=_AGREEMENT + tuple(_agree_field(entry) for entry in agree), extra=3,
        hint="every tensor-parallel rank must pass the same tokens, targets and options, and "
        "its own equal-width vocabulary shard")
    checks.fail(local_error)
    cfg = checks.run(lambda: _check_local(logits, target, tp_group, options),
                     row=lambda cfg: _agreement_row(logits, target, cfg, agree))
    table = checks.finish()
    if table is None:
        return cfg
    if not cfg.layout.even:
        check_contiguous([r[-2] for r in table], [r[-1] for r in table], cfg.layout.vocab_size)
    if table[0][-3] != 0 and all(r[-3] == table[0][-3] for r in table):
        identical_shards(cfg.layout.width, checks.size,
                         None if options.get("vocab_size") is None else cfg.layout.vocab_size)
    return cfg


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
