"""``import megatron_vocabstats.integrations.nemo_rl`` (calls :func:`apply`; in every Ray worker
that builds the Megatron policy): NeMo-RL's log-probs, top-k and entropy on the ops.
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

TESTED = ("0.6",)

MODEL_UTILS = "nemo_rl.distributed.model_utils"
DEFINITIONS = {
    MODEL_UTILS: {name: getattr(nemo_rl_ops, name) for name in (
        "from_parallel_logits_to_logprobs", "from_parallel_logits_to_logprobs_packed_sequences",
        "get_next_token_logprobs_from_logits", "get_distillation_topk_logprobs_from_logits",
        "distributed_vocab_topk", "from_parallel_hidden_states_to_logprobs")},
}
CONSUMERS = {
    "nemo_rl.algorithms.loss.utils": (
        "from_parallel_logits_to_logprobs_packed_sequences",
        "get_distillation_topk_logprobs_from_logits", "get_next_token_logprobs_from_logits"),
    "nemo_rl.models.megatron.train": (
        "distributed_vocab_topk", "from_parallel_logits_to_logprobs",
        "from_parallel_logits_to_logprobs_packed_sequences"),
}


class UnsupportedNemoRLError(UnsupportedFrameworkError):
    """NeMo-RL is missing or its bindings moved; nothing was patched."""


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
    """Replace NeMo-RL's functions with the ops (:meth:`._framework.Framework.apply`); options as
    for :func:`.verl.apply`; raises :class:`UnsupportedNemoRLError`."""
    return FRAMEWORK.apply(options, before=lambda: nemo_rl_ops.set_fallbacks(
        {name: FRAMEWORK.original(MODEL_UTILS, name) for name in DEFINITIONS[MODEL_UTILS]}))


def remove() -> list[str]:
    """Restore every original NeMo-RL binding; returns the names restored."""
    nemo_rl_ops.set_fallbacks({})
    return FRAMEWORK.remove()


apply()
