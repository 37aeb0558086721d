"""Input checks of the fused LM-head ops (``from_hidden`` of ``stats/``, ``topk/``, ``sampling/``).

The fused op's own arguments (hidden, weight, target shape, ``grad_weights``,
``sequence_parallel``, ``main_grad``, ``partial_hidden_grad``) are checked here; their problems
and the cross-rank agreement go through the core checks' one exchange
(``_checks.checked_config``), giving a :class:`~.engine.LinearStatsConfig`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import _comm
from ._argtypes import bool_error
from ._checks import LogitsSpec, agreed_options, checked_config
from .agreement import Field, tensor_checksum
from .engine.linear import LinearStatsConfig, auto_linear_chunk_size
from .options import LINEAR_HEAD_OPTIONS, LOGITS_DTYPES, STATS_OPTIONS


def lead_shape(hidden, sequence_parallel, tp: int) -> tuple[int, ...] | None:
    """The leading shape of the (gathered) tokens of ``hidden`` ``[..., H]`` (under
    ``sequence_parallel`` a bool that is true and tp > 1, dim 0 times ``tp``): that of the target,
    ``indices`` and ``mask``. None when ``hidden`` is not a tensor of the right rank (the linear
    checks then name it)."""
    sp = bool_error("sequence_parallel", sequence_parallel) is None and sequence_parallel and tp > 1
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1 + sp:
        return None
    lead = tuple(hidden.shape[:-1])
    return (lead[0] * tp, *lead[1:]) if sp else lead


def linear_problem(hidden, weight, target, grad_weights, *, lead_shape, tp: int, entropy,
                   argmax, head: dict) -> ValueError | None:
    """The first problem with the arguments the core op's checks do not see, or None; ``head``:
    the values of :data:`~.options.LINEAR_HEAD_OPTIONS`."""
    sequence_parallel, accumulate_into_main_grad, partial_hidden_grad = (
        head["sequence_parallel"], head["accumulate_into_main_grad"], head["partial_hidden_grad"])
    if not isinstance(hidden, torch.Tensor):
        return ValueError(f"hidden must be a tensor [..., H], got {type(hidden).__name__}")
    if hidden.dim() < (2 if sequence_parallel else 1):
        return ValueError(f"hidden must be [..., H] ([s/tp, ..., H] with sequence_parallel), got "
                          f"shape {tuple(hidden.shape)}")
    if hidden.shape[-1] == 0:
        return ValueError(f"hidden: the hidden dimension is empty (shape "
                          f"{tuple(hidden.shape)}); the logits hidden @ weight.T need H >= 1")
    if hidden.dtype not in LOGITS_DTYPES:
        return ValueError(f"hidden must be bf16, fp16 or fp32, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        what = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        return ValueError(f"weight must be the 2-D local shard [V/tp, H] of the output layer, "
                          f"got {what}")
    if weight.shape[0] == 0:
        return ValueError("weight: the local vocabulary shard has no rows")
    if weight.shape[1] != hidden.shape[-1]:
        flipped = (": it looks transposed, [H, V/tp]; pass the output layer's weight as it is "
                   "stored, [V/tp, H] (Megatron's output_layer.weight)"
                   if weight.shape[0] == hidden.shape[-1] else "")
        return ValueError(f"weight must be [V/tp, H] with the hidden size H = "
                          f"{hidden.shape[-1]} (hidden's last dimension), got shape "
                          f"{tuple(weight.shape)}{flipped}")
    if weight.dtype != hidden.dtype:
        return ValueError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}: "
                          "the logits are computed in the model dtype, pass both in it")
    if weight.device != hidden.device:
        return ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    if isinstance(target, torch.Tensor) and tuple(target.shape) != lead_shape:
        where = (f"the gathered sequence ({tp} ranks x {hidden.shape[0]} rows: every rank passes "
                 "its equal-length shard of hidden and the full target)" if sequence_parallel
                 else "hidden")
        return ValueError(f"target shape {tuple(target.shape)} must equal the leading shape "
                          f"{lead_shape} of {where}")
    if grad_weights is not None:
        if target is None:
            return ValueError("grad_weights needs a target (it weights the target logprobs)")
        if not isinstance(grad_weights, torch.Tensor) or not grad_weights.dtype.is_floating_point:
            return ValueError("grad_weights must be a floating-point tensor shaped like target")
        if isinstance(target, torch.Tensor) and grad_weights.shape != target.shape:
            return ValueError(f"grad_weights shape {tuple(grad_weights.shape)} must equal target "
                              f"shape {tuple(target.shape)}")
        if grad_weights.device != hidden.device:
            return ValueError(f"grad_weights is on {grad_weights.device} but hidden on "
                              f"{hidden.device}")
        if entropy == "grad":
            return ValueError("entropy='grad' cannot be combined with grad_weights (the "
                              "forward-gradient mode serves log-prob losses only): pass "
                              "entropy='off' or 'metric'")
        if bool_error("argmax", argmax) is None and argmax:
            return ValueError("argmax=True cannot be combined with grad_weights (the "
                              "forward-gradient mode merges its statistics chunk by chunk)")
    for name, option in LINEAR_HEAD_OPTIONS.items():  # their declared checks
        try:
            option.check(name, head[name])
        except ValueError as error:  # InputTypeError included
            return error
    if partial_hidden_grad and sequence_parallel:
        return ValueError("partial_hidden_grad=True cannot be combined with sequence_parallel=True "
                          "(the gather of hidden happens inside, so its reduce-scatter must "
                          "too): gather the sequence yourself and pass it whole")
    if accumulate_into_main_grad:
        main_grad = getattr(weight, "main_grad", None)
        if (not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape
                or not main_grad.dtype.is_floating_point or main_grad.device != weight.device):
            return ValueError("accumulate_into_main_grad=True needs weight.main_grad, a float "
                              f"tensor of the weight's shape {tuple(weight.shape)} and device "
                              "(Megatron's DDP buffer)")
    return None


_HEAD = agreed_options(LINEAR_HEAD_OPTIONS)


def first_device(*candidates) -> torch.device:
    """The device of the first tensor among ``candidates`` (CPU if none is a tensor)."""
    for x in candidates:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _gradients(code: int) -> str:
    return {3: "hidden and weight", 2: "hidden", 1: "weight", 0: "none"}[code]


def checked_linear_config(hidden, weight, target, grad_weights, tp_group, *,
                          local_error: ValueError | None = None, agree: tuple = (),
                          differentiable: bool = True, **options) -> LinearStatsConfig:
    """Validate one call: the fused op's own arguments and options
    (:data:`~.options.LINEAR_HEAD_OPTIONS`), then the core op's checks
    (``_checks.checked_config``, the other ``options``) on the shape, dtype and device of the
    logits it will compute.

    Under ``validate`` and tp > 1 a problem on one rank raises on every rank, and the ranks must
    agree, in the core op's one all-gather, on every option and input that changes the
    collectives or the gradients: the hidden size H, the head's options, ``grad_weights`` (given,
    and its values), which gradients backward makes (``hidden`` and ``weight`` under grad mode
    and ``requires_grad``; ``differentiable=False`` for an op without backward), in the
    forward-gradient mode the chunk size, then the caller's ``agree`` entries.
    """
    head = {name: options.pop(name, option.default)
            for name, option in LINEAR_HEAD_OPTIONS.items()}
    chunk_size = options.pop("chunk_size", None)
    _, tp = _comm.group_rank_size(tp_group)
    lead = lead_shape(hidden, head["sequence_parallel"], tp)
    problem = linear_problem(hidden, weight, target, grad_weights, lead_shape=lead, tp=tp,
                             entropy=options.get("entropy", STATS_OPTIONS["entropy"].default),
                             argmax=options.get("argmax"), head=head)
    if problem is None and local_error is not None:
        problem = local_error
    auto = chunk_size is None and problem is None
    if problem is None:  # numpy's bool_ taken as a Python bool from here on
        head = {name: bool(value) for name, value in head.items()}
    grad_on = differentiable and torch.is_grad_enabled()
    grad_hidden = grad_on and isinstance(hidden, torch.Tensor) and hidden.requires_grad
    grad_weight = grad_on and isinstance(weight, torch.Tensor) and weight.requires_grad
    forward_grad = grad_weights is not None and (grad_hidden or grad_weight)
    if problem is None:
        width = weight.shape[0]
        logits = LogitsSpec((*lead, width), hidden.dtype, hidden.device,
                            sample=weight.detach()[0])
        if chunk_size is None:  # the Triton backend's own below, once the kernel is known
            chunk_size = auto_linear_chunk_size(width, hidden.device)
    else:  # the core checks' cross-rank exchange makes this rank's problem raise everywhere
        logits = LogitsSpec((0,), torch.float32, first_device(hidden, weight, target))
    agree = (("hidden size H (hidden's last dimension)", lambda: hidden.shape[-1]),
             *((field, functools.partial(encode, head[name])) for name, field, encode in _HEAD),
             ("grad_weights", lambda: int(grad_weights is not None),
              lambda given: "tensor" if given else None),
             (Field("grad_weights values", checksum=True),
              lambda: -1 if grad_weights is None else tensor_checksum(grad_weights)),
             ("gradients asked (hidden, weight: grad mode and requires_grad)",
              lambda: 2 * grad_hidden + grad_weight, _gradients),
             ("chunk_size in the forward-gradient mode (one all-gather per chunk; pass one "
              "chunk_size on every rank)", lambda: int(chunk_size) if forward_grad else -1,
              lambda size: size if size >= 0 else "not in that mode"),
             *agree)
    stats = checked_config(logits, target, tp_group, chunk_size=chunk_size, local_error=problem,
                           agree=agree, **options)
    if auto and stats.kernel == "triton" and hidden.device.type != "cpu":
        stats = dataclasses.replace(stats, chunk_size=auto_linear_chunk_size(
            weight.shape[0], hidden.device, tiles=True, itemsize=hidden.element_size()))
    return LinearStatsConfig(stats=stats, forward_grad=forward_grad, grad_hidden=grad_hidden,
                             grad_weight=grad_weight,
                             **{**head, "sequence_parallel": head["sequence_parallel"] and tp > 1})
