"""The plugin's run-time settings, :data:`SETTINGS`, written by ``patch.apply`` and the config
hook: while ``active`` is False the patched call sites run Megatron's original code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..losses.stats import StatsOptions
from ..ops.options import check_bool, check_choice, check_number, check_option
from ..ops.sampling.from_logits import sampler_problem
from ..rollout import ROLLOUT_LEVELS, ROLLOUT_MODES, RolloutCorrection, correction_bounds

# The rollout-correction modes of the settings and the --rollout-correction flag: "none" = off.
ROLLOUT_CORRECTION_MODES = ("none", *ROLLOUT_MODES)


@dataclass(frozen=True, kw_only=True, slots=True)
class PluginSettings:
    """Options of the patched loss path: each field means what its flag does (docs/megatron.md;
    ``active``: ``--vocab-parallel-stats``, ``validate``: not ``--vocab-stats-skip-checks``),
    but ``logprobs_chunk_size`` None is auto and ``batch_invariant`` is the ops' False, True or
    "tp". Without a flag: ``vocab_size``, the real vocabulary size (None: the padded size, whose
    padding columns enter the softmax as in Megatron's own loss), and ``token_alignment``, the
    per-sequence padding multiple the config hook sets for :mod:`megatron_vocabstats.packing`.
    Raises ``TypeError`` (a wrong type) or ``ValueError`` (out of range, an unknown mode, an
    inconsistent combination), naming the field."""

    active: bool = True
    logprobs_chunk_size: int | None = None
    lm_head_chunk_size: int = 0
    require_fused_lm_head: bool = False
    entropy: str = "off"
    entropy_coef: float = 0.0
    label_smoothing: float = 0.0
    vocab_size: int | None = None
    validate: bool = True
    token_alignment: int = 1
    batch_invariant: bool | str = False
    kernel: str = "auto"
    rollout_temperature: float = 1.0
    rollout_top_k: int | None = None
    rollout_top_p: float = 1.0
    rollout_min_p: float = 0.0
    rollout_correction_mode: str = "none"
    rollout_correction_level: str = "token"
    rollout_correction_threshold: float | None = None
    rollout_correction_low: float | None = None
    rollout_correction_high: float | None = None

    def __post_init__(self):
        for name in ("active", "validate", "require_fused_lm_head"):
            object.__setattr__(self, name, check_bool(name, getattr(self, name)))
        # Numbers stored as Python numbers (numpy numbers accepted).
        top = 2**63 - 1
        for name, rule in (("lm_head_chunk_size", dict(integer=True, low=0, high=top)),
                           ("logprobs_chunk_size", dict(integer=True, low=1, high=top,
                                                        none_ok=True)),
                           ("vocab_size", dict(integer=True, low=1, high=top, none_ok=True)),
                           ("token_alignment", dict(integer=True, low=1, high=top)),
                           ("entropy_coef", {}),
                           ("rollout_temperature", dict(low=0.0, low_open=True))):
            object.__setattr__(self, name, check_number(name, getattr(self, name), **rule))
        for name in ("label_smoothing", "batch_invariant", "entropy", "kernel"):  # the ops' own
            object.__setattr__(self, name, check_option(name, getattr(self, name)))
        if self.entropy_coef != 0.0 and self.entropy != "grad":
            raise ValueError(
                f"entropy_coef={self.entropy_coef} needs entropy='grad' (got {self.entropy!r}): "
                "an entropy bonus must be differentiable")
        if self.require_fused_lm_head and not self.lm_head_chunk_size:
            raise ValueError("require_fused_lm_head=True needs the fused LM head: "
                             "lm_head_chunk_size > 0 (got 0)")
        self._check_rollout()

    def _check_rollout(self) -> None:
        if self.rollout_top_k == -1 and not isinstance(self.rollout_top_k, bool):
            object.__setattr__(self, "rollout_top_k", None)  # vLLM's "off", as the flag reads it
        problem = sampler_problem(self.rollout_top_k, self.rollout_top_p, self.rollout_min_p)
        if problem is not None:
            raise type(problem)(f"rollout_{problem}")
        for name in ("rollout_top_k", "rollout_top_p", "rollout_min_p"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int(value) if name == "rollout_top_k"
                                   else float(value))
        check_choice("rollout_correction_mode", self.rollout_correction_mode,
                     ROLLOUT_CORRECTION_MODES)
        check_choice("rollout_correction_level", self.rollout_correction_level, ROLLOUT_LEVELS)
        if self.rollout_correction_mode == "none":
            for name in ("threshold", "low", "high"):
                if getattr(self, f"rollout_correction_{name}") is not None:
                    raise ValueError(f"rollout_correction_{name} needs a rollout_correction_mode"
                                     f" (got 'none')")
            return
        # RolloutCorrection's checks, naming these fields; given bounds stored as floats.
        bounds = correction_bounds(
            self.rollout_correction_mode, self.rollout_correction_level,
            self.rollout_correction_threshold, self.rollout_correction_low,
            self.rollout_correction_high, prefix="rollout_correction_")
        for name, value in zip(("threshold", "low", "high"), bounds):
            if getattr(self, f"rollout_correction_{name}") is not None:
                object.__setattr__(self, f"rollout_correction_{name}", value)

    def stats_options(self, *, fused: bool = False) -> StatsOptions:
        """The :class:`~megatron_vocabstats.StatsOptions` of these settings (temperature 1),
        chunked by ``logprobs_chunk_size`` or, with ``fused``, ``lm_head_chunk_size``."""
        return StatsOptions(vocab_size=self.vocab_size,
                            chunk_size=(self.lm_head_chunk_size or None) if fused
                            else self.logprobs_chunk_size,
                            entropy=self.entropy, label_smoothing=self.label_smoothing,
                            validate=self.validate, batch_invariant=self.batch_invariant,
                            kernel=self.kernel)

    def rollout_correction(self) -> RolloutCorrection | None:
        """The :class:`~megatron_vocabstats.RolloutCorrection` of these settings for
        ``policy_loss(..., rollout_correction=...)``; None for mode "none"."""
        if self.rollout_correction_mode == "none":
            return None
        return RolloutCorrection(mode=self.rollout_correction_mode,
                                 level=self.rollout_correction_level,
                                 threshold=self.rollout_correction_threshold,
                                 low=self.rollout_correction_low,
                                 high=self.rollout_correction_high, validate=self.validate)

    def sampler_options(self) -> dict:
        """The sampler keywords of :func:`~megatron_vocabstats.vocab_parallel_sampling_logprobs`
        (``temperature``, ``top_k``, ``top_p``, ``min_p``; filters that are off as None)."""
        return {"temperature": float(self.rollout_temperature), "top_k": self.rollout_top_k,
                "top_p": None if self.rollout_top_p in (None, 1.0) else float(self.rollout_top_p),
                "min_p": float(self.rollout_min_p) if self.rollout_min_p else None}


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
