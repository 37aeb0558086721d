"""The fused LM head's side of the Megatron integration: a stand-in for the logits of a deferred
output-layer call, and where the fused head would not reproduce Megatron's output layer
(docs/fused-head.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers

import torch

from ..mcore import tp_group_of
from ..version_check import is_rank0
from . import settings

logger = logging.getLogger("megatron_vocabstats")

_REPORTED: set[tuple[str, tuple[str, ...]]] = set()

# How to get the logits themselves, said by every refusal of a tensor use.
_REAL_LOGITS = ("for real logits, turn the fused LM head off (--lm-head-chunk-size 0; "
                "patch.apply(lm_head_chunk_size=0)) or call the model without labels")


def _tensor_use(what: str) -> TypeError:
    return TypeError(f"megatron-vocabstats: the fused LM head computes the loss from the hidden "
                     f"states and never makes these logits: the stand-in for them (DeferredLogits) "
                     f"can only be multiplied or divided by a logit scale, not used as a tensor "
                     f"({what}); {_REAL_LOGITS}")


def _as_scale(factor, op: str) -> float:
    """``factor`` (a real number, 0-dim real tensor without grad) as a float, else ``TypeError``."""
    if isinstance(factor, torch.Tensor):
        if (factor.dim() == 0 and not factor.requires_grad and not factor.is_complex()
                and factor.dtype != torch.bool):
            return float(factor)
        raise _tensor_use(f"{op} a tensor of shape {tuple(factor.shape)}, {factor.dtype}"
                          f"{', requiring grad' if factor.requires_grad else ''}: only a 0-dim "
                          f"real tensor without gradient is a logit scale")
    if isinstance(factor, numbers.Real) and not isinstance(factor, bool):
        return float(factor)
    raise _tensor_use(f"{op} {type(factor).__name__}")


class DeferredLogits:
    """The logits ``scale * (hidden @ weight.T)`` of one output-layer ``layer`` call, not
    computed: only ``*`` and ``/`` by a logit scale are allowed (docs/fused-head.md); dividing by
    0 raises ``ValueError``, every other use ``TypeError`` saying how to get real logits."""

    __slots__ = ("hidden", "weight", "layer", "scale")
    __array_ufunc__ = None  # numpy defers to the reflected operators below (np.float32(2) * x)
    __hash__ = object.__hash__  # __eq__ refuses (below), identity hashing stays

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, layer, scale: float = 1.0):
        self.hidden, self.weight, self.layer, self.scale = hidden, weight, layer, scale

    def _scaled(self, scale: float) -> DeferredLogits:
        return DeferredLogits(self.hidden, self.weight, self.layer, scale)

    def __mul__(self, factor):
        return self._scaled(self.scale * _as_scale(factor, "multiplied by"))

    __rmul__ = __mul__

    def __truediv__(self, divisor):
        divisor = _as_scale(divisor, "divided by")
        if divisor == 0:
            raise ValueError("megatron-vocabstats: the fused LM head's logits divided by 0 (a "
                             "logit scale or temperature must be finite and positive)")
        return self._scaled(self.scale / divisor)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if not kwargs and len(args) == 2:
            first, second = args
            if name in ("mul", "__mul__", "__rmul__", "multiply"):
                return first * second if isinstance(first, cls) else second * first
            if name in ("div", "__truediv__", "divide", "true_divide") and isinstance(first, cls):
                return first / second
        raise _tensor_use(f"torch.{name}")

    def __getattr__(self, name):
        raise _tensor_use(f".{name}")

    def __repr__(self):
        return (f"DeferredLogits(hidden {tuple(self.hidden.shape)}, weight "
                f"{tuple(self.weight.shape)}, scale={self.scale})")

    def op_kwargs(self) -> dict:
        """The fused op's keywords the layer decides and ``temperature = 1 / scale``;
        ``ValueError`` unless the scale is finite and > 0."""
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"megatron-vocabstats: logit scale {self.scale} (the factors the "
                             f"logits were multiplied by over those they were divided by: MuP's "
                             f"mup_output_mult, a temperature): the fused LM head takes a finite, "
                             f"positive scale (temperature 1 / scale)")
        layer = self.layer
        return dict(
            tp_group=tp_group_of(layer),
            sequence_parallel=bool(getattr(layer, "sequence_parallel", False)),
            accumulate_into_main_grad=bool(getattr(layer, "gradient_accumulation_fusion", False))
            and hasattr(self.weight, "main_grad"),
            temperature=1.0 / self.scale)


def _refuser(name: str):
    def refuse(self, *args, **kwargs):
        raise _tensor_use(name)

    refuse.__name__ = name
    return refuse


# Python looks special methods up on the type, not through __getattr__: refuse each tensor one
# (else `x + 1` says "unsupported operand", `x == y` and `bool(x)` silently answer).
for _name in ("add radd sub rsub rtruediv floordiv rfloordiv mod rmod pow rpow matmul rmatmul "
              "and rand or ror xor rxor lshift rshift neg pos abs invert getitem setitem "
              "delitem len iter contains bool float int index complex lt le gt ge eq ne "
              "array dlpack").split():
    setattr(DeferredLogits, f"__{_name}__", _refuser(f"__{_name}__"))


@contextlib.contextmanager
def deferred_output_layer(layer):
    """Within the context ``layer(hidden, weight=None, ...)`` returns ``(DeferredLogits, None)``."""

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


def deferred_call(layer, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                  runtime_gather_output=None) -> DeferredLogits:
    """``layer(hidden, weight=weight, ...)`` under :func:`deferred_output_layer`, so that the
    layer's hooks run (parameter gathers are pre-hooks); ``TypeError`` if a hook replaced the
    :class:`DeferredLogits`."""
    with deferred_output_layer(layer):
        logits, _ = layer(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
    if not isinstance(logits, DeferredLogits):
        raise TypeError(f"megatron-vocabstats: a forward hook of the output layer replaced the "
                        f"fused LM head's deferred logits by {type(logits).__name__}; "
                        f"{_REAL_LOGITS}")
    return logits


def _is_gtp_shard(weight) -> bool:
    """Whether ``weight`` is a GTP weight-remat shard (0.19+'s ``is_gtp_param``, else its tag)."""
    if weight is None:
        return False
    try:
        from megatron.core.tensor_parallel.generalized_tensor_parallelism import is_gtp_param
    except ImportError:  # before 0.19, or a build without it
        return bool(getattr(weight, "is_gtp_weight_remat", False))
    return bool(is_gtp_param(weight))


def _modelopt_capture(output_layer) -> bool:
    """Whether a ModelOpt ``DistillationModel`` hook keeps ``output_layer``'s logits."""
    if output_layer is None:
        return False
    if "_intermediate_output" in vars(output_layer):
        return True
    hooks = getattr(output_layer, "_forward_hooks", None) or {}
    return any(str(getattr(hook, "__module__", "")).startswith("modelopt.")
               for hook in hooks.values())


def not_fused_reasons(output_layer, config, *, deferred: bool = False,
                      weight=None) -> tuple[str, ...]:
    """Why the fused head would not reproduce ``output_layer`` and its backward (empty: it does;
    docs/fused-head.md#when-the-head-is-not-fused). ``deferred``: the head runs inside
    Megatron's own forward; ``weight``: the tied embedding the layer is called with, if any."""
    reasons = []
    if _modelopt_capture(output_layer):
        reasons.append("ModelOpt distillation captures output_layer's outputs (a "
                       "DistillationModel forward hook; its KD loss reads the logits, which the "
                       "fused head never makes)")
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
    if (getattr(output_layer, "gtp_remat_size", 1) > 1
            or any(_is_gtp_shard(w) for w in (getattr(output_layer, "weight", None), weight))):
        reasons.append("GTP weight sharding (gtp_weight_remat_size > 1: the output weight is a "
                       "shard that Megatron gathers inside its own GEMM)")
    output_dtype = getattr(output_layer, "output_dtype", None)
    if output_dtype is not None and output_dtype != getattr(config, "params_dtype", None):
        reasons.append(f"output_layer.output_dtype {output_dtype} (--output-logit-dtype: "
                       f"Megatron's logits are {output_dtype} GEMM outputs, the fused head "
                       f"rounds its logits to the hidden dtype)")
    if (getattr(config, "cross_entropy_loss_fusion", False)
            and getattr(config, "cross_entropy_fusion_impl", None) == "linear"):
        reasons.append("cross_entropy_fusion_impl='linear' (Megatron's own fused linear "
                       "cross-entropy, LinearCrossEntropyModule)")
    return tuple(reasons)


def fused_or_report(where: str, reasons, cfg: settings.PluginSettings) -> bool:
    """True if ``reasons`` is empty; else ``ValueError`` under ``cfg.require_fused_lm_head``, or
    the reasons logged once (rank 0) and False: the caller runs Megatron's own output layer."""
    if not reasons:
        return True
    reasons = tuple(reasons)
    message = (f"megatron-vocabstats: --lm-head-chunk-size {cfg.lm_head_chunk_size} but "
               f"Megatron's output layer and logits stay in use for {where}: "
               f"{'; '.join(reasons)}")
    if cfg.require_fused_lm_head:
        raise ValueError(f"{message} (--require-fused-lm-head: drop it to run unfused there, "
                         f"or change the model)")
    if (where, reasons) not in _REPORTED:
        _REPORTED.add((where, reasons))
        if is_rank0():
            logger.warning(message)
    return False
