"""``import megatron_vocabstats.integrations.skyrl`` (calls :func:`apply`; in every Ray worker):
SkyRL's Megatron log-probs and entropy on the ops.
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
    """The installed SkyRL's version, None if not installed."""
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
    """Replace SkyRL's functions with the ops (:meth:`._framework.Framework.apply`); options as
    for :func:`.verl.apply`; raises :class:`UnsupportedSkyRLError` (also for a moved helper)."""
    return FRAMEWORK.apply(options, before=lambda: skyrl_ops.set_helpers(_helpers()))


apply()
