"""Weight and input gradients of the fused LM head from one chunk's logits gradient.

``dX = g @ W`` and ``dW += g.T @ h`` per chunk, the weight gradient summed in fp32 from
model-dtype operands (by the GEMM mode probed once per device type, :func:`wgrad_mode`), and
Megatron's ``main_grad`` contract (gradient-accumulation fusion).
"""

from __future__ import annotations

import torch

from ..workspace import capturing
from .linear import ChunkBuffers, LinearStatsConfig

_WGRAD_MODES: dict[str, str] = {}


def wgrad_mode(device_type: str) -> str:
    """How this device adds ``g.T @ h`` (bf16/fp16 operands) into an fp32 accumulator.

    ``"addmm"``: one fp32-output GEMM accumulating in place (like Megatron's
    ``wgrad_gemm_accum_fp32``); ``"mm"``: an fp32-output GEMM into a ``[W, H]`` temporary, then an
    add; ``"upcast"``: fp32 copies of the operands and an fp32 GEMM (exact; the CPU's, where torch
    has no mixed-dtype GEMM). Probed on the first call outside CUDA graph capture (the probe reads
    a value on the host); during a capture before any probe, ``"upcast"``."""
    if device_type != "cuda":
        return "upcast"
    if device_type not in _WGRAD_MODES:
        if capturing():
            return "upcast"
        _WGRAD_MODES[device_type] = _probe_wgrad_mode(device_type)
    return _WGRAD_MODES[device_type]


def _probe_wgrad_mode(device_type: str) -> str:
    a = torch.ones(2, 2, device=device_type, dtype=torch.bfloat16)
    acc = torch.ones(2, 2, device=device_type)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        if bool((acc == 3.0).all()):
            return "addmm"
    except (RuntimeError, TypeError):
        pass
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return "mm"
    except (RuntimeError, TypeError):
        return "upcast"


def accumulate_wgrad(acc: torch.Tensor, grad: torch.Tensor, h: torch.Tensor,
                     bufs: ChunkBuffers, *, fresh: bool = False) -> None:
    """``acc += grad.T @ h`` accumulated in fp32 (``acc`` fp32 ``[W, H]``; ``grad`` ``[n, W]`` and
    ``h`` ``[n, H]`` in the model dtype), or with ``fresh`` ``acc = grad.T @ h`` whatever ``acc``
    holds (the GEMM's ``beta = 0``: no zero fill before the first chunk, no read of it).
    Clobbers ``bufs.grad32``."""
    beta = 0.0 if fresh else 1.0
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), h, beta=beta)
        return
    mode = wgrad_mode(acc.device.type)
    if mode == "addmm":
        torch.addmm(acc, grad.t(), h, beta=beta, out_dtype=acc.dtype, out=acc)
    elif mode == "mm":
        product = torch.mm(grad.t(), h, out_dtype=acc.dtype)
        acc.copy_(product) if fresh else acc.add_(product)
    else:
        n = grad.shape[0]
        acc.addmm_(bufs.grad32(n).copy_(grad).t(), bufs.h32(n).copy_(h), beta=beta)


def input_grads_of_chunk(grad, h, weight, dx_rows, acc, bufs: ChunkBuffers, *,
                         fresh: bool = False) -> None:
    """``dx_rows = grad @ weight`` and :func:`accumulate_wgrad` into ``acc``, each if given, from
    one chunk's logits gradient ``grad`` [n, W]."""
    if dx_rows is not None:
        torch.matmul(grad, weight, out=dx_rows)
    if acc is not None:
        accumulate_wgrad(acc, grad, h, bufs, fresh=fresh)


def weight_grad_buffer(weight, main_grad, *, fresh: bool = False) -> torch.Tensor:
    """The fp32 ``[W, H]`` accumulator: an fp32 ``main_grad`` itself, else fresh zeros (with
    ``fresh``: uninitialised, for a first chunk written with ``fresh=True``; see
    :func:`fresh_weight_grad`)."""
    if main_grad is not None and main_grad.dtype == torch.float32:
        return main_grad
    make = torch.empty if fresh else torch.zeros
    return make(weight.shape, dtype=torch.float32, device=weight.device)


def fresh_weight_grad(main_grad, tiles: bool) -> bool:
    """Whether the first chunk writes the weight-gradient sums instead of adding to them: for a
    ``tiles`` backend (bits of its own) into sums of our own, not an fp32 ``main_grad``; the
    torch path keeps its zero fill and additions, bit for bit."""
    return tiles and (main_grad is None or main_grad.dtype != torch.float32)


def finish_weight_grad(acc, weight, main_grad, cfg: LinearStatsConfig):
    """The gradient to return for ``weight`` given its fp32 sums ``acc``: ``acc`` in the weight
    dtype, or with ``accumulate_into_main_grad`` Megatron's gradient-accumulation-fusion contract
    (``tensor_parallel.layers``): ``acc`` added into ``main_grad`` (unless it is it); with a
    ``grad_added_to_main_grad`` attribute, that set True and a dummy gradient returned (zeros if
    ``weight.zero_out_wgrad``, else uninitialised), otherwise None."""
    if not cfg.accumulate_into_main_grad:
        return acc.to(weight.dtype)
    if acc is not main_grad:
        main_grad.add_(acc)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=weight.dtype, device=weight.device)
