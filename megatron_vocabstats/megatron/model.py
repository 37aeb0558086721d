"""The Megatron call sites the patch replaces: each factory takes Megatron's original function
and returns the replacement, which runs the original while the plugin is inactive. How the fused
LM head reaches each model, per release: docs/fused-head.md.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import torch

from ..mcore import tp_group_of
from ..ops.stats.from_logits import VocabStats, vocab_parallel_stats
from . import announce, settings
from .head import (
    DeferredLogits,
    deferred_call,
    deferred_output_layer,
    fused_or_report,
    not_fused_reasons,
)

LAST_STATS_ATTR = "last_vocab_stats"
# Per MTP depth, as LAST_STATS_ATTR for the main head (set by .mtp and by the unfused path).
LAST_MTP_STATS_ATTR = "last_mtp_vocab_stats"
# While an MTP loss runs unfused, the per-depth statistics _stash collects (else None).
_MTP_DEPTHS: list | None = None


def per_token_loss(stats: VocabStats, cfg: settings.PluginSettings) -> torch.Tensor:
    """``-logprobs - entropy_coef * entropy`` (fp32, shaped like the stats)."""
    loss = 0.0 - stats.logprobs
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * stats.entropy
    return loss


def detached_bs(stats: VocabStats) -> VocabStats:
    """``stats`` of ``[s, b]`` tokens detached and transposed to ``[b, s]``."""
    return VocabStats(*(None if t is None else t.detach().transpose(0, 1) for t in stats))


def _stash(module, stats: VocabStats) -> None:
    """Keep ``stats`` detached, ``[b, s]``, on ``module`` (or for the MTP depth being run)."""
    if _MTP_DEPTHS is not None:
        _MTP_DEPTHS.append(detached_bs(stats))
    else:
        setattr(module, LAST_STATS_ATTR, detached_bs(stats))


def collect_mtp_stats(module, run):
    """``run()`` (Megatron's own MTP loss, on the unfused op) with the statistics of each depth
    kept as ``module.last_mtp_vocab_stats`` instead of ``last_vocab_stats``."""
    global _MTP_DEPTHS
    outer, _MTP_DEPTHS = _MTP_DEPTHS, []
    try:
        result = run()
        if module is not None:
            setattr(module, LAST_MTP_STATS_ATTR, tuple(_MTP_DEPTHS))
        return result
    finally:
        _MTP_DEPTHS = outer


def make_compute_language_model_loss(original):
    """Replacement of ``LanguageModule.compute_language_model_loss(self, labels, logits)``:
    labels ``[b, s]``, logits ``[s, b, V/tp]`` (or :class:`~.head.DeferredLogits`: the fused
    head) -> per-token fp32 loss ``[b, s]``; the statistics kept as ``module.last_vocab_stats``."""

    @functools.wraps(original)
    def compute_language_model_loss(self, labels, logits):
        cfg = settings.current()
        if isinstance(logits, DeferredLogits):  # only while the plugin deferred the output layer
            return fused_language_model_loss(self, logits, labels, cfg)
        if not cfg.active:
            return original(self, labels, logits)
        announce.once(self, cfg, fused=False, device=logits.device)
        stats = vocab_parallel_stats(logits, labels.transpose(0, 1).contiguous(),
                                     **cfg.stats_options().op_kwargs(tp_group=tp_group_of(self)))
        _stash(self, stats)
        return per_token_loss(stats, cfg).transpose(0, 1).contiguous()

    return compute_language_model_loss


def fused_stats(logits: DeferredLogits, labels: torch.Tensor, cfg: settings.PluginSettings, *,
                argmax: bool = False, kernel: str | None = None):
    """The fused op's statistics ``[s, b]`` of the deferred ``logits`` for ``labels [b, s]``
    (:meth:`.head.DeferredLogits.op_kwargs`); ``kernel`` overrides the settings' backend."""
    from ..ops.stats.from_hidden import linear_vocab_parallel_stats

    layer = logits.op_kwargs()
    options = replace(cfg.stats_options(fused=True), temperature=layer.pop("temperature"),
                      **({} if kernel is None else {"kernel": kernel}))
    return linear_vocab_parallel_stats(logits.hidden, logits.weight,
                                       labels.transpose(0, 1).contiguous(), argmax=argmax,
                                       **options.op_kwargs(**layer))


def fused_language_model_loss(module, logits: DeferredLogits, labels,
                              cfg: settings.PluginSettings) -> torch.Tensor:
    """Per-token loss ``[b, s]`` by :func:`fused_stats`, the statistics stashed on ``module``."""
    announce.once(module if module is not None else logits.layer, cfg, fused=True,
                  device=logits.hidden.device)
    stats = fused_stats(logits, labels, cfg)
    _stash(module, stats)
    return per_token_loss(stats, cfg).transpose(0, 1).contiguous()


def _wants_fused(cfg: settings.PluginSettings, labels) -> bool:
    return cfg.active and cfg.lm_head_chunk_size > 0 and labels is not None


def fused_output_processor(*, hidden_states, output_layer, output_weight, labels,
                           runtime_gather_output=None, compute_language_model_loss=None,
                           scale_logits=None, config=None, **_):
    """``GPTModel.forward(output_processor=...)`` hook (0.18+): with labels, the fused head's
    per-token loss ``[b, s]`` where :func:`.head.fused_or_report` allows; otherwise Megatron's
    own output layer and loss."""
    cfg = settings.current()
    module = getattr(compute_language_model_loss, "__self__", None)
    if _wants_fused(cfg, labels) and fused_or_report(
            _GPT_HEAD, not_fused_reasons(output_layer, config, weight=output_weight), cfg):
        logits = deferred_call(output_layer, hidden_states, output_weight, runtime_gather_output)
        if scale_logits is not None:
            logits = scale_logits(logits)
        return fused_language_model_loss(module, logits, labels, cfg)
    logits, _ = output_layer(hidden_states, weight=output_weight,
                             runtime_gather_output=runtime_gather_output)
    if scale_logits is not None:
        logits = scale_logits(logits)
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    return compute_language_model_loss(labels, logits)


def _loss_outside_inference(cfg, arguments) -> bool:
    return (_wants_fused(cfg, arguments.get("labels"))
            and arguments.get("inference_context") is None
            and arguments.get("inference_params") is None)


_GPT_HEAD = "GPTModel's LM head"


def make_gpt_forward(original):
    """``GPTModel.forward`` or ``build_schedule_plan`` passing :func:`fused_output_processor`."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        cfg = settings.current()
        if (cfg.active and cfg.lm_head_chunk_size > 0 and kwargs.get("output_processor") is None
                and _loss_outside_inference(cfg, signature.bind(self, *args, **kwargs).arguments)
                and fused_or_report(_GPT_HEAD, not_fused_reasons(
                    getattr(self, "output_layer", None), getattr(self, "config", None)), cfg)):
            kwargs["output_processor"] = fused_output_processor
        return original(self, *args, **kwargs)

    return forward


def make_unfused_schedule_plan(original):
    """``GPTModel.build_schedule_plan`` of a release whose ``forward`` takes ``output_processor``
    but whose schedule plan does not: Megatron's own, the unfused head reported."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def build_schedule_plan(self, *args, **kwargs):
        cfg = settings.current()
        if cfg.active and cfg.lm_head_chunk_size > 0 and _loss_outside_inference(
                cfg, signature.bind(self, *args, **kwargs).arguments):
            fused_or_report("GPTModel.build_schedule_plan (--overlap-moe-expert-parallel-comm)",
                            ("this megatron-core's build_schedule_plan takes no "
                             "output_processor",), cfg)
        return original(self, *args, **kwargs)

    return build_schedule_plan


def _tied_weight(model):
    """The embedding weight that ``model``'s output layer is called with, if tied (else None)."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        return model.shared_embedding_or_output_weight()
    return None


def make_deferred_head(original):
    """A model method ending in ``self.output_layer(...)`` then ``compute_language_model_loss``
    (``HybridModel.forward``; ``GPTModel._postprocess`` of 0.16-0.17), run with the output layer
    deferred for a loss outside inference on the last pipeline stage, where allowed."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        cfg = settings.current()
        if (cfg.active and cfg.lm_head_chunk_size > 0 and getattr(self, "post_process", False)
                and _loss_outside_inference(cfg, signature.bind(self, *args, **kwargs).arguments)
                and fused_or_report(f"{type(self).__name__}'s LM head",
                                    not_fused_reasons(self.output_layer, self.config,
                                                      deferred=True, weight=_tied_weight(self)),
                                    cfg)):
            with deferred_output_layer(self.output_layer):
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method
