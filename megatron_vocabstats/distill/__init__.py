"""Top-k distillation losses: divergences over the teacher's top-k, in Megatron's loss contract.

Two layers, as in :mod:`megatron_vocabstats.losses`:

* :func:`topk_divergence`: a pure per-token function of the teacher's top-k log-probs and the
  student's log-probs at the same ids (forward KL, reverse KL, JSD(beta); optional tail bucket,
  optional renormalisation over the top-k).
* :func:`distillation_loss`: the student's log-probs at the teacher's ids from vocab-parallel logits
  (:func:`~megatron_vocabstats.vocab_parallel_topk_logprobs`) or a fused LM head, then
  :func:`topk_divergence`, returned as ``(loss_sum, num_tokens, report)``.

Semantics (``docs/numerics.md``, "Top-k distillation"): both sides are normalised over the full
vocabulary unless ``renormalize=True``. Each divergence is a sum over buckets (the k ids, plus
the tail ``log(1 - sum_k p)`` when ``tail_bucket``) of the Bregman form of KL,

    D(p || q) = sum_i p_i (r_i - 1 + e^{-r_i}) = sum_i [p_i log(p_i / q_i) - p_i + q_i],
    r_i = log p_i - log q_i,

each term >= 0 and exactly 0 where ``p_i == q_i``. With the tail bucket (or ``renormalize``) both
sides sum to 1 and this is the ordinary KL; over the bare top-k it is the generalised
(I-)divergence of the two unnormalised top-k measures, which is still >= 0 and 0 only when the
student matches the teacher on every top-k id. So KL >= 0 holds numerically, and KL(p, p) is 0
bit for bit in every dtype.

The tail mass ``1 - sum_k p`` is floored at the resolution of 1 in the computation dtype (fp32:
2**-23): below it the rounded top-k log-probs do not determine it (the sum is only known to a few
ulps), and a tail that rounds to 0 would make reverse KL (teacher side) or forward KL (student
side) infinite. Both sides are floored alike, so KL(p, p) stays exactly 0.

No host synchronisation (no ``.item()``, no value-dependent shapes); collectives only in the op.
"""

from .divergence import (
           DIVERGENCES,
           DistillConfig,
           bregman_kl,
           log1mexp,
           topk_divergence,
)
from .loss import StudentFn, distillation_loss

__all__ = ["DIVERGENCES", "DistillConfig", "StudentFn", "bregman_kl", "distillation_loss",
           "log1mexp", "topk_divergence"]
