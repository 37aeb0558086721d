"""``import megatron_vocabstats.patch``: one line, before the model is built, turns the plugin on
(docs/megatron.md); ``UnsupportedMegatronError`` (an ``ImportError``) when megatron-core is
missing or lacks the names the plugin needs.
"""

from __future__ import annotations

import logging

from .megatron import arguments, compat, model, mtp, settings
from .megatron._patching import PATCHER
from .ops.workspace import with_workspace_reset
from .version_check import is_rank0

logger = logging.getLogger("megatron_vocabstats")

__all__ = ["apply", "remove", "is_applied", "patched_names"]


def _log_rank0(message: str) -> None:
    if is_rank0():
        logger.info(message)


def _targets():
    """``(owner, attribute, factory, label)`` of every binding to replace, resolved up front."""
    language_module = compat.language_module_class()
    gpt_model = compat.gpt_model_class()
    if compat.has_output_processor(gpt_model):  # 0.18+: the official output_processor hook
        hook, factory = "forward", model.make_gpt_forward
    elif hasattr(gpt_model, "_postprocess"):
        hook, factory = "_postprocess", model.make_deferred_head
    else:
        raise compat.UnsupportedMegatronError(
            f"megatron-core {compat.megatron_core_version()}: GPTModel has neither "
            "forward(output_processor=...) nor _postprocess; the plugin supports "
            f"{compat.SUPPORTED}")
    targets = [
        (language_module, "compute_language_model_loss", model.make_compute_language_model_loss,
         "LanguageModule.compute_language_model_loss"),
        (gpt_model, hook, factory, f"GPTModel.{hook} (fused LM head when lm_head_chunk_size > 0)"),
    ]
    if hook == "forward" and hasattr(gpt_model, "build_schedule_plan"):
        # --overlap-moe-expert-parallel-comm: forward_step builds a schedule plan instead of
        # calling forward (0.16-0.17: its postprocess node calls the patched _postprocess)
        plan = (model.make_gpt_forward if compat.has_output_processor(gpt_model,
                                                                      "build_schedule_plan")
                else model.make_unfused_schedule_plan)
        targets.append((gpt_model, "build_schedule_plan", plan,
                        "GPTModel.build_schedule_plan (fused LM head when lm_head_chunk_size > 0)"))
    hybrid_model = compat.hybrid_model_class()
    if hybrid_model is not None:
        targets.append((hybrid_model, "forward", model.make_deferred_head,
                        f"{hybrid_model.__name__}.forward (fused LM head when "
                        "lm_head_chunk_size > 0)"))
    for module in compat.mtp_loss_bindings():
        targets.append((module, "process_mtp_loss", mtp.make_process_mtp_loss,
                        f"{module.__name__}.process_mtp_loss (fused MTP heads)"))
    graph_wrapper = compat.full_cuda_graph_wrapper_class()
    if graph_wrapper is not None:  # a destroyed full-iteration graph drops the op's workspace too
        targets.append((graph_wrapper, "reset_cuda_graph", with_workspace_reset,
                        "FullCudaGraphWrapper.reset_cuda_graph (then reset_workspace)"))
    return targets


def apply(**options) -> settings.PluginSettings:
    """Patch Megatron (once) and turn the plugin on with ``options`` (``PluginSettings`` fields);
    returns the settings in force. Where Megatron parses its arguments later,
    ``--vocab-parallel-stats`` decides. Raises ``UnsupportedMegatronError`` or ``ValueError``."""
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
        missing = [] if compat.hybrid_model_class() is not None else [
            "HybridModel / MambaModel: not in this release, no fused head for it"]
        if not compat.mtp_loss_bindings():
            missing.append("process_mtp_loss (0.17+): not in this release, MTP losses go through "
                           "GPTModel._postprocess")
        _log_rank0(f"megatron-vocabstats: patched {', '.join(patched)} for megatron-core "
                   f"{compat.megatron_core_version()}"
                   + (f"; skipped {'; '.join(missing)}" if missing else ""))
    return new_settings


def remove() -> list[str]:
    """Restore every original Megatron object and turn the plugin off; returns their names."""
    restored = PATCHER.remove_all()
    settings.reset()
    if restored:
        _log_rank0(f"megatron-vocabstats: restored {', '.join(restored)}")
    return restored


def is_applied() -> bool:
    """True while any Megatron binding is replaced."""
    return bool(PATCHER.applied)


def patched_names() -> list[str]:
    """``module.Class.attr`` of every binding currently replaced."""
    return PATCHER.names()


apply()
