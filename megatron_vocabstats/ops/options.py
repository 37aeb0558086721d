"""The options of the vocabulary statistics: their allowed values, defaults and validated bundle.

Public (``megatron_vocabstats.ops.options``), for the ops, the losses and the Megatron settings
alike. Lives here: :data:`IGNORE_INDEX` (the default ``ignore_index``), :data:`LOGP_MIN`,
:data:`ENTROPY_MODES`,
:data:`BATCH_INVARIANT_MODES` and the flag spellings :data:`BATCH_INVARIANT_NAMES`,
:func:`check_batch_invariant`, :data:`LOGITS_DTYPES`, :data:`MIN_TEMPERATURE`, the auto chunk size
(:data:`CHUNK_BYTES`, :func:`auto_chunk_size`) and :class:`StatsConfig`, the frozen options of one
call (built by ``_checks.checked_config``). May import :mod:`._layout` only (and torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """Tokens per chunk used when ``chunk_size=None``: ``CHUNK_BYTES[device] // (4 * width)``."""
    return max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cuda"]) // (4 * width))


LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP32_MAX = torch.finfo(torch.float32).max
# The logits and their gradient are scaled by 1/temperature in fp32: below this it overflows.
MIN_TEMPERATURE = 1.0 / FP32_MAX


def check_batch_invariant(value) -> bool | str:
    """``value`` as one of False, True, ``"tp"`` (``"off"``/``"batch"`` map to False/True), else
    ``ValueError``."""
    if value is True or value is False:
        return value
    if isinstance(value, str) and value in BATCH_INVARIANT_NAMES:
        return BATCH_INVARIANT_NAMES[value]
    raise ValueError(f"batch_invariant must be False, True or 'tp' (or 'off', 'batch'), "
                     f"got {value!r}")


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
    # The unfused op's backend, resolved (``kernels.resolve_kernel``): "torch" or "triton".
    kernel: str = "torch"
