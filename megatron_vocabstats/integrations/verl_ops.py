"""verl's vocab-parallel log-prob and entropy functions on the ops, with verl's arguments and
results (sign, dtype, shape) as read from the verl 0.9.1 wheel
(``verl/utils/megatron/tensor_parallel.py``, ``verl/utils/kernel/linear_cross_entropy.py``).
Differences (:data:`NOTES`): docs/verl.md.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..mcore import default_tp_group
from ..ops import linear_vocab_parallel_stats, vocab_parallel_stats
from ..ops.options import check_choice
from ._options import IntegrationOptions

REDUCTIONS = ("none", "sum", "mean")

_LABELS = ("a label of -100 gives 0 and no gradient (verl: {theirs}); another label outside the "
           "vocabulary raises ValueError (NaN with validate=False)")
NOTES = {
    "vocab_parallel_log_probs_from_logits": (
        "runs on vocab_parallel_stats. Differences: " + _LABELS.format(
            theirs="max - logsumexp, through Megatron's cross-entropy, with a gradient")
        + "; the logits are never written (Megatron's overwrites fp32 logits with their "
        "softmax)"),
    "vocab_parallel_entropy": (
        "runs on vocab_parallel_stats. Differences: computed from fp32 chunks and rounded once "
        "to the logits' dtype (verl computes in that dtype); the backward never writes the "
        "saved logits (verl's subtracts E_p[z] in place and adds it back, not exactly)"),
    "vocab_parallel_entropy_with_chunking": (
        "runs on vocab_parallel_stats. Differences: its chunk_size is not used (the op chunks by "
        "logprobs_chunk_size, auto by default; the values do not depend on it); the backward "
        "never writes the saved logits"),
    "linear_cross_entropy": (
        "runs on linear_vocab_parallel_stats. Differences: the logits hidden @ weight.T are "
        "rounded once to the model dtype before the statistics, as Megatron's output layer "
        "does (verl's kernel keeps them in fp32: with bf16 weights the log-probs differ by "
        "about |logit| * 2^-8); " + _LABELS.format(theirs="-logsumexp")
        + "; any hidden size and device (verl's kernel: CUDA, hidden size a multiple of 128)"),
}

OPTIONS = IntegrationOptions("verl", NOTES, padding="verl normalises over all W*tp columns")

_note_once = OPTIONS.note_once


def _unfused(entropy: str) -> dict:
    options = replace(OPTIONS.settings.stats_options(), entropy=entropy)
    return options.op_kwargs(tp_group=default_tp_group())


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl's ``vocab_parallel_log_probs_from_logits``: fp32 ``log p(labels)`` in nats, shaped
    like ``labels`` (int64 global ids), from this rank's shard ``[..., W]`` on Megatron's tp group
    (none before ``parallel_state`` is initialised); errors: ``vocab_parallel_stats``'s."""
    _note_once("vocab_parallel_log_probs_from_logits")
    return vocab_parallel_stats(logits, labels, **_unfused("off")).logprobs


def entropy(vocab_parallel_logits: torch.Tensor) -> torch.Tensor:
    """verl's ``vocab_parallel_entropy``: ``-sum p log p`` (nats) of the shard ``[..., W]``,
    shaped like its leading dims, in the logits' dtype (computed in fp32), differentiable."""
    _note_once("vocab_parallel_entropy")
    stats = vocab_parallel_stats(vocab_parallel_logits, None, **_unfused("grad"))
    return stats.entropy.to(vocab_parallel_logits.dtype)


def entropy_with_chunking(vocab_parallel_logits: torch.Tensor,
                          chunk_size: int = 2048) -> torch.Tensor:
    """verl's ``vocab_parallel_entropy_with_chunking``: :func:`entropy` in fp32; ``chunk_size``
    is not used (``logprobs_chunk_size`` chunks; the values do not depend on it)."""
    del chunk_size
    _note_once("vocab_parallel_entropy_with_chunking")
    return vocab_parallel_stats(vocab_parallel_logits, None, **_unfused("grad")).entropy


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy`` on ``linear_vocab_parallel_stats``: fp32 ``(logprobs [N],
    entropy [N])`` in nats (``logprobs`` 0-d for ``reduction`` "sum" / "mean") of ``hidden
    [..., H]`` (flattened to ``[N, H]``, the same on every rank of ``dist_process_group``) and
    this rank's ``weight [W, H]``; ``d_hidden`` is this rank's share (verl's convention).
    Raises ``ValueError`` naming the argument."""
    check_choice("reduction", reduction, REDUCTIONS)
    _note_once("linear_cross_entropy")
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        hidden = hidden.reshape(-1, hidden.shape[-1])
    if isinstance(labels, torch.Tensor):
        labels = labels.reshape(-1)
    settings = OPTIONS.settings
    options = replace(settings.stats_options(fused=True), entropy="grad",
                      chunk_size=settings.lm_head_chunk_size or None, temperature=temperature)
    stats = linear_vocab_parallel_stats(hidden, weight, labels, partial_hidden_grad=True,
                                        **options.op_kwargs(tp_group=dist_process_group))
    logprobs = stats.logprobs
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, stats.entropy
