"""``import megatron_vocabstats.integrations.skyrl``: SkyRL's Megatron backend computes its
log-probs and entropy with the ops (:mod:`.skyrl_ops`), rebound in ``model_utils`` and in the
Megatron model wrapper that imports them (docs/integrations.md, "SkyRL").

Importing calls :func:`apply`; in a Ray job every worker process must import it (e.g. in a
``sitecustomize`` on the workers' path).
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
    """SkyRL is missing or its bindings moved; nothing was patched."""


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
    """Replace SkyRL's log-prob and entropy functions with the ops; returns the options in force.

    ``options``: fields of ``PluginSettings``, as for :func:`.verl.apply`; with ``vocab_size``
    ids at or above it give 0. SkyRL's own CP and packing helpers (``skyrl_ops.HELPERS``) are
    resolved before anything is patched. Idempotent: a second call only replaces the options.

    Raises:
        UnsupportedSkyRLError: SkyRL missing, or its names or helpers moved (nothing is patched).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options, before=lambda: skyrl_ops.set_helpers(_helpers()))


apply()
