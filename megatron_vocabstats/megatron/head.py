"""The fused LM head's side of the Megatron integration: what stands in for the logits, and when
the fused head cannot stand in for Megatron's output layer.

* :class:`DeferredLogits`: the inputs of one output-layer call (hidden states, weight, the layer,
  a logit scale) in place of its logits. Megatron multiplies the logits by MuP's output
  multiplier (``LanguageModule._scale_logits``); the stand-in records the factor, which the
  fused op applies as ``temperature = 1 / scale``. Anything else done to it raises.
* :func:`deferred_output_layer`: for the length of one model forward, ``output_layer(...)``
  returns a :class:`DeferredLogits` instead of computing the logits, so that Megatron's own
  ``forward`` (``HybridModel``, ``GPTModel._postprocess`` before 0.18: no hook there) hands it to
  ``compute_language_model_loss``, which the plugin replaces (:mod:`.model`).
* :func:`not_fused_reasons` / :func:`fused_or_report`: where the fused head would not reproduce
  Megatron's output layer (a bias; no tp reduction of the input gradient; a deferred weight
  gradient), Megatron's own path runs, and the reason is logged once on rank 0, or raised with
  ``PluginSettings.require_fused_lm_head`` [--require-fused-lm-head].

May import: :mod:`.settings`, :mod:`.compat`, the standard library and torch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os

import torch

from . import settings
from .compat import tp_group_of

logger = logging.getLogger("megatron_vocabstats")

_REPORTED: set[tuple[str, tuple[str, ...]]] = set()


class DeferredLogits:
    """The logits ``scale * (hidden @ weight.T)`` of one output-layer call, not computed.

    ``hidden``: the layer's input ``[s(/tp), b, h]`` (this rank's sequence shard under sequence
    parallelism); ``weight``: the ``[V/tp, h]`` shard used (the tied embedding or the layer's
    own); ``layer``: Megatron's ``ColumnParallelLinear`` (its tp group, ``sequence_parallel``
    and ``gradient_accumulation_fusion`` decide the fused op's collectives and ``main_grad``);
    ``scale``: the product of the factors Megatron multiplied the logits by (MuP). Only
    multiplication by a real number is defined; any other use raises ``TypeError`` naming the
    plugin, never a silently wrong number.
    """

    __slots__ = ("hidden", "weight", "layer", "scale")

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, layer, scale: float = 1.0):
        self.hidden, self.weight, self.layer, self.scale = hidden, weight, layer, scale

    def __mul__(self, factor):
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(f"megatron-vocabstats: the fused LM head's logits stand-in can only "
                            f"be scaled by a real number, got {type(factor).__name__}; run with "
                            f"--lm-head-chunk-size 0 for this model")
        return DeferredLogits(self.hidden, self.weight, self.layer, self.scale * float(factor))

    __rmul__ = __mul__

    def __getattr__(self, name):
        raise TypeError(f"megatron-vocabstats: Megatron used the fused LM head's logits stand-in "
                        f"as a tensor ({name!r}); this model does more with its logits than "
                        f"scale them and compute the loss: run with --lm-head-chunk-size 0")

    def op_kwargs(self) -> dict:
        """The fused op's keywords that the layer decides (tp group, sequence parallelism,
        ``main_grad`` fusion) and the temperature ``1 / scale``.

        Raises ``ValueError`` for a scale that is not finite and positive (the op's temperature).
        """
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"megatron-vocabstats: logit scale {self.scale} (MuP's "
                             f"mup_output_mult): the fused LM head takes a finite, positive "
                             f"scale (temperature 1 / scale)")
        layer = self.layer
        return dict(
            tp_group=tp_group_of(layer),
            sequence_parallel=bool(getattr(layer, "sequence_parallel", False)),
            accumulate_into_main_grad=bool(getattr(layer, "gradient_accumulation_fusion", False))
            and hasattr(self.weight, "main_grad"),
            temperature=1.0 / self.scale,
        )


@contextlib.contextmanager
def deferred_output_layer(layer):
    """Within the context, ``layer(hidden, weight=None, ...)`` returns ``(DeferredLogits, None)``
    (``weight`` None: the layer's own). Restores the layer's own ``forward`` on exit."""

    def forward(input_, weight=None, runtime_gather_output=None, **_):
        return DeferredLogits(input_, layer.weight if weight is None else weight, layer), None

    own = vars(layer).get("forward")  # an instance attribute (a wrapper) is put back after
    layer.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own


def not_fused_reasons(output_layer, config, *, deferred: bool = False) -> tuple[str, ...]:
    """Why the fused head would not reproduce ``output_layer`` and its backward contract (empty
    when it does). MuP's output multiplier is reproduced (a logit scale), so it is no reason.
    ``deferred``: the head runs through :func:`deferred_output_layer`, inside Megatron's own
    forward, which then must not need the logits themselves (the config logger writes them)."""
    reasons = []
    if deferred and getattr(config, "config_logger_dir", ""):
        reasons.append("config_logger_dir is set (Megatron's config logger writes the logits)")
    if getattr(output_layer, "bias", None) is not None:
        reasons.append("the output layer has a bias (logits = h W^T + b)")
    if getattr(output_layer, "disable_grad_reduce", False):
        reasons.append("output_layer.disable_grad_reduce (the fused head all-reduces the input "
                       "gradient over tp itself)")
    if (getattr(output_layer, "grad_output_buffer", None) is not None
            or getattr(config, "defer_embedding_wgrad_compute", False)):
        reasons.append("defer_embedding_wgrad_compute (Megatron computes the output weight's "
                       "gradient later from stored logits gradients, which the fused head never "
                       "holds)")
    return tuple(reasons)


def fused_or_report(where: str, reasons, cfg: settings.PluginSettings) -> bool:
    """True if ``reasons`` is empty. Otherwise raise ``ValueError`` under
    ``cfg.require_fused_lm_head``, else log the reasons once (per ``where`` and reasons) on rank
    0 and return False: the caller runs Megatron's own output layer."""
    if not reasons:
        return True
    reasons = tuple(reasons)
    message = (f"megatron-vocabstats: --lm-head-chunk-size {cfg.lm_head_chunk_size} but {where} "
               f"keeps Megatron's output layer and logits: {'; '.join(reasons)}")
    if cfg.require_fused_lm_head:
        raise ValueError(f"{message} (--require-fused-lm-head: drop it to run unfused there, "
                         f"or change the model)")
    if (where, reasons) not in _REPORTED:
        _REPORTED.add((where, reasons))
        if int(os.environ.get("RANK", "0")) == 0:
            logger.warning(message)
    return False
