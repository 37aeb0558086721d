"""Per-token losses of a tensor of log-probs: :func:`nll_loss` (SFT), :func:`score_tokens`."""

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

    ``logprobs``: floating ``[...]``, log p(target) in nats (label smoothing already in it);
    ``entropy``: optional, only reported. Report ``"lm loss"`` and, with ``entropy``,
    ``"entropy"``. Masks, dtypes and the ``ValueError`` of bad inputs: ``docs/ops.md``, "Losses
    for forward_step".
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

    Arguments as :func:`nll_loss` (non-zero mask = scored). With ``non_loss_data`` (what Megatron
    passes under ``collect_non_loss_data``), returns ``{"logprobs": ..., "entropy": ...}``
    (entropy only when given), detached, shaped like ``logprobs``, 0 where not scored; otherwise
    ``LossOutput(0.0, num_tokens, that dict)``, one per microbatch with ``forward_only=True``. Its
    values are not ``[sum, count]`` pairs: not for ``train_step`` or ``evaluate``. Raises
    ``ValueError`` as :func:`nll_loss`, and for ``non_loss_data`` not a bool (also a ``TypeError``).
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
