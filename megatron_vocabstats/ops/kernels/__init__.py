"""Kernel backends behind the engine's per-chunk seam (:mod:`..engine.kernel`), and their choice.

The ops' ``kernel`` values and their resolution, and the Triton kernels' block and tile sizes.
Nothing here imports ``triton`` (``importlib.util.find_spec`` only), so importing the package
never needs triton or a GPU; the Triton modules (host side: :mod:`.triton_stats`) do.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .._argtypes import check_choice
from ..options import KERNEL_CHOICES, KERNELS

# Columns per block of the unfused Triton kernels: a power of two, at most this many (fewer for
# narrow shards) and MAX_BLOCK_BYTES of logits: 4 KiB per program and step in flight.
MAX_BLOCK_N = 2048
MAX_BLOCK_BYTES = 4096
# The fused LM-head kernels' tiles (bf16/fp16): BLOCK_M x BLOCK_N for the statistics
# (GRAD_BLOCK_N columns for the gradient), BLOCK_K of H per tl.dot, SPLIT_N columns (a multiple
# of BLOCK_N) per statistics program, GROUP_M row tiles per launch group (triton_tiles.tile_order),
# warps and stages. Fixed, never autotuned: a row's reduction order must not depend on the batch.
# Chosen with the static H200 model, spill-free (docs/gpu-model.md, docs/kernels.md).
LINEAR_BLOCKS = dict(BLOCK_M=128, BLOCK_N=128, GRAD_BLOCK_N=256, BLOCK_K=64, SPLIT_N=2048,
                     GROUP_M=16, num_warps=8, num_stages=3)
# fp32 models: IEEE fp32 products on the CUDA cores (no tensor cores), tiles that fit in
# registers without spilling (checked by tests/unit/_triton_compile.py).
LINEAR_BLOCKS_FP32 = dict(BLOCK_M=32, BLOCK_N=64, GRAD_BLOCK_N=64, BLOCK_K=32, SPLIT_N=2048,
                          GROUP_M=16, num_warps=4, num_stages=2)


def linear_blocks(dtype: torch.dtype, blocks: dict | None = None) -> dict:
    """The fused kernels' tiles for model dtype ``dtype`` (keys of :data:`LINEAR_BLOCKS`),
    updated by ``blocks``."""
    return {**(LINEAR_BLOCKS_FP32 if dtype == torch.float32 else LINEAR_BLOCKS), **(blocks or {})}


def block_columns(width: int, itemsize: int = 2, max_block: int = MAX_BLOCK_N) -> int:
    """``BLOCK_N`` of the unfused Triton kernels for ``width`` columns of ``itemsize`` bytes: the
    next power of two >= width, at least 16, at most ``max_block`` and :data:`MAX_BLOCK_BYTES`
    (here so that the tests' error bounds can read it without triton)."""
    cap = min(max_block, MAX_BLOCK_BYTES // itemsize)
    return max(16, min(cap, 1 << (max(width, 1) - 1).bit_length()))


# Forces the backend of kernel="auto" (for tests and A/B runs): "torch" or "triton".
KERNEL_ENV = "VOCABSTATS_KERNEL"
# Whether "auto" takes Triton for CUDA logits: off until the kernels pass the GPU parity step of
# tests/gpu/run.sh (an untested default must not reach users' GPUs); kernel="triton" opts in.
AUTO_TRITON_ON_CUDA = False


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (looked up once, not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET`` set to a true value; it must
    be set before triton is imported, see ``triton_stats.launch``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def forced_kernel() -> str:
    """The value of :data:`KERNEL_ENV` (``""`` when unset), checked by :func:`resolve_kernel`."""
    return os.environ.get(KERNEL_ENV, "")


def resolve_kernel(kernel, device: torch.device) -> str:
    """The backend (one of :data:`KERNELS`) of one call of the unfused op or the fused LM head.

    ``"auto"``: the :data:`KERNEL_ENV` value if set, else ``"triton"`` for CUDA tensors when
    triton is installed and :data:`AUTO_TRITON_ON_CUDA` is on, else ``"torch"``. Raises
    ``ValueError`` naming the argument for a value not in :data:`KERNEL_CHOICES` (or a bad
    :data:`KERNEL_ENV`), and for ``"triton"`` (given or forced) without the triton package or,
    outside the interpreter (``TRITON_INTERPRET=1``), with tensors that are not on CUDA."""
    check_choice("kernel", kernel, KERNEL_CHOICES)
    source = f"kernel={kernel!r}"
    if kernel == "auto":
        forced = forced_kernel()
        if forced:
            if forced not in KERNELS:
                raise ValueError(f"{KERNEL_ENV} must be one of {KERNELS} (or unset), got "
                                 f"{forced!r}")
            kernel, source = forced, f"{KERNEL_ENV}={forced}"
        else:
            kernel = ("triton" if AUTO_TRITON_ON_CUDA and device.type == "cuda"
                      and triton_available() else "torch")
    if kernel == "torch":
        return "torch"
    if not triton_available():
        raise ValueError(f"{source} needs the triton package, which is not installed; pass "
                         "kernel='torch' (or 'auto')")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{source} needs the op's tensors (the logits, or hidden and weight) on "
                         f"a CUDA device (got {device.type}), or Triton's interpreter "
                         "(TRITON_INTERPRET=1 before triton is imported)")
    return "triton"
