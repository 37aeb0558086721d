"""Float64, single-process, full-vocabulary references for the tests."""

from __future__ import annotations

import torch


def reference_stats(logits_full, target, *, vocab_size=None, temperature=1.0, ignore_index=-100,
                    label_smoothing=0.0):
    """``(logprobs, entropy, logsumexp)`` in float64 from the full ``[..., V_padded]`` logits.

    Differentiable w.r.t. ``logits_full`` (pass a float64 leaf to get reference gradients).
    Ignored positions give logprob 0 and entropy 0, as the op documents.
    """
    v = vocab_size or logits_full.shape[-1]
    z = logits_full.double()[..., :v] / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    lse = torch.logsumexp(z, dim=-1)
    if target is None:
        return None, ent, lse
    valid = target != ignore_index
    lp = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    if label_smoothing:
        lp = (1 - label_smoothing) * lp + label_smoothing * logp.mean(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero), lse
