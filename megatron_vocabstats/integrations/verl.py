"""``import megatron_vocabstats.integrations.verl``: verl's Megatron engine computes its log-probs
and entropy with the ops (:mod:`.verl_ops`), rebound in verl's own modules (docs/verl.md).

Importing calls :func:`apply`. In a Ray job every worker process must import it:
``VERL_USE_EXTERNAL_MODULES=megatron_vocabstats.integrations.verl`` makes each process that
imports verl do so.
"""

from __future__ import annotations

from ..megatron.settings import PluginSettings
from . import verl_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedVerlError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

TESTED = ("0.9",)

DEFINITIONS = {
    "verl.utils.megatron.tensor_parallel": {
        "vocab_parallel_log_probs_from_logits": verl_ops.log_probs_from_logits,
        "vocab_parallel_entropy": verl_ops.entropy,
        "vocab_parallel_entropy_with_chunking": verl_ops.entropy_with_chunking,
    },
    "verl.utils.kernel.linear_cross_entropy": {
        "linear_cross_entropy": verl_ops.linear_cross_entropy,
    },
}
CONSUMERS = {
    "verl.workers.engine.megatron.transformer_impl": (
        "vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
        "vocab_parallel_entropy_with_chunking"),
    "verl.models.mcore.model_forward_fused": ("linear_cross_entropy",),
    "verl.models.mcore.model_forward_1f1b_overlap": ("linear_cross_entropy",),
}


class UnsupportedVerlError(UnsupportedFrameworkError):
    """verl is missing or its bindings moved; nothing was patched."""


FRAMEWORK = Framework(name="verl", distribution="verl", install_hint="pip install 'verl==0.9.*'",
                      tested=TESTED, definitions=DEFINITIONS, consumers=CONSUMERS,
                      error=UnsupportedVerlError, options=verl_ops.OPTIONS)
remove, is_applied, patched_names = FRAMEWORK.remove, FRAMEWORK.is_applied, FRAMEWORK.patched_names


def verl_version() -> str | None:
    """The installed verl's version (its distribution metadata), None if it is not installed."""
    return FRAMEWORK.version()


def apply(**options) -> PluginSettings:
    """Replace verl's log-prob and entropy functions with the ops; returns the options in force.

    ``options``: fields of ``PluginSettings`` (``verl_ops.OPTIONS.names``; table in docs/verl.md);
    ``lm_head_chunk_size`` 0 means auto. Idempotent: a second call only replaces the options.

    Raises:
        UnsupportedVerlError: verl missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options)


apply()
