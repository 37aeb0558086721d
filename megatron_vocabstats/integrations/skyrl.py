"""``import megatron_vocabstats.integrations.skyrl``: SkyRL's Megatron backend computes its
log-probs and entropy with the ops.

Importing this module calls :func:`apply`, which replaces the eight functions of
``skyrl.backends.skyrl_train.distributed.megatron.model_utils`` that SkyRL's
``workers.megatron.megatron_model_wrapper`` imports (there and in that module):
``from_parallel_logits_to_logprobs[_packed_sequences]`` and
``vocab_parallel_entropy[_packed_sequences]`` (the unfused path) and
``from_parallel_hidden_to_logprobs[_packed_sequences]``,
``_fused_vocab_parallel_entropy_from_hidden`` and
``from_parallel_hidden_to_entropy_packed_sequences`` (``trainer.fused_lm_head_logprob=true``:
the LM head fused into the statistics), with the functions of :mod:`.skyrl_ops` (SkyRL's
signatures and conventions; the differences are logged once). SkyRL's own CP and packing
helpers (:data:`.skyrl_ops.HELPERS`) are resolved first and kept. Applying twice patches once,
:func:`remove` restores every original, and a failure patches nothing. In a Ray job every
worker process must import it (e.g. in a ``sitecustomize`` on the workers' path).

Raises :class:`UnsupportedSkyRLError` (an ``ImportError``) when SkyRL is missing, or a module, a
name or a signature above moved or changed (a release other than the one this was written for,
SkyRL 0.3; tested with 0.3.0); then nothing is patched.
"""

from __future__ import annotations

from ..megatron.settings import PluginSettings
from . import skyrl_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedSkyRLError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

TESTED = ("0.3",)
MODEL_UTILS = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
WRAPPER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"
NAMES = tuple(skyrl_ops.NOTES)

DEFINITIONS = {MODEL_UTILS: {name: getattr(skyrl_ops, name) for name in NAMES}}
CONSUMERS = {WRAPPER: NAMES}


class UnsupportedSkyRLError(UnsupportedFrameworkError):
    """SkyRL is missing, or its modules, names or signatures are not the ones this integration
    replaces; nothing was patched."""


FRAMEWORK = Framework(name="SkyRL", distribution="skyrl",
                      install_hint="pip install 'skyrl[megatron]==0.3.*'", tested=TESTED,
                      definitions=DEFINITIONS, consumers=CONSUMERS, error=UnsupportedSkyRLError,
                      options=skyrl_ops.OPTIONS)
remove, is_applied, patched_names = FRAMEWORK.remove, FRAMEWORK.is_applied, FRAMEWORK.patched_names


def skyrl_version() -> str | None:
    """The installed SkyRL's version (its distribution metadata), None if not installed."""
    return FRAMEWORK.version()


def _helpers() -> dict:
    helpers = {}
    for name in skyrl_ops.HELPERS:
        try:
            helpers[name] = FRAMEWORK.original(MODEL_UTILS, name)
        except AttributeError:
            raise UnsupportedSkyRLError(
                f"megatron-vocabstats' SkyRL integration: SkyRL {skyrl_version()}: {MODEL_UTILS} "
                f"has no {name} (its CP/packing code the integration keeps). It replaces the "
                f"names of SkyRL {' and '.join(TESTED)}; nothing was patched") from None
    return helpers


def apply(**options) -> PluginSettings:
    """Replace SkyRL's log-prob and entropy functions (module docstring) with the ops.

    ``options`` (``skyrl_ops.OPTIONS.names``, fields of ``PluginSettings`` with their meaning):
    ``vocab_size`` (the real V: padding columns get zero probability and ids at or above it
    give 0; default None, SkyRL's W·tp columns), ``logprobs_chunk_size`` (tokens per fp32
    chunk of the unfused op, None = auto), ``lm_head_chunk_size`` (tokens per chunk of the
    fused head, 0 = auto), ``validate`` (default True), ``batch_invariant`` and ``kernel``.
    Idempotent: what is patched stays; the given options replace the current ones. Returns the
    options in force.

    Raises:
        UnsupportedSkyRLError: SkyRL missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options, before=lambda: skyrl_ops.set_helpers(_helpers()))


apply()
