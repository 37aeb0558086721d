"""``import megatron_vocabstats.integrations.slime``, or slime's own hook
``--custom-megatron-init-path megatron_vocabstats.integrations.slime.apply``: slime's Megatron
trainer computes its log-probs and entropy with the ops (:mod:`.slime_ops`), rebound where slime
defines and binds ``calculate_log_probs_and_entropy`` (read at THUDM/slime ``624b824``, slime
0.3.1; docs/integrations.md, "slime").
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

DEFINITIONS = {
    "slime.utils.ppo_utils": {
        "calculate_log_probs_and_entropy": slime_ops.calculate_log_probs_and_entropy,
    },
}
CONSUMERS = {
    "slime.backends.megatron_utils.loss": ("calculate_log_probs_and_entropy",),
}


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
    """Replace slime's ``calculate_log_probs_and_entropy`` with the ops; returns the options in
    force.

    ``args``: the namespace slime's hook passes (``load_function(path)(args)``); not read.
    ``options``: fields of ``PluginSettings``, as for :func:`.verl.apply`; with ``vocab_size`` an
    id ``>= vocab_size`` counts as outside the vocabulary; ``lm_head_chunk_size`` is accepted and
    unused (slime has no fused path). Idempotent: a second call only replaces the options.

    Raises:
        UnsupportedSlimeError: slime missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    del args
    return FRAMEWORK.apply(options)


apply()
