"""``import megatron_vocabstats.integrations.areal``: AReaL's engines compute their log-probs and
entropy with the ops (:mod:`.areal_ops`), rebound wherever AReaL defines or imports
``gather_logprobs`` and ``gather_logprobs_entropy`` (docs/integrations.md, "AReaL").

Importing calls :func:`apply`; every training process must import it (e.g. at the top of the
training script, before the engine is built).
"""

from __future__ import annotations

from ..megatron.settings import PluginSettings
from . import areal_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedArealError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

TESTED = ("1.0",)

_NAMES = ("gather_logprobs", "gather_logprobs_entropy")
DEFINITIONS = {
    "areal.utils.functional.vocab_parallel": {
        "gather_logprobs": areal_ops.gather_logprobs,
        "gather_logprobs_entropy": areal_ops.gather_logprobs_entropy,
    },
}
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
    """Replace AReaL's ``gather_logprobs`` and ``gather_logprobs_entropy`` with the ops; returns
    the options in force.

    ``options``: ``logprobs_chunk_size``, ``validate``, ``batch_invariant``, ``kernel``
    (``PluginSettings`` fields). AReaL always normalises over the W·tp columns and has no fused
    head, so ``vocab_size`` and ``lm_head_chunk_size`` are not taken. Idempotent: a second call
    only replaces the options.

    Raises:
        UnsupportedArealError: AReaL missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options)


apply()
