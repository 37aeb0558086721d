"""``import megatron_vocabstats.integrations.slime``, or slime's own hook
``--custom-megatron-init-path megatron_vocabstats.integrations.slime.apply``: slime's Megatron
trainer computes its log-probs and entropy with the ops.

Applying replaces ``calculate_log_probs_and_entropy`` where slime defines it
(``slime.utils.ppo_utils``) and where its Megatron loss binds it at import
(``slime.backends.megatron_utils.loss``, whose ``get_log_probs_and_entropy`` calls it once per
packed row, for the policy loss, the log-prob recompute and the reference model) with
:func:`.slime_ops.calculate_log_probs_and_entropy` (slime's signature and conventions; the
differences are logged once). Names read at THUDM/slime ``624b824`` (slime 0.3.1). Every
replacement carries the marker of ``megatron._patching`` and ``__wrapped__`` (slime's original):
applying twice patches once, :func:`remove` restores, and a failure patches nothing.

slime's hook runs ``load_function(path)(args)`` in every Megatron actor process after Megatron's
initialisation (``slime/backends/megatron_utils/initialize.py``), so :func:`apply` takes slime's
``args`` as an optional first argument (not read).

Raises :class:`UnsupportedSlimeError` (an ``ImportError``) when slime is missing, or a module,
the name or its signature moved; then nothing is patched.
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

# The slime releases whose names and conventions slime_ops was written against (major.minor).
TESTED = ("0.3",)

DEFINITIONS = {
    "slime.utils.ppo_utils": {
        "calculate_log_probs_and_entropy": slime_ops.calculate_log_probs_and_entropy,
    },
}
# slime's Megatron loss binds the name at import (``from slime.utils.ppo_utils import ...``).
CONSUMERS = {
    "slime.backends.megatron_utils.loss": ("calculate_log_probs_and_entropy",),
}


class UnsupportedSlimeError(UnsupportedFrameworkError):
    """slime is missing, or its modules, names or signatures are not the ones this integration
    replaces; nothing was patched."""


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
    """Replace slime's ``calculate_log_probs_and_entropy`` (module docstring) with the ops.

    ``args``: what slime's ``--custom-megatron-init-path`` hook passes (its argument namespace;
    not read). ``options`` (fields of ``PluginSettings``, as for the verl integration):
    ``vocab_size`` (the real V: padding columns get zero probability and ids ``>= vocab_size``
    count as outside the vocabulary; default None, slime's W·tp columns),
    ``logprobs_chunk_size`` (tokens per fp32 chunk, None = auto), ``validate`` (default True),
    ``batch_invariant`` and ``kernel`` (``lm_head_chunk_size`` is accepted and unused: slime has
    no fused path). Idempotent; the given options replace the current ones. Returns the options
    in force.

    Raises:
        UnsupportedSlimeError: slime missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    del args
    return FRAMEWORK.apply(options)


apply()
