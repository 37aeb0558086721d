"""``import megatron_vocabstats.integrations.areal`` (calls :func:`apply`; in every training
process, before the engine is built): AReaL's log-probs and entropy on the ops.
"""

from __future__ import annotations

from ..megatron.settings import PluginSettings
from . import areal_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedArealError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

TESTED = ("1.0",)

_NAMES = ("gather_logprobs", "gather_logprobs_entropy")
DEFINITIONS = {"areal.utils.functional.vocab_parallel": {
    "gather_logprobs": areal_ops.gather_logprobs,
    "gather_logprobs_entropy": areal_ops.gather_logprobs_entropy}}
CONSUMERS = {
    "areal.utils.functional": _NAMES,
    "areal.models.tree_attn.functional": _NAMES,
    "areal.engine.megatron_engine": _NAMES,
    "areal.engine.fsdp_engine": _NAMES,
    "areal.experimental.engine.archon_engine": _NAMES,
}
# Engines: each needs its own backend (megatron-core and mbridge; peft; Archon's models).
ENGINES = ("areal.engine.megatron_engine", "areal.engine.fsdp_engine",
           "areal.experimental.engine.archon_engine")


class UnsupportedArealError(UnsupportedFrameworkError):
    """AReaL is missing or its bindings moved; nothing was patched."""


FRAMEWORK = Framework(name="AReaL", distribution="areal",
                      install_hint="pip install 'areal==1.0.4'", tested=TESTED,
                      definitions=DEFINITIONS, consumers=CONSUMERS, optional=ENGINES,
                      error=UnsupportedArealError, options=areal_ops.OPTIONS)
remove, is_applied, patched_names = FRAMEWORK.remove, FRAMEWORK.is_applied, FRAMEWORK.patched_names


def apply(**options) -> PluginSettings:
    """Replace AReaL's ``gather_logprobs`` and ``gather_logprobs_entropy`` with the ops
    (:meth:`._framework.Framework.apply`). ``options``: ``logprobs_chunk_size``, ``validate``,
    ``batch_invariant``, ``kernel`` (no ``vocab_size``: AReaL normalises over the W·tp columns;
    no ``lm_head_chunk_size``: no fused head). Raises :class:`UnsupportedArealError`."""
    return FRAMEWORK.apply(options)


apply()
