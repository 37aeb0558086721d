"""The one log line that says the plugin is on, and how: rank 0, first loss of the run, once, on
the ``megatron_vocabstats`` logger (docs/megatron.md#the-import-and-the-flags), with the
version warnings.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .. import version_check
from ..mcore import tp_group_of
from ..ops.kernels import KERNEL_ENV, forced_kernel, resolve_kernel
from . import compat, settings

logger = logging.getLogger("megatron_vocabstats")

_ANNOUNCED = False
# PluginSettings.batch_invariant (False, True, "tp") in the flag's words.
_BATCH_INVARIANT_WORD = {False: "off", True: "batch"}


def _on_off(flag) -> str:
    return "on" if flag else "off"


def describe(cfg: settings.PluginSettings, *, fused: bool | None = None,
             device: torch.device | None = None) -> str:
    """How the patched loss path computes with ``cfg``, in words. ``fused`` None:
    ``lm_head_chunk_size > 0``; ``device``: where ``kernel="auto"`` is resolved (None: not)."""
    if not cfg.active:
        return "off (the patched call sites run Megatron's own loss)"
    fused = cfg.lm_head_chunk_size > 0 if fused is None else fused
    if fused:
        head = f"fused LM head (chunk {cfg.lm_head_chunk_size} tokens)"
    else:
        chunk = cfg.logprobs_chunk_size
        head = f"unfused (chunk {f'{chunk} tokens' if chunk else 'auto'})"
    kernel = cfg.kernel
    if device is not None and kernel == "auto":
        try:
            kernel = f"auto -> {resolve_kernel('auto', device)}"
        except ValueError:  # a bad VOCABSTATS_KERNEL: the op itself raises it, naming it
            pass
    if cfg.kernel == "auto" and forced_kernel():  # the environment decided the backend
        kernel += f" ({KERNEL_ENV}={forced_kernel()})"
    parts = [head, f"entropy {cfg.entropy}"
             + (f" (coef {cfg.entropy_coef})" if cfg.entropy_coef else ""),
             f"kernel {kernel}", f"label smoothing {cfg.label_smoothing}",
             f"checks {_on_off(cfg.validate)}",
             f"batch invariance {_BATCH_INVARIANT_WORD.get(cfg.batch_invariant, 'tp')}"]
    if cfg.vocab_size is not None:
        parts.append(f"vocab size {cfg.vocab_size}")
    return "on: " + ", ".join(parts)


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def layout(module) -> str:
    """``"tp 2, cp 1, sequence parallel off"`` of a Megatron module (its groups and config)."""
    config = getattr(module, "config", None)
    cp_group = getattr(getattr(module, "pg_collection", None), "cp", None)
    cp = _group_size(cp_group) if cp_group is not None else \
        getattr(config, "context_parallel_size", 1) or 1
    return (f"tp {_group_size(tp_group_of(module))}, cp {cp}, sequence parallel "
            f"{_on_off(getattr(config, 'sequence_parallel', False))}")


def superseded(module) -> str:
    """``"; supersedes cross_entropy_loss_fusion=True (...)"`` where the module's config asks for
    it (Megatron-Bridge's default); else ``""``."""
    config = getattr(module, "config", None)
    if not getattr(config, "cross_entropy_loss_fusion", False):
        return ""
    impl = getattr(config, "cross_entropy_fusion_impl", None)
    return (f"; supersedes cross_entropy_loss_fusion=True (cross_entropy_fusion_impl {impl!r}: "
            f"Megatron's fused cross-entropy does not run)")


def once(module, cfg: settings.PluginSettings, *, fused: bool, device: torch.device) -> None:
    """Log the line on rank 0 the first time a patched call site runs the plugin."""
    global _ANNOUNCED
    if _ANNOUNCED:
        return
    _ANNOUNCED = True
    if not version_check.is_rank0():
        return
    from .. import __version__

    release = compat.megatron_core_release()
    version_check.warn_untested(megatron_core=release, stacklevel=3)
    logger.info(f"megatron-vocabstats {__version__} {describe(cfg, fused=fused, device=device)}; "
                f"{layout(module)}; megatron-core {release}{superseded(module)}")


def reset() -> None:
    """Re-arm :func:`once` (the next patched loss call logs again)."""
    global _ANNOUNCED
    _ANNOUNCED = False
