"""``import megatron_vocabstats.integrations.areal``: AReaL's engines compute their log-probs and
entropy with the ops.

Importing this module calls :func:`apply`, which replaces ``gather_logprobs`` and
``gather_logprobs_entropy`` where AReaL defines them (``areal.utils.functional.vocab_parallel``)
and in every module that binds them at import: ``areal.utils.functional`` (its package, which
re-exports them), ``areal.models.tree_attn.functional`` (tree training) and the Megatron, FSDP
and Archon engines (``areal.engine.megatron_engine``, ``areal.engine.fsdp_engine``,
``areal.experimental.engine.archon_engine``), with the functions of :mod:`.areal_ops` (AReaL's
signatures and conventions; the differences are logged once). An engine whose backend is not
installed (importing it fails on a missing third-party module) is skipped with one INFO line: it
cannot run. Every replacement carries the marker of ``megatron._patching`` and ``__wrapped__``
(AReaL's original): applying twice patches once, :func:`remove` restores every original, and a
failure patches nothing. In a multi-process job every training process must import it (for
example at the top of the training script, before the engine is built).

Raises :class:`UnsupportedArealError` (an ``ImportError``) when AReaL is missing, or a module,
a name or a signature above moved or changed (read from AReaL 1.0.4); then nothing is patched.
"""

from __future__ import annotations

from ..megatron.settings import PluginSettings
from . import areal_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedArealError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

# The AReaL releases whose names and conventions areal_ops was written against (major.minor).
TESTED = ("1.0",)

_NAMES = ("gather_logprobs", "gather_logprobs_entropy")
DEFINITIONS = {
    "areal.utils.functional.vocab_parallel": {
        "gather_logprobs": areal_ops.gather_logprobs,
        "gather_logprobs_entropy": areal_ops.gather_logprobs_entropy,
    },
}
# AReaL's modules that bind both names at import (``from ... import``).
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
    """AReaL is missing, or its modules, names or signatures are not the ones this integration
    replaces; nothing was patched."""


FRAMEWORK = Framework(name="AReaL", distribution="areal",
                      install_hint="pip install 'areal==1.0.4'", tested=TESTED,
                      definitions=DEFINITIONS, consumers=CONSUMERS, optional=ENGINES,
                      error=UnsupportedArealError, options=areal_ops.OPTIONS)
remove, is_applied, patched_names = FRAMEWORK.remove, FRAMEWORK.is_applied, FRAMEWORK.patched_names


def apply(**options) -> PluginSettings:
    """Replace AReaL's ``gather_logprobs`` and ``gather_logprobs_entropy`` (module docstring)
    with the ops.

    ``options`` (``areal_ops.OPTIONS.names``, fields of ``PluginSettings`` with their meaning):
    ``logprobs_chunk_size`` (tokens per fp32 chunk, None = auto), ``validate`` (the ops'
    host-side checks, default True), ``batch_invariant`` and ``kernel``. Idempotent: what is
    patched stays; the given options replace the current ones. Returns the options in force.

    Raises:
        UnsupportedArealError: AReaL missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options)


apply()
