"""The plugin's run-time settings: what the patched Megatron call sites read.

One explicit object, :data:`SETTINGS`, written by ``megatron_vocabstats.patch.apply`` and by the
config hook (from the ``--vocab-parallel-stats`` flag family), read by the replacements in
:mod:`megatron_vocabstats.megatron.model`. While ``active`` is False the patched call sites run
Megatron's original code, so the plugin is either fully on or fully off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from ..ops._checks import ENTROPY_MODES, check_batch_invariant


@dataclass(frozen=True, kw_only=True, slots=True)
class PluginSettings:
    """Options of the patched loss path (flag in brackets).

    ``active``: use the plugin [--vocab-parallel-stats]; ``logprobs_chunk_size``: tokens per fp32
    chunk of the unfused op, None = auto [--logprobs-chunk-size, 0 = auto];
    ``lm_head_chunk_size``: tokens per chunk of the fused LM head, 0 = unfused
    [--lm-head-chunk-size]; ``entropy``: "off" | "metric" | "grad" [--vocab-stats-entropy];
    ``entropy_coef``: per-token loss becomes ``-logprob - entropy_coef * H`` (needs
    entropy="grad") [--entropy-coef]; ``label_smoothing`` [--vocab-stats-label-smoothing];
    ``vocab_size``: the real vocabulary size, None = the padded size (padding columns then take
    part in the softmax exactly as in Megatron's own loss; set it with ``patch.apply``);
    ``validate``: run the op's host-side input checks, a host sync per loss call (skipped during
    CUDA graph capture anyway) [--vocab-stats-skip-checks turns them off]; ``token_alignment``: per-sequence
    padding multiple derived by the config hook (FP8 recipe x 2*cp x tp with sequence parallel),
    for :mod:`megatron_vocabstats.packing`; ``batch_invariant``: False, True or "tp", the ops'
    argument of that name [--vocab-stats-batch-invariant {off,batch,tp}].

    Raises ``TypeError`` (a field of the wrong Python type) or ``ValueError`` (a chunk size,
    vocabulary size or alignment out of range, a non-finite coefficient, an unknown entropy or
    batch-invariant mode, a bonus without entropy="grad"), naming the field and the value.
    """

    active: bool = True
    logprobs_chunk_size: int | None = None
    lm_head_chunk_size: int = 0
    entropy: str = "off"
    entropy_coef: float = 0.0
    label_smoothing: float = 0.0
    vocab_size: int | None = None
    validate: bool = True
    token_alignment: int = 1
    batch_invariant: bool | str = False

    def __post_init__(self):
        for name in ("active", "validate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name, minimum in (("lm_head_chunk_size", 0), ("logprobs_chunk_size", 1),
                              ("vocab_size", 1), ("token_alignment", 1)):
            value = getattr(self, name)
            if value is None and name in ("logprobs_chunk_size", "vocab_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}"
                                 f"{' or None (auto)' if name == 'logprobs_chunk_size' else ''}"
                                 f", got {value}")
        for name in ("entropy_coef", "label_smoothing"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        check_batch_invariant(self.batch_invariant)
        if self.entropy not in ENTROPY_MODES:
            raise ValueError(f"entropy must be one of {ENTROPY_MODES}, got {self.entropy!r}")
        if self.entropy_coef != 0.0 and self.entropy != "grad":
            raise ValueError(
                f"entropy_coef={self.entropy_coef} needs entropy='grad' (got {self.entropy!r}): "
                "an entropy bonus must be differentiable"
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1), got {self.label_smoothing}")


FIELDS = tuple(f.name for f in fields(PluginSettings))

SETTINGS = PluginSettings(active=False)


def update(**changes) -> PluginSettings:
    """Replace fields of :data:`SETTINGS` (validated as a whole); returns the new settings."""
    global SETTINGS
    unknown = set(changes) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown plugin settings {sorted(unknown)}; known: {list(FIELDS)}")
    SETTINGS = replace(SETTINGS, **changes)
    return SETTINGS


def reset() -> PluginSettings:
    """Back to the defaults, plugin off."""
    global SETTINGS
    SETTINGS = PluginSettings(active=False)
    return SETTINGS


def current() -> PluginSettings:
    return SETTINGS
