"""The Megatron call sites the patch replaces, written against :mod:`.settings`.

Each factory takes Megatron's original function and returns the replacement, which runs the
original unchanged whenever the plugin is inactive (see :data:`.settings.SETTINGS`).
"""

from __future__ import annotations

import functools

import torch

from ..ops.vocab_parallel import VocabStats, vocab_parallel_stats
from . import settings
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
        stats = vocab_parallel_stats(
            logits,
            labels.transpose(0, 1).contiguous(),
            tp_group=tp_group_of(self),
            vocab_size=cfg.vocab_size,
            chunk_size=cfg.logprobs_chunk_size,
            entropy=cfg.entropy,
            label_smoothing=cfg.label_smoothing,
            validate=cfg.validate,
        )
        _stash(self, stats)
        return per_token_loss(stats, cfg).transpose(0, 1).contiguous()

    return compute_language_model_loss
