"""Top-k distillation: the per-token divergence over the teacher's top-k (:func:`topk_divergence`)
and the Megatron loss function built on it (:func:`distillation_loss`). Semantics:
``docs/distillation.md``."""

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
