"""The options of the ops, each declared once, and the checked options of one call.

Each keyword is one :class:`Option` in the keyword set (a ``TypedDict``) of the ops that take it;
the ops' signatures (:func:`takes_options`), their checks and cross-rank agreement
(``_checks``), :class:`StatsConfig`, the losses' ``StatsOptions`` and the Megatron settings read
it from there. What each option means: ``docs/options.md``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypedDict, get_type_hints

import torch

from ._argtypes import (  # noqa: F401 - public here
    INT64_RANGE,
    _shown,
    bool_error,
    check_bool,
    check_choice,
    check_number,
    number_problem,
)
from ._layout import BLOCK, ShardLayout

# Floor of the log-probabilities the gradients exponentiate, below the log of the smallest
# positive fp32 (about -103.3): exp(LOGP_MIN) == 0.
LOGP_MIN = -1.0e4

# The default ``ignore_index`` of the ops and losses (PyTorch's and Megatron's): target rows
# holding it are not scored.
IGNORE_INDEX = -100

ENTROPY_MODES = ("off", "metric", "grad")
# The backends of the core statistics (``StatsConfig.kernel``, resolved) and the values the ops
# accept (``"auto"`` picks one: ``ops.kernels.resolve_kernel``).
KERNELS = ("torch", "triton")
KERNEL_CHOICES = ("auto", *KERNELS)
# Values of ``batch_invariant``: off, batch-invariant, batch- and tensor-parallel-invariant.
BATCH_INVARIANT_MODES = (False, True, "tp")
# The flag's spellings (--vocab-stats-batch-invariant off|batch|tp) are accepted as well.
BATCH_INVARIANT_NAMES = {"off": False, "batch": True, "tp": "tp"}

# Auto chunking: each of the two fp32 [chunk, W] buffers is about this size. On CPU a few MiB
# keeps them in cache (every pass over a chunk after the first is a cache hit, and no fresh pages
# are faulted in); on GPU larger chunks amortise kernel launches.
CHUNK_BYTES = {"cpu": 4 * 2**20, "cuda": 256 * 2**20}


def auto_chunk_size(width: int, device: torch.device) -> int:
    """Tokens per chunk used when ``chunk_size=None``: ``CHUNK_BYTES[device] // (4 * width)``.

    A symbolic ``width`` (a ``SymInt`` while ``make_fx``/``torch.compile`` traces with dynamic
    shapes) is specialised to its value (``int``): the chunk loop is host-side Python, and a
    model's vocabulary shard width does not change."""
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * int(width)))


LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max
# The logits and their gradient are scaled by 1/temperature in fp32: below this it overflows.
MIN_TEMPERATURE = 1.0 / FP32_MAX


def check_batch_invariant(value) -> bool | str:
    """``value`` as one of False, True (numpy's ``bool_`` too), ``"tp"`` (``"off"``/``"batch"``
    map to False/True), else ``ValueError``."""
    if bool_error("batch_invariant", value) is None:
        return bool(value)
    if isinstance(value, str) and value in BATCH_INVARIANT_NAMES:
        return BATCH_INVARIANT_NAMES[value]
    raise ValueError(f"batch_invariant must be False, True or 'tp' (or 'off', 'batch'), "
                     f"got {_shown(value)}")


def batch_invariant_mode(value, width: int, tp: int, even: bool = True):
    """:func:`check_batch_invariant`, then ``ValueError`` if ``"tp"`` cannot hold for this layout:
    shards of unequal widths (``even`` False), or under tensor parallelism a shard ``width`` that
    is not a multiple of :data:`BLOCK`."""
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


@dataclass(frozen=True, slots=True)
class Option:
    """The one declaration of an op keyword, written where its keyword set declares it
    (``name: Annotated[type, Option(...)]``) and read by the signature (:func:`takes_options`),
    the checks and the cross-rank agreement (``_checks``) and :class:`StatsConfig`.

    ``check(name, value)`` returns the value normalised or raises naming ``name`` (None: checked
    with the call's tensors, by ``_checks``). ``agree``: the label under which the ranks of
    ``tp_group`` must agree on the checked value (None: not compared as an option); ``kind``
    how it is exchanged: ``"int"``, ``"bool"``, ``"float"`` (by its bits) or ``"choice"`` (its
    index in ``choices``).
    """

    default: object
    check: Callable[[str, object], object] | None = None
    agree: str | None = None
    kind: str = "int"
    choices: tuple = ()


def _choice(choices: tuple) -> Callable[[str, object], object]:
    def check(name, value):
        check_choice(name, value, choices)
        return choices[choices.index(value)]  # the declared object (a str for numpy's str_)
    return check


def _number(**rule) -> Callable[[str, object], object]:
    return functools.partial(check_number, **rule)


_INT64 = dict(integer=True, low=INT64_RANGE[0], high=INT64_RANGE[1])


class ShardKwargs(TypedDict, total=False):
    """The keywords every op takes besides its tensors and ``tp_group`` (``docs/options.md``
    states each): the real V, the first global id of an uneven shard, tokens per fp32 chunk
    (None: auto) and the host-side checks with their cross-rank agreement."""

    vocab_size: Annotated[int | None, Option(None)]
    vocab_start: Annotated[int | None, Option(None)]
    chunk_size: Annotated[int | None, Option(None, _number(**_INT64 | dict(low=1), none_ok=True))]
    validate: Annotated[bool, Option(True, check_bool)]


class ScaledKwargs(ShardKwargs, total=False):
    """:class:`ShardKwargs` and ``temperature`` (logits are divided by it)."""

    temperature: Annotated[float, Option(1.0, _number(low=MIN_TEMPERATURE),
                                         agree="temperature", kind="float")]


class TargetKwargs(ScaledKwargs, total=False):
    """:class:`ScaledKwargs` and ``ignore_index`` (targets holding it are not scored)."""

    ignore_index: Annotated[int, Option(IGNORE_INDEX, _number(**_INT64), agree="ignore_index")]


class StatsKwargs(TargetKwargs, total=False):
    """:class:`TargetKwargs`, ``label_smoothing`` (in [0, 1)) and ``batch_invariant``."""

    label_smoothing: Annotated[float, Option(0.0, _number(low=0.0, high=1.0, high_open=True),
                                             agree="label_smoothing", kind="float")]
    batch_invariant: Annotated[bool | str, Option(
        False, lambda _, value: check_batch_invariant(value), agree="batch_invariant",
        kind="choice", choices=BATCH_INVARIANT_MODES)]


class VocabStatsKwargs(StatsKwargs, total=False):
    """:class:`StatsKwargs` and ``kernel`` (``"auto"``, ``"torch"`` or ``"triton"``: the backend
    of the statistics and their gradient, resolved with the call's device by
    ``ops.kernels.resolve_kernel``; the ranks compare the resolved one): the keywords of the
    ops' wrappers (log-probs, entropy, cross-entropy)."""

    kernel: Annotated[str, Option("auto", _choice(KERNEL_CHOICES), agree="kernel (resolved)",
                                  kind="choice", choices=KERNELS)]


class OutputKwargs(TypedDict, total=False):
    """Which outputs of :class:`~megatron_vocabstats.VocabStats` are computed: ``entropy``
    (``"off"``: None, ``"metric"``: no gradient, ``"grad"``) and ``argmax`` (the global id of
    each row's largest logit; torch kernel only)."""

    entropy: Annotated[str, Option("grad", _choice(ENTROPY_MODES), agree="entropy mode",
                                   kind="choice", choices=ENTROPY_MODES)]
    argmax: Annotated[bool, Option(False, check_bool, agree="argmax", kind="bool")]


class StatsOpKwargs(VocabStatsKwargs, OutputKwargs, total=False):
    """The keywords of :func:`~megatron_vocabstats.vocab_parallel_stats`: every option of
    :class:`StatsConfig`."""


class SequenceKwargs(TypedDict, total=False):
    """The keyword of every op from hidden states: ``hidden`` is this rank's sequence shard
    (gathered inside)."""

    sequence_parallel: Annotated[bool, Option(False, check_bool, agree="sequence_parallel",
                                              kind="bool")]


class FusedKwargs(SequenceKwargs, total=False):
    """:class:`SequenceKwargs` and, for the differentiable ops from hidden states, the fp32
    weight gradient added into ``weight.main_grad`` (Megatron's gradient-accumulation fusion)."""

    accumulate_into_main_grad: Annotated[bool, Option(
        False, check_bool, agree="accumulate_into_main_grad", kind="bool")]


class LinearHeadKwargs(FusedKwargs, total=False):
    """:class:`FusedKwargs` and ``partial_hidden_grad`` (dX left unsummed over tp): the keywords
    of :func:`~megatron_vocabstats.linear_vocab_parallel_stats` beyond the core op's."""

    partial_hidden_grad: Annotated[bool, Option(False, check_bool, agree="partial_hidden_grad",
                                                kind="bool")]


class LinearTopKKwargs(ScaledKwargs, FusedKwargs, total=False):
    """The keywords of the fused top-k log-probs."""


class LinearTopKIdsKwargs(ScaledKwargs, SequenceKwargs, total=False):
    """The keywords of the fused top-k (not differentiable)."""


class SamplerKwargs(TypedDict, total=False):
    """The inference sampler's filters (vLLM's), each None when off: ``top_k`` (an int >= 1),
    ``top_p`` (in (0, 1]) and ``min_p`` (in [0, 1)); the ranks compare them in the sampler
    ops' own agreement entries."""

    top_k: Annotated[int | None, Option(None, _number(integer=True, low=1, none_ok=True))]
    top_p: Annotated[float | None, Option(None, _number(low=0.0, high=1.0, low_open=True,
                                                        none_ok=True))]
    min_p: Annotated[float | None, Option(None, _number(low=0.0, high=1.0, high_open=True,
                                                        none_ok=True))]


class SamplingKwargs(TargetKwargs, SamplerKwargs, total=False):
    """The keywords of :func:`~megatron_vocabstats.vocab_parallel_sampling_logprobs`."""


class LinearSamplingKwargs(SamplingKwargs, FusedKwargs, total=False):
    """The keywords of the fused sampler log-probs."""


class LinearStatsKwargs(VocabStatsKwargs, LinearHeadKwargs, total=False):
    """:class:`VocabStatsKwargs` and :class:`LinearHeadKwargs`: the fused cross-entropy's."""


class LinearStatsOpKwargs(StatsOpKwargs, LinearHeadKwargs, total=False):
    """The keywords of :func:`~megatron_vocabstats.linear_vocab_parallel_stats`."""


def declared(kwargs: type) -> dict[str, Option]:
    """The :class:`Option` of each keyword of the ``TypedDict`` ``kwargs``, in declaration order
    (bases first)."""
    return {name: _option_of(hint)
            for name, hint in get_type_hints(kwargs, include_extras=True).items()}


def _option_of(hint) -> Option:
    """The :class:`Option` of an ``Annotated[type, Option(...)]`` hint."""
    return next(m for m in hint.__metadata__ if isinstance(m, Option))


# The options of the core statistics (:class:`StatsConfig`) and of the fused LM head.
STATS_OPTIONS = declared(StatsOpKwargs)
LINEAR_HEAD_OPTIONS = declared(LinearHeadKwargs)
SAMPLER_OPTIONS = declared(SamplerKwargs)
_ALL_OPTIONS = {**STATS_OPTIONS, **LINEAR_HEAD_OPTIONS, **SAMPLER_OPTIONS}
# The options that define the shard layout (``StatsConfig.layout``) rather than a field.
LAYOUT_OPTIONS = ("vocab_size", "vocab_start")


def check_option(name: str, value):
    """``value`` checked and normalised by the declared check of option ``name`` (unchanged if
    the option is checked with the call's tensors). Raises what that check raises, naming
    ``name`` (``InputTypeError`` for a wrong type, ``ValueError`` out of range); ``KeyError``
    for a name no keyword set declares."""
    option = _ALL_OPTIONS[name]
    return value if option.check is None else option.check(name, value)


def takes_options(op):
    """Decorator of an op ``op(..., **options: Unpack[K])``: its signature (``help``,
    ``inspect.signature``) lists K's keywords with their declared defaults, and a keyword K
    does not declare raises ``TypeError`` as Python's own does, naming the ones it does."""
    # (the annotation is a string, "Unpack[K]": the modules use postponed annotations)
    keyword_set = eval(op.__annotations__["options"], op.__globals__).__args__[0]
    signature = inspect.signature(op)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
    hints = get_type_hints(keyword_set, include_extras=True)
    names = [name for name in hints if name not in taken]
    allowed = frozenset(taken | set(names))
    listed = ", ".join(sorted({p.name for p in params if p.kind is p.KEYWORD_ONLY} | set(names)))

    @functools.wraps(op)
    def checked(*args, **kwargs):
        unknown = [key for key in kwargs if key not in allowed]
        if unknown:
            raise TypeError(f"{op.__name__}() got an unexpected keyword argument "
                            f"{unknown[0]!r} (its keywords: {listed})")
        return op(*args, **kwargs)

    checked.__signature__ = signature.replace(parameters=[*params, *(
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                          default=_option_of(hints[name]).default,
                          annotation=hints[name].__origin__) for name in names)])
    return checked


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsConfig:
    """The options of one call (:data:`STATS_OPTIONS`, a field each but ``vocab_size`` and
    ``vocab_start``, which make ``layout``), checked and resolved: ``chunk_size`` an int,
    ``kernel`` the backend (``"torch"`` or ``"triton"``). Passed to the autograd Function as
    one argument."""

    layout: ShardLayout
    chunk_size: int
    validate: bool
    temperature: float
    ignore_index: int
    label_smoothing: float
    batch_invariant: bool | str
    kernel: str
    entropy: str
    argmax: bool
