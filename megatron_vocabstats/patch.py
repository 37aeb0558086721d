"""``import megatron_vocabstats.patch``: one line, before the model is built, turns the plugin on.

It replaces ``LanguageModule.compute_language_model_loss`` (the consumer every loss path reaches:
``GPTModel``, ``HybridModel`` and the MTP layers call it through ``self``) with the exact, chunked
vocab-parallel op; when ``lm_head_chunk_size > 0`` it also computes ``GPTModel``'s loss straight
from the hidden states without materialising the logits (through ``forward``'s
``output_processor`` on 0.18+, through ``_postprocess`` on 0.16-0.17); it makes
``FullCudaGraphWrapper.reset_cuda_graph`` also drop the ops' cached workspace
(:func:`~megatron_vocabstats.ops.workspace.reset_workspace`); it adds the
``--vocab-parallel-stats`` flag family to Megatron's parser and runs the config hook before
``validate_args`` (see :mod:`megatron_vocabstats.megatron.arguments` for how the import and the
flag combine). ``apply(**settings)`` / ``remove()`` give explicit control;
applying twice patches once and ``remove()`` restores every original object.

Raises ``UnsupportedMegatronError`` (an ``ImportError``) at import when megatron-core is missing
or lacks the names the plugin needs.
"""

from __future__ import annotations

import logging
import os

from .megatron import arguments, compat, model, settings
from .megatron._patching import PATCHER
from .ops.workspace import with_workspace_reset

logger = logging.getLogger("megatron_vocabstats")

__all__ = ["apply", "remove", "is_applied", "patched_names"]


def _log_rank0(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        logger.info(message)


def _targets():
    """``(owner, attribute, replacement factory, label)`` of every Megatron binding to replace.

    Resolved before anything is patched, so that an unsupported release fails with nothing
    changed (never half on).
    """
    language_module = compat.language_module_class()
    gpt_model = compat.gpt_model_class()
    if compat.has_output_processor(gpt_model):  # 0.18+: the official output_processor hook
        hook, factory = "forward", model.make_gpt_forward
    elif hasattr(gpt_model, "_postprocess"):
        hook, factory = "_postprocess", model.make_gpt_postprocess
    else:
        raise compat.UnsupportedMegatronError(
            f"megatron-core {compat.megatron_core_version()}: GPTModel has neither "
            "forward(output_processor=...) nor _postprocess; the plugin supports "
            f"{compat.SUPPORTED}"
        )
    targets = [
        (language_module, "compute_language_model_loss", model.make_compute_language_model_loss,
         "LanguageModule.compute_language_model_loss"),
        (gpt_model, hook, factory, f"GPTModel.{hook} (fused LM head when lm_head_chunk_size > 0)"),
    ]
    graph_wrapper = compat.full_cuda_graph_wrapper_class()
    if graph_wrapper is not None:  # a destroyed full-iteration graph drops the op's workspace too
        targets.append((graph_wrapper, "reset_cuda_graph", with_workspace_reset,
                        "FullCudaGraphWrapper.reset_cuda_graph (then reset_workspace)"))
    return targets


def apply(**options) -> settings.PluginSettings:
    """Patch Megatron and turn the plugin on with ``options`` (fields of ``PluginSettings``).

    Idempotent: what is already patched stays as it is; the given options replace the current
    ones (``remove()`` resets them to the defaults). Where Megatron's own argument parsing runs
    later, its config hook decides from ``--vocab-parallel-stats`` whether the plugin stays on.
    Returns the settings in force.

    Raises:
        UnsupportedMegatronError: megatron-core missing or without the needed names (nothing is
            patched then).
        ValueError: an unknown or invalid option (nothing is patched then).
    """
    targets = _targets()
    new_settings = settings.update(active=True, **options)
    patched = []
    try:
        for owner, name, factory, label in targets:
            if PATCHER.replace(owner, name, factory):
                patched.append(label)
        patched += arguments.install(PATCHER)
    except BaseException:
        remove()
        raise
    if patched:
        _log_rank0(f"megatron-vocabstats: patched {', '.join(patched)} for megatron-core "
                   f"{compat.megatron_core_version()}")
    return new_settings


def remove() -> list[str]:
    """Restore every original Megatron object and turn the plugin off; returns what was restored."""
    restored = PATCHER.remove_all()
    settings.reset()
    if restored:
        _log_rank0(f"megatron-vocabstats: restored {', '.join(restored)}")
    return restored


def is_applied() -> bool:
    """True while any Megatron binding is replaced (between ``apply()`` and ``remove()``)."""
    return bool(PATCHER.applied)


def patched_names() -> list[str]:
    """``module.Class.attr`` of every binding currently replaced."""
    return PATCHER.names()


apply()
