"""``import megatron_vocabstats.integrations.verl`` (calls :func:`apply`; in every Ray worker via
``VERL_USE_EXTERNAL_MODULES``, docs/verl.md): verl's log-probs and entropy on the ops.
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
        "vocab_parallel_entropy_with_chunking": verl_ops.entropy_with_chunking},
    "verl.utils.kernel.linear_cross_entropy": {
        "linear_cross_entropy": verl_ops.linear_cross_entropy}}
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
    """The installed verl's version, None if it is not installed."""
    return FRAMEWORK.version()


def apply(**options) -> PluginSettings:
    """Replace verl's functions with the ops (:meth:`._framework.Framework.apply`); options: the
    ``PluginSettings`` fields of docs/verl.md's table; raises :class:`UnsupportedVerlError`."""
    return FRAMEWORK.apply(options)


apply()
