"""``import megatron_vocabstats.integrations.slime``, or slime's hook
``--custom-megatron-init-path megatron_vocabstats.integrations.slime.apply``: slime's log-probs
and entropy on the ops.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

from ..megatron.settings import PluginSettings
from . import slime_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedSlimeError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED", "slime_version"]

TESTED = ("0.3",)

DEFINITIONS = {"slime.utils.ppo_utils": {
    "calculate_log_probs_and_entropy": slime_ops.calculate_log_probs_and_entropy}}
CONSUMERS = {"slime.backends.megatron_utils.loss": ("calculate_log_probs_and_entropy",)}


class UnsupportedSlimeError(UnsupportedFrameworkError):
    """slime is missing or its bindings moved; nothing was patched."""


def slime_version() -> str | None:
    """The importable slime's version: its distribution's (``pip install -e .`` of a checkout),
    else ``slime.__version__``, else "unknown"; None if ``slime`` cannot be found."""
    try:
        if "slime" not in sys.modules and importlib.util.find_spec("slime") is None:
            return None
        module = importlib.import_module("slime")
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version("slime")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


FRAMEWORK = Framework(
    name="slime", distribution=None, version_of=slime_version,
    install_hint="a checkout of THUDM/slime installed with pip install -e .", tested=TESTED,
    definitions=DEFINITIONS, consumers=CONSUMERS, error=UnsupportedSlimeError,
    options=slime_ops.OPTIONS)
remove, is_applied, patched_names = FRAMEWORK.remove, FRAMEWORK.is_applied, FRAMEWORK.patched_names


def apply(args=None, /, **options) -> PluginSettings:
    """Replace slime's function with the ops (:meth:`._framework.Framework.apply`); ``args``,
    from slime's hook, is not read; options as for :func:`.verl.apply` (``lm_head_chunk_size``
    unused); raises :class:`UnsupportedSlimeError`."""
    del args
    return FRAMEWORK.apply(options)


apply()
