"""``import megatron_vocabstats.integrations.verl``: verl's Megatron engine computes its log-probs
and entropy with the ops.

Importing this module calls :func:`apply`, which replaces, in verl's own modules, every binding
its Megatron engine reads of

- ``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy`` and
  ``vocab_parallel_entropy_with_chunking`` (defined in ``verl.utils.megatron.tensor_parallel``,
  imported by ``verl.workers.engine.megatron.transformer_impl``: the unfused path,
  ``use_fused_kernels=False``), and
- ``linear_cross_entropy`` (``verl.utils.kernel.linear_cross_entropy``, imported by
  ``verl.models.mcore.model_forward_fused`` and ``model_forward_1f1b_overlap``: the fused path,
  ``use_fused_kernels=True``; verl's FSDP models import it from its module at call time, so
  they get it too)

with the functions of :mod:`.verl_ops` (verl's signatures and conventions; the differences are
logged once). Every replacement carries the marker of ``megatron._patching`` and ``__wrapped__``
(verl's original): applying twice patches once, :func:`remove` restores every original, and a
failure patches nothing (every target is resolved and checked first). In a Ray job every worker
process must import it: ``VERL_USE_EXTERNAL_MODULES=megatron_vocabstats.integrations.verl``
makes each process that imports verl do so (docs/verl.md).

Raises :class:`UnsupportedVerlError` (an ``ImportError``) when verl is missing, or a module, a
name or a signature above moved or changed (a release other than the one this was written
for, verl 0.9; tested with 0.9.1); then nothing is patched.
"""

from __future__ import annotations

from ..megatron.settings import PluginSettings
from . import verl_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedVerlError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

# The verl releases whose names and conventions verl_ops was written against (major.minor).
TESTED = ("0.9",)

# Where verl defines each replaced function, and the replacement (whose parameter names must be
# verl's: the signature check).
DEFINITIONS = {
    "verl.utils.megatron.tensor_parallel": {
        "vocab_parallel_log_probs_from_logits": verl_ops.log_probs_from_logits,
        "vocab_parallel_entropy": verl_ops.entropy,
        "vocab_parallel_entropy_with_chunking": verl_ops.entropy_with_chunking,
    },
    "verl.utils.kernel.linear_cross_entropy": {
        "linear_cross_entropy": verl_ops.linear_cross_entropy,
    },
}
# The modules of verl's Megatron engine that bind those names at import (``from ... import``):
# their bindings are replaced too.
CONSUMERS = {
    "verl.workers.engine.megatron.transformer_impl": (
        "vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
        "vocab_parallel_entropy_with_chunking"),
    "verl.models.mcore.model_forward_fused": ("linear_cross_entropy",),
    "verl.models.mcore.model_forward_1f1b_overlap": ("linear_cross_entropy",),
}


class UnsupportedVerlError(UnsupportedFrameworkError):
    """verl is missing, or its modules, names or signatures are not the ones this integration
    replaces; nothing was patched."""


FRAMEWORK = Framework(name="verl", distribution="verl", install_hint="pip install 'verl==0.9.*'",
                      tested=TESTED, definitions=DEFINITIONS, consumers=CONSUMERS,
                      error=UnsupportedVerlError, options=verl_ops.OPTIONS)
remove, is_applied, patched_names = FRAMEWORK.remove, FRAMEWORK.is_applied, FRAMEWORK.patched_names


def verl_version() -> str | None:
    """The installed verl's version (its distribution metadata), None if it is not installed."""
    return FRAMEWORK.version()


def apply(**options) -> PluginSettings:
    """Replace verl's log-prob and entropy functions (module docstring) with the ops.

    ``options`` (``verl_ops.OPTIONS.names``, fields of ``PluginSettings`` with their meaning):
    ``vocab_size`` (the real V: padding columns get zero probability; default None, verl's
    W·tp columns), ``logprobs_chunk_size`` (tokens per fp32 chunk of the unfused op, None =
    auto), ``lm_head_chunk_size`` (tokens per chunk of the fused head, 0 = auto),
    ``validate`` (the ops' host-side checks, default True), ``batch_invariant`` and ``kernel``.
    Idempotent: what is patched stays; the given options replace the current ones. Returns the
    options in force.

    Raises:
        UnsupportedVerlError: verl missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options)


apply()
