"""Kernel backends behind the engine's per-chunk seam (:mod:`..engine.kernel`), and their choice.

Lives here: :data:`KERNELS` / :data:`KERNEL_CHOICES` (the values of the ops' ``kernel``
argument), :data:`KERNEL_ENV` (the environment variable that forces one for ``kernel="auto"``),
:func:`resolve_kernel`, and the Triton kernels' block width (:func:`block_columns`) and fused
tiles (:data:`LINEAR_BLOCKS`). The Triton
kernels themselves live in :mod:`.triton_stats`, which imports ``triton``: nothing here does
(``importlib.util.find_spec`` only), so importing the package never needs triton or a GPU. May
import :mod:`.._argtypes`, the standard library and torch only (``triton_stats`` and
``triton_tiles``, the kernels, import triton and are imported only once chosen).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .._argtypes import check_choice

# Columns per block of the Triton kernels: a power of two, at most this many (fewer for narrow
# shards).
MAX_BLOCK_N = 1024
# The fused LM-head kernels' tile: BLOCK_M rows x BLOCK_N columns, BLOCK_K of the hidden size per
# tl.dot. Fixed (never autotuned: a row's reduction order must not depend on the batch). Chosen
# for Hopper's wgmma (64-row warpgroup tiles, 128-byte K slices of bf16), not yet tuned on a GPU.
LINEAR_BLOCKS = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)


def block_columns(width: int, max_block: int = MAX_BLOCK_N) -> int:
    """``BLOCK_N`` of the Triton kernels for a shard of ``width`` columns: the next power of two
    >= width, at least 16 and at most ``max_block`` (a power of two). Here, not in
    :mod:`.triton_stats`, so that the tests' error bounds can read it without triton."""
    return max(16, min(max_block, 1 << (max(width, 1) - 1).bit_length()))


# Resolved backends (``StatsConfig.kernel``) and the values the ops accept.
KERNELS = ("torch", "triton")
KERNEL_CHOICES = ("auto", *KERNELS)
# Forces the backend of kernel="auto" (for tests and A/B runs): "torch" or "triton".
KERNEL_ENV = "VOCABSTATS_KERNEL"
# Whether "auto" takes Triton for CUDA logits. Off until the kernels have passed the GPU parity
# step of tests/gpu/run.sh on a device (they are tested on CPU under Triton's interpreter and
# compiled for sm_90 offline, never run on a GPU yet): an untested default must not reach the
# users' GPUs. kernel="triton" or VOCABSTATS_KERNEL=triton opts in.
AUTO_TRITON_ON_CUDA = False


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (looked up once, not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET`` set to a true value; it must
    be set before triton is imported, see ``triton_stats.launch``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_kernel(kernel, device: torch.device) -> str:
    """The backend (one of :data:`KERNELS`) of one call of the unfused op or the fused LM head.

    ``kernel``: ``"auto"`` (the :data:`KERNEL_ENV` value if set, else ``"triton"`` for CUDA
    logits when triton imports and :data:`AUTO_TRITON_ON_CUDA` is on, ``"torch"`` otherwise),
    ``"torch"`` or ``"triton"``. Every batch-invariant mode runs on either backend (the Triton
    kernels keep a row's reduction order fixed, ``triton_stats``).

    Raises ``ValueError`` naming the argument for a value not in :data:`KERNEL_CHOICES` (or a bad
    :data:`KERNEL_ENV`), and for ``"triton"`` (given or forced) without the triton package or
    with logits that are not on CUDA outside the interpreter (``TRITON_INTERPRET=1``).
    """
    check_choice("kernel", kernel, KERNEL_CHOICES)
    source = f"kernel={kernel!r}"
    if kernel == "auto":
        forced = os.environ.get(KERNEL_ENV, "")
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
