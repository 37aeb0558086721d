"""Top-k distillation losses: divergences over the teacher's top-k, in Megatron's loss contract.

:func:`topk_divergence` is the pure per-token divergence (forward KL, reverse KL, JSD(beta));
:func:`distillation_loss` takes the student's log-probs at the teacher's ids from vocab-parallel
logits or a fused LM head and returns ``(loss_sum, num_tokens, report)``. Semantics (the
Bregman form, the tail bucket and its floor): ``docs/distillation.md``. No host sync;
collectives only in the op.
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
