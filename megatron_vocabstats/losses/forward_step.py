"""A ``forward_step_func`` for Megatron's schedules (:func:`make_forward_step`) and its batch."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..mcore import tp_group_of
from .stats import PerTokenLoss, StatsOptions, token_loss

# tp_group value of make_forward_step meaning "read the tensor-parallel group from the model".
FROM_MODEL = "model"


class StepBatch(NamedTuple):
    """One microbatch as :func:`make_forward_step`'s ``batch_fn`` returns it.

    ``model_inputs``: keywords of the model call, never ``labels`` (the model must return logits).
    ``labels``: int64 ``[b, s]``; ``loss_mask``: ``[b, s]``, non-zero where a token counts;
    ``loss_inputs``: extra keywords of the per-token loss (``old_logprobs``, ``advantages``, ...).
    """

    model_inputs: Mapping[str, Any]
    labels: torch.Tensor
    loss_mask: torch.Tensor
    loss_inputs: Mapping[str, Any] | None = None


def _module_chain(model) -> Iterator[Any]:
    """``model``, ``model.module``, ``model.module.module``, ... (DDP, Float16Module, FSDP)."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        yield model
        model = getattr(model, "module", None)


def model_tp_group(model) -> dist.ProcessGroup | None:
    """The tensor-parallel group (None = none) of a Megatron model under its ``.module`` wrappers,
    read as :func:`megatron_vocabstats.mcore.tp_group_of` does; never imports Megatron."""
    *_, inner = _module_chain(model)
    return tp_group_of(inner)


def _takes_fp32_output(model) -> bool:
    """Whether a wrapper in the chain (``Float16Module``) takes ``fp32_output``."""
    for module in _module_chain(model):
        forward = getattr(module, "forward", None)
        if forward is None:
            continue
        try:
            params = inspect.signature(forward).parameters
        except (TypeError, ValueError):
            continue
        if "fp32_output" in params:
            return True
    return False


def make_forward_step(
    batch_fn: Callable[[Any], StepBatch],
    loss_fn: PerTokenLoss,
    *,
    tp_group: dist.ProcessGroup | None | str = FROM_MODEL,
    stats: StatsOptions | None = None,
):
    """A ``forward_step_func`` for Megatron's ``get_forward_backward_func()``.

    ``forward_step(data_iterator, model, checkpoint_activations_microbatch=None, *,
    return_schedule_plan=False)`` runs ``model(**batch.model_inputs)`` (or
    ``model.build_schedule_plan``) on ``batch = batch_fn(data_iterator)`` and returns the output
    (logits ``[b, s, V/tp]`` or a fused head's, see :func:`token_stats`) and ``partial(token_loss,
    labels=..., loss_mask=..., loss_fn=loss_fn, loss_inputs=..., tp_group=..., options=stats)``.
    A ``Float16Module`` taking ``fp32_output`` gets False (bf16 logits stay bf16) unless
    ``model_inputs`` sets it. ``tp_group``: the vocabulary's group, None = none, ``"model"``
    (default) = :func:`model_tp_group` at each step; ``stats``: :class:`StatsOptions`.

    Raises ``ValueError``: at build time, a non-callable ``batch_fn``/``loss_fn`` or a string
    ``tp_group`` other than ``"model"``; at each step, a ``batch_fn`` result that is not a
    :class:`StepBatch` or whose ``model_inputs`` set ``labels``.
    """
    if not callable(batch_fn):
        raise ValueError(f"batch_fn must be callable, got {type(batch_fn).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(tp_group, str) and tp_group != FROM_MODEL:
        raise ValueError(f"tp_group must be a process group, None or {FROM_MODEL!r}, "
                         f"got {tp_group!r}")
    stats = stats or StatsOptions()

    def forward_step(data_iterator, model, checkpoint_activations_microbatch=None, *,
                     return_schedule_plan=False):
        batch = batch_fn(data_iterator)
        if not isinstance(batch, StepBatch):
            raise ValueError(f"batch_fn must return a StepBatch, got {type(batch).__name__}")
        inputs = dict(batch.model_inputs)
        if "labels" in inputs:
            raise ValueError("batch_fn: model_inputs must not contain labels (the model would "
                             "return its own loss instead of logits); return them as "
                             "StepBatch.labels")
        group = model_tp_group(model) if isinstance(tp_group, str) else tp_group
        if return_schedule_plan:
            output = model.build_schedule_plan(**inputs)
        else:
            if "fp32_output" not in inputs and _takes_fp32_output(model):
                inputs["fp32_output"] = False
            output = model(**inputs)
        loss = functools.partial(token_loss, labels=batch.labels, loss_mask=batch.loss_mask,
                                 loss_fn=loss_fn, loss_inputs=batch.loss_inputs,
                                 tp_group=group, options=stats)
        return output, loss

    return forward_step
