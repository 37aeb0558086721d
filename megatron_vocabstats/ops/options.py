"""The options of the vocabulary statistics: their allowed values, defaults and validated bundle.

Public (``megatron_vocabstats.ops.options``), for the ops, the losses and the Megatron settings
alike: the options' constants and defaults, the keyword sets the op wrappers take as
``**options`` (``TypedDict`` s for ``Unpack``), :class:`StatsConfig` (the frozen options of one
call, built by ``_checks.checked_config``) and the checkers of options of :mod:`._argtypes`.
What each option means: ``docs/options.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from ._argtypes import (  # noqa: F401 - public here
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


def check_keywords(op: str, options: dict, allowed: type) -> None:
    """``TypeError`` (as Python's own for an undeclared keyword) naming the first keyword of
    ``options`` that the ``TypedDict`` ``allowed`` does not declare, and the ones it does: the
    check of the wrappers that take ``**options: Unpack[allowed]``."""
    declared = allowed.__optional_keys__ | allowed.__required_keys__
    # (a loop, not keys() - set: torch 2.11's dynamo cannot trace a set difference of dict keys)
    unknown = sorted(key for key in options if key not in declared)
    if unknown:
        takes = ", ".join(sorted(declared))
        raise TypeError(f"{op}() got an unexpected keyword argument {unknown[0]!r} (its "
                        f"options: {takes})")


class ShardKwargs(TypedDict, total=False):
    """The keywords every op takes besides its tensors and ``tp_group``, each stated in full
    once in ``docs/options.md``: ``vocab_size`` (int | None, the real V),
    ``vocab_start`` (int | None, global id of local column 0 for uneven shards), ``chunk_size``
    (int | None, tokens per fp32 chunk; None = auto) and ``validate`` (bool, default True: the
    host-side checks and their cross-rank agreement). The wrappers take them as
    ``**options: Unpack[...]`` and pass them on unchanged; the one place that declares their
    defaults and checks them is ``ops._checks.checked_config``."""

    vocab_size: int | None
    vocab_start: int | None
    chunk_size: int | None
    validate: bool


class ScaledKwargs(ShardKwargs, total=False):
    """:class:`ShardKwargs` and ``temperature`` (float > 0, default 1: logits are divided by
    it)."""

    temperature: float


class TargetKwargs(ScaledKwargs, total=False):
    """:class:`ScaledKwargs` and ``ignore_index`` (int, default :data:`IGNORE_INDEX`)."""

    ignore_index: int


class StatsKwargs(TargetKwargs, total=False):
    """The options of the per-token statistics: :class:`TargetKwargs`, ``label_smoothing``
    (float in [0, 1), default 0) and ``batch_invariant`` (False, True or ``"tp"``)."""

    label_smoothing: float
    batch_invariant: bool | str


class VocabStatsKwargs(StatsKwargs, total=False):
    """:class:`StatsKwargs` and ``kernel`` (``"auto"``, ``"torch"`` or ``"triton"``: the backend of
    the core statistics and gradient per chunk, see ``ops.kernels.resolve_kernel``); the
    keywords of :func:`~megatron_vocabstats.vocab_parallel_stats`,
    :func:`~megatron_vocabstats.linear_vocab_parallel_stats` and their wrappers."""

    kernel: str


class LinearHeadKwargs(TypedDict, total=False):
    """The fused LM head's own keywords (see
    :func:`~megatron_vocabstats.linear_vocab_parallel_stats`): ``sequence_parallel`` (bool,
    ``hidden`` is this rank's sequence shard), ``accumulate_into_main_grad`` (bool, dW added
    into ``weight.main_grad``) and ``partial_hidden_grad`` (bool, dX left unsummed over tp)."""

    sequence_parallel: bool
    accumulate_into_main_grad: bool
    partial_hidden_grad: bool


class LinearStatsKwargs(VocabStatsKwargs, LinearHeadKwargs, total=False):
    """:class:`VocabStatsKwargs` and :class:`LinearHeadKwargs`."""


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
    # The core statistics' backend, resolved (``kernels.resolve_kernel``): "torch" or "triton".
    kernel: str = "torch"
