"""Megatron's multi-token prediction (MTP) loss (0.17+'s ``process_mtp_loss``) with every
depth's loss and acceptance counts from the fused LM head (docs/fused-head.md#mtp-heads).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from ..ops.kernels import resolve_kernel
from ..version_check import is_rank0
from . import settings
from .head import deferred_call, fused_or_report, not_fused_reasons
from .model import LAST_MTP_STATS_ATTR, collect_mtp_stats, detached_bs, fused_stats, per_token_loss

logger = logging.getLogger("megatron_vocabstats")
_NOTED: set[str] = set()


def make_process_mtp_loss(original):
    """Replacement of ``process_mtp_loss`` (any of its signatures): :func:`fused_mtp_loss` with
    ``lm_head_chunk_size > 0`` where :func:`.head.fused_or_report` allows; else Megatron's own,
    collecting the per-depth statistics while the plugin is on."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def process_mtp_loss(*args, **kwargs):
        cfg = settings.current()
        if not cfg.active:
            return original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        arguments = call.arguments
        module = getattr(arguments["compute_language_model_loss"], "__self__", None)
        if cfg.lm_head_chunk_size > 0 and fused_or_report(
                "the MTP heads", not_fused_reasons(arguments["output_layer"],
                                                   arguments["config"],
                                                   weight=arguments["output_weight"]), cfg):
            return fused_mtp_loss(module, cfg, **arguments)
        return collect_mtp_stats(module, lambda: original(*args, **kwargs))

    return process_mtp_loss


def _acceptance_kernel(cfg: settings.PluginSettings, device) -> str | None:
    """None, or "torch" (noted once) where only the torch statistics carry the argmax row."""
    if resolve_kernel(cfg.kernel, device) == "torch":
        return None
    if cfg.kernel not in _NOTED and is_rank0():
        logger.info("megatron-vocabstats: the MTP depths' statistics run on the torch kernels "
                    "while Megatron logs acceptance counts (the argmax row is theirs only)")
    _NOTED.add(cfg.kernel)
    return "torch"


def fused_mtp_loss(module, cfg: settings.PluginSettings, *, hidden_states, labels, loss_mask,
                   output_layer, output_weight, is_training, config, runtime_gather_output=None,
                   cp_group=None,
                   packed_seq_params=None, scale_logits_fn=None, input_ids=None, **_):
    """Megatron's ``process_mtp_loss`` with each depth's loss from the fused head: returns the
    main decoder's part of ``hidden_states [(1 + D) * s(/tp), b, h]`` with each depth's scaled
    loss attached (``MTPLossAutoScaler``); labels None: derived from ``input_ids`` as 0.19 does."""
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    depths = config.mtp_num_layers
    parts = torch.chunk(hidden_states, 1 + depths, dim=0)
    hidden = parts[0]
    roll = functools.partial(mtp.roll_tensor, shifts=-1, dims=-1, cp_group=cp_group,
                             packed_seq_params=packed_seq_params)
    from_ids = labels is None and input_ids is not None
    if labels is None and not from_ids:
        return hidden
    if from_ids:  # label[i] = input_id[i + 1]; the last one is made up, so masked below
        labels, _ = roll(input_ids)
    weight = output_weight
    if getattr(config, "mtp_detach_heads", False):  # as Megatron: before the layer's pre-hooks
        weight = (output_layer.weight if weight is None else weight).detach()
    mask = torch.ones_like(labels) if loss_mask is None else loss_mask
    if from_ids:
        mask, _ = roll(mask)
    main_tokens = mask.sum()
    helper = mtp.MTPLossLoggingHelper
    acceptance = is_training and hasattr(helper, "save_metrics_to_tracker")
    kernel = _acceptance_kernel(cfg, hidden.device) if acceptance else None
    scale = config.mtp_loss_scaling_factor / depths
    per_depth = []
    for depth in range(depths):
        labels, _ = roll(labels)
        mask, num_tokens = roll(mask)
        logits = deferred_call(output_layer, parts[depth + 1], weight, runtime_gather_output)
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        stats = fused_stats(logits, labels, cfg, argmax=acceptance, kernel=kernel)
        per_depth.append(detached_bs(stats))
        loss = mask * per_token_loss(stats, cfg).transpose(0, 1).contiguous()
        if is_training:
            logged = (loss.sum() * (num_tokens > 0).to(loss.dtype)) / num_tokens.clamp(min=1)
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if acceptance:
                with torch.no_grad():
                    valid = mask.bool()
                    correct = ((stats.argmax.transpose(0, 1) == labels) & valid).sum().float()
                helper.save_metrics_to_tracker(logged, correct, valid.sum().float(), depth,
                                               depths, avg_group=group)
            else:
                helper.save_loss_to_tracker(logged, depth, depths, avg_group=group)
        if config.calculate_per_token_loss:
            # finalize_model_grads divides by the main loss's token count: rescale to it.
            term = scale * loss * (main_tokens / num_tokens.clamp(min=1))
        else:
            term = scale * loss / num_tokens.clamp(min=1)
        hidden = mtp.MTPLossAutoScaler.apply(hidden, term)
    if module is not None:
        setattr(module, LAST_MTP_STATS_ATTR, tuple(per_depth))
    return hidden
