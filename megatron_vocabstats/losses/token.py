"""Per-token losses of one tensor of log-probs: :func:`nll_loss` (SFT) and :func:`score_tokens`
(forward-only scoring). Pure functions of per-token tensors: no process groups, no host sync.
"""

from __future__ import annotations

import torch

from ..ops.options import check_bool
from .inputs import (
    LossOutput,
    _compute_dtype,
    _count,
    _masked,
    _pair,
    _per_token_inputs,
)


def nll_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
             entropy: torch.Tensor | None = None) -> LossOutput:
    """Masked token cross-entropy (SFT) from per-token log-probs, in Megatron's loss contract.

    Reference semantics (``m = loss_mask != 0``)::

        loss_sum = -(logprobs * m).sum();  num_tokens = m.sum()

    Args:
        logprobs: ``[...]`` floating, log p(target) per token (nats; label smoothing, if any,
            already in it).
        loss_mask: shaped like ``logprobs``, any dtype; a token counts where non-zero (weights are
            not applied: 0.5 counts as 1). Required.
        entropy: optional per-token entropy shaped like ``logprobs``, only reported.

    Returns:
        :class:`LossOutput`; report ``"lm loss"`` and, with ``entropy``, ``"entropy"``. Masked
        positions contribute exactly 0 to values and gradients, whatever they hold (NaN included).

    Raises:
        ValueError: ``loss_mask`` None, a non-floating or scalar ``logprobs``, a non-floating
            ``entropy``, shapes or devices that differ.
    """
    mask = _per_token_inputs(logprobs, loss_mask, entropy=entropy)
    dtype = _compute_dtype(logprobs)
    num_tokens = _count(mask)
    loss_sum = -_masked(logprobs, mask, dtype).sum()
    report = {"lm loss": _pair(loss_sum, num_tokens)}
    if entropy is not None:
        report["entropy"] = _pair(_masked(entropy, mask, dtype).sum(), num_tokens)
    return LossOutput(loss_sum, num_tokens, report)


def score_tokens(logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                 entropy: torch.Tensor | None = None, non_loss_data: bool = False):
    """Forward-only scoring: per-token log-probs (and entropy) in a loss-contract shell.

    Args:
        logprobs, loss_mask, entropy: as in :func:`nll_loss` (a non-zero mask = scored).
        non_loss_data: what Megatron passes with ``collect_non_loss_data=True``.

    Returns:
        With ``non_loss_data``: ``{"logprobs": ..., "entropy": ...}`` (entropy only when given),
        detached, shaped like ``logprobs``, 0 where not scored. Otherwise ``LossOutput(0.0,
        num_tokens, that dict)``: with ``forward_only=True`` the schedule returns one dict per
        microbatch (``torch.cat([d["logprobs"] for d in result])`` reassembles the batch). These
        are not ``[sum, count]`` pairs: not for ``train_step`` or ``evaluate``.

    Raises:
        ValueError: as :func:`nll_loss`; ``non_loss_data`` not a bool (also a ``TypeError``).
    """
    non_loss_data = check_bool("non_loss_data", non_loss_data)
    mask = _per_token_inputs(logprobs, loss_mask, entropy=entropy)
    dtype = _compute_dtype(logprobs)
    scores = {"logprobs": _masked(logprobs.detach(), mask, dtype)}
    if entropy is not None:
        scores["entropy"] = _masked(entropy.detach(), mask, dtype)
    if non_loss_data:
        return scores
    return LossOutput(logprobs.new_zeros((), dtype=dtype), _count(mask), scores)
