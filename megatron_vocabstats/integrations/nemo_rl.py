"""``import megatron_vocabstats.integrations.nemo_rl``: NeMo-RL's Megatron policy computes its
log-probs, distillation top-k and entropy with the ops.

Importing this module calls :func:`apply`, which replaces, in NeMo-RL's own modules, every
binding its Megatron training and loss code reads of these functions of
``nemo_rl.distributed.model_utils`` (read at NVIDIA-NeMo/RL ``7ea279a``, NeMo-RL 0.6):

- ``get_next_token_logprobs_from_logits`` (bound in ``nemo_rl.algorithms.loss.utils``: the
  loss input of every log-prob loss), ``from_parallel_logits_to_logprobs`` (bound in
  ``nemo_rl.models.megatron.train``: the log-prob post-processor) and
  ``from_parallel_logits_to_logprobs_packed_sequences`` (both modules: sequence packing), which
  run ``DistributedLogprob`` / ``ChunkedDistributedLogprob``;
- ``get_distillation_topk_logprobs_from_logits`` (``loss.utils``: the student's top-k
  log-probs and ``H_all``, ``ChunkedDistributedGatherLogprob`` and
  ``ChunkedDistributedEntropy``) and ``distributed_vocab_topk`` (``train``: the teacher's
  top-k);
- ``from_parallel_hidden_states_to_logprobs`` (the fused path: NeMo-RL's patched
  ``GPTModel.forward`` calls it through the module, ``ChunkedDistributedHiddenStatesToLogprobs``),
  computed by the fused head ``linear_vocab_parallel_stats``;

with the functions of :mod:`.nemo_rl_ops` (NeMo-RL's signatures and conventions; the
differences are logged once). Top-k/top-p sampling, DTensor and single-device logits stay
NeMo-RL's. Every replacement carries ``__wrapped__`` (NeMo-RL's original): applying twice
patches once, :func:`remove` restores every original, and a failure patches nothing. In a Ray
job every worker process that builds the Megatron policy must import it.

Raises :class:`UnsupportedNemoRLError` (an ``ImportError``) when NeMo-RL is missing, or a module,
a name or a signature above moved or changed; then nothing is patched.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

from ..megatron.settings import PluginSettings
from . import nemo_rl_ops
from ._framework import Framework, UnsupportedFrameworkError

__all__ = ["UnsupportedNemoRLError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED", "nemo_rl_version"]

# The NeMo-RL releases whose names and conventions nemo_rl_ops was written against.
TESTED = ("0.6",)

MODEL_UTILS = "nemo_rl.distributed.model_utils"
DEFINITIONS = {
    MODEL_UTILS: {name: getattr(nemo_rl_ops, name) for name in (
        "from_parallel_logits_to_logprobs",
        "from_parallel_logits_to_logprobs_packed_sequences",
        "get_next_token_logprobs_from_logits",
        "get_distillation_topk_logprobs_from_logits",
        "distributed_vocab_topk",
        "from_parallel_hidden_states_to_logprobs",
    )},
}
# NeMo-RL's modules that bind those names at import (``from ... import``).
CONSUMERS = {
    "nemo_rl.algorithms.loss.utils": (
        "from_parallel_logits_to_logprobs_packed_sequences",
        "get_distillation_topk_logprobs_from_logits", "get_next_token_logprobs_from_logits"),
    "nemo_rl.models.megatron.train": (
        "distributed_vocab_topk", "from_parallel_logits_to_logprobs",
        "from_parallel_logits_to_logprobs_packed_sequences"),
}


class UnsupportedNemoRLError(UnsupportedFrameworkError):
    """NeMo-RL is missing, or its modules, names or signatures are not the ones this
    integration replaces; nothing was patched."""


def nemo_rl_version() -> str | None:
    """The installed NeMo-RL's version: its distribution's, else ``nemo_rl.__version__`` (NeMo-RL
    is usually run from a checkout); None if ``nemo_rl`` cannot be found."""
    for distribution in ("nemo-rl", "nemo_rl"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        if "nemo_rl" not in sys.modules and importlib.util.find_spec("nemo_rl") is None:
            return None
        return str(getattr(importlib.import_module("nemo_rl"), "__version__", "unknown"))
    except (ImportError, ValueError):
        return None


FRAMEWORK = Framework(
    name="NeMo-RL", distribution=None, version_of=nemo_rl_version,
    install_hint="a checkout of NVIDIA-NeMo/RL on the path, Python 3.13", tested=TESTED,
    definitions=DEFINITIONS, consumers=CONSUMERS, error=UnsupportedNemoRLError,
    options=nemo_rl_ops.OPTIONS)
is_applied, patched_names = FRAMEWORK.is_applied, FRAMEWORK.patched_names


def apply(**options) -> PluginSettings:
    """Replace NeMo-RL's log-prob, top-k and entropy functions (module docstring) with the ops.

    ``options`` (fields of ``PluginSettings``, as for the verl integration): ``vocab_size`` (the
    real V: padding columns get zero probability; default None, NeMo-RL's W·tp columns),
    ``logprobs_chunk_size``, ``lm_head_chunk_size`` (tokens per chunk, None/0 = auto),
    ``validate`` (default True), ``batch_invariant`` and ``kernel``. Idempotent; the given
    options replace the current ones. Returns the options in force.

    Raises:
        UnsupportedNemoRLError: NeMo-RL missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    return FRAMEWORK.apply(options, before=lambda: nemo_rl_ops.set_fallbacks(
        {name: FRAMEWORK.original(MODEL_UTILS, name) for name in DEFINITIONS[MODEL_UTILS]}))


def remove() -> list[str]:
    """Restore every original NeMo-RL binding; returns the names restored."""
    nemo_rl_ops.set_fallbacks({})
    return FRAMEWORK.remove()


apply()
