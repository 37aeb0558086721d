"""The Megatron call sites the patch replaces, written against :mod:`.settings`.

Each factory takes Megatron's original function and returns the replacement, which runs the
original unchanged whenever the plugin is inactive (see :data:`.settings.SETTINGS`).

May import: :mod:`megatron_vocabstats.ops` (the ops it calls), :mod:`.settings`, :mod:`.compat`,
:mod:`.announce` and torch.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ..ops.vocab_parallel import VocabStats, vocab_parallel_stats
from . import announce, settings
from .compat import tp_group_of

LAST_STATS_ATTR = "last_vocab_stats"


def per_token_loss(stats: VocabStats, cfg: settings.PluginSettings) -> torch.Tensor:
    """``-logprobs - entropy_coef * entropy`` (fp32, shaped like the stats)."""
    loss = 0.0 - stats.logprobs
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * stats.entropy
    return loss


def _stash(module, stats: VocabStats) -> None:
    """Keep this step's per-token statistics ``[b, s]`` (detached) on the module for reporting."""
    setattr(module, LAST_STATS_ATTR, VocabStats(
        *(None if t is None else t.detach().transpose(0, 1) for t in stats)))


def make_compute_language_model_loss(original):
    """Replacement of ``LanguageModule.compute_language_model_loss(self, labels, logits)``.

    Same contract as Megatron's: labels ``[b, s]``, logits ``[s, b, V/tp]``, per-token fp32 loss
    ``[b, s]``; computed by :func:`vocab_parallel_stats` with the settings' chunking, entropy mode,
    entropy bonus and label smoothing, on the tp group of the module. The statistics of the last
    call are kept, detached and ``[b, s]``, as ``module.last_vocab_stats``.
    """

    @functools.wraps(original)
    def compute_language_model_loss(self, labels, logits):
        cfg = settings.current()
        if not cfg.active:
            return original(self, labels, logits)
        announce.once(self, cfg, fused=False, device=logits.device)
        stats = vocab_parallel_stats(
            logits,
            labels.transpose(0, 1).contiguous(),
            **cfg.stats_options().op_kwargs(tp_group=tp_group_of(self)),
        )
        _stash(self, stats)
        return per_token_loss(stats, cfg).transpose(0, 1).contiguous()

    return compute_language_model_loss


def _fusable(output_layer, config) -> bool:
    """Whether the fused head reproduces ``output_layer`` and its backward contract.

    Not with a bias or MuP output scaling (other logits), nor where the layer skips the tp
    reduction of its input gradient (``disable_grad_reduce``) or defers its weight gradient
    (``grad_output_buffer`` / ``defer_embedding_wgrad_compute``): the fused op reduces dX and
    produces dW itself.
    """
    return (getattr(output_layer, "bias", None) is None
            and not getattr(config, "use_mup", False)
            and not getattr(output_layer, "disable_grad_reduce", False)
            and getattr(output_layer, "grad_output_buffer", None) is None
            and not getattr(config, "defer_embedding_wgrad_compute", False))


def fused_language_model_loss(module, output_layer, output_weight, hidden_states, labels,
                              cfg: settings.PluginSettings) -> torch.Tensor:
    """Per-token loss ``[b, s]`` straight from ``hidden_states [s(/tp), b, h]``, no logits.

    ``output_weight`` is the tied embedding (or None: ``output_layer.weight``). Sequence
    parallelism and gradient-accumulation fusion (``main_grad``) follow ``output_layer``.
    """
    from ..ops.fused_linear import linear_vocab_parallel_stats

    weight = output_weight if output_weight is not None else output_layer.weight
    announce.once(module if module is not None else output_layer, cfg, fused=True,
                  device=hidden_states.device)
    stats = linear_vocab_parallel_stats(
        hidden_states,
        weight,
        labels.transpose(0, 1).contiguous(),
        **cfg.stats_options(fused=True).op_kwargs(
            tp_group=tp_group_of(output_layer),
            sequence_parallel=bool(getattr(output_layer, "sequence_parallel", False)),
            accumulate_into_main_grad=bool(getattr(output_layer, "gradient_accumulation_fusion",
                                                   False)) and hasattr(weight, "main_grad"),
        ),
    )
    _stash(module, stats)
    return per_token_loss(stats, cfg).transpose(0, 1).contiguous()


def _wants_fused(cfg: settings.PluginSettings, labels) -> bool:
    return cfg.active and cfg.lm_head_chunk_size > 0 and labels is not None


def fused_output_processor(*, hidden_states, output_layer, output_weight, labels,
                           runtime_gather_output=None, compute_language_model_loss=None,
                           scale_logits=None, config=None, **_):
    """``GPTModel.forward(output_processor=...)`` hook (megatron-core 0.18+): the fused LM head.

    With labels and ``lm_head_chunk_size > 0`` it returns the per-token loss ``[b, s]`` without
    materialising the logits; otherwise (no labels: logits requested, or a bias / MuP scaling the
    fused head does not reproduce) it runs Megatron's own output layer and loss.
    """
    cfg = settings.current()
    module = getattr(compute_language_model_loss, "__self__", None)
    if _wants_fused(cfg, labels) and _fusable(output_layer, config):
        return fused_language_model_loss(module, output_layer, output_weight, hidden_states,
                                         labels, cfg)
    logits, _ = output_layer(hidden_states, weight=output_weight,
                             runtime_gather_output=runtime_gather_output)
    if scale_logits is not None:
        logits = scale_logits(logits)
    if labels is None:
        return logits.transpose(0, 1).contiguous()
    return compute_language_model_loss(labels, logits)


def make_gpt_forward(original):
    """``GPTModel.forward`` passing :func:`fused_output_processor` when the fused head applies.

    Only for a loss (labels given) outside inference; logits requests and inference keep
    Megatron's own output path (last-token logits, sequence-parallel gather).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        cfg = settings.current()
        if cfg.active and cfg.lm_head_chunk_size > 0 and kwargs.get("output_processor") is None:
            bound = signature.bind(self, *args, **kwargs).arguments
            if (_wants_fused(cfg, bound.get("labels"))
                    and bound.get("inference_context") is None
                    and bound.get("inference_params") is None):
                kwargs["output_processor"] = fused_output_processor
        return original(self, *args, **kwargs)

    return forward


def make_gpt_postprocess(original):
    """``GPTModel._postprocess`` with the fused head (megatron-core 0.16-0.17, no hook there).

    Takes over only for training/eval loss without MTP; everything else runs the original.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _postprocess(self, *args, **kwargs):
        cfg = settings.current()
        bound = signature.bind(self, *args, **kwargs)
        labels = bound.arguments.get("labels")
        fused = (_wants_fused(cfg, labels) and self.post_process
                 and not getattr(self.config, "mtp_num_layers", None)
                 and bound.arguments.get("inference_context") is None
                 and bound.arguments.get("inference_params") is None
                 and _fusable(self.output_layer, self.config))
        if not fused:
            return original(self, *args, **kwargs)
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights else None)
        return fused_language_model_loss(self, self.output_layer, weight,
                                         bound.arguments["hidden_states"], labels, cfg)

    return _postprocess
