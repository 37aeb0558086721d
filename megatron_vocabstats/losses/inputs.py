"""The losses' result type, the checks of per-token inputs (never their values) and the masked
sums and ``[sum, count]`` entries the losses build on."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LossOutput(NamedTuple):
    """Megatron's loss-function result; unpacks as ``loss_sum, num_tokens, report``. Dtypes and
    the schedule's division: ``docs/ops.md``, "Losses for forward_step"."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    report: dict[str, torch.Tensor]


_EVERY_RANK_HINT = ("every tensor-parallel rank must pass the same labels, loss_mask and "
                    "per-token inputs")


def _check_float(name: str, tensor, like: torch.Tensor | None = None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if like is not None:
        if tensor.shape != like.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but logprobs has {tuple(like.shape)}; "
                "every per-token tensor must have the same shape"
            )
        if tensor.device != like.device:
            raise ValueError(f"{name} is on {tensor.device} but logprobs on {like.device}")


def _token_mask(loss_mask, like: torch.Tensor, like_name: str = "logprobs") -> torch.Tensor:
    """``loss_mask != 0`` as bool, after checking it is present and shaped like ``like``."""
    if loss_mask is None:
        raise ValueError(
            "loss_mask is required (a tensor shaped like the tokens, non-zero where a token "
            "counts); pass torch.ones_like(...) to count every token"
        )
    if not isinstance(loss_mask, torch.Tensor):
        raise ValueError(f"loss_mask must be a tensor, got {type(loss_mask).__name__}")
    if loss_mask.shape != like.shape:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)} but {like_name} has "
            f"{tuple(like.shape)}"
        )
    if loss_mask.device != like.device:
        raise ValueError(f"loss_mask is on {loss_mask.device} but {like_name} on {like.device}")
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _per_token_inputs(logprobs, loss_mask, **optional) -> torch.Tensor:
    """Check ``logprobs``, the mask and the other per-token tensors; return the bool mask."""
    _check_float("logprobs", logprobs)
    if logprobs.dim() == 0:
        raise ValueError("logprobs must have at least one (token) dimension, got a scalar")
    mask = _token_mask(loss_mask, logprobs)
    for name, tensor in optional.items():
        if tensor is not None:
            _check_float(name, tensor, like=logprobs)
    return mask


def _compute_dtype(logprobs: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logprobs.dtype, torch.float32)


def _masked(values: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype`` with masked-out positions set to 0 (NaN or inf there included)."""
    return torch.where(mask, values.to(dtype), 0.0)


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dtype=torch.int32)


def _pair(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A detached fp32 ``[sum, count]`` copy (the schedule divides the loss in place)."""
    return torch.stack([total.detach().float(), count.float()])
