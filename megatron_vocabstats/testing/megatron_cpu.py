"""CPU shims that let Megatron-Core's ``GPTModel`` run without CUDA, for the tests and the CPU
examples (docs/megatron.md).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


class _CpuRNGTracker:
    """Stands in for ``CudaRNGStatesTracker``: named seeds are kept, forks use the CPU generator."""

    def __init__(self):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def add(self, name, seed):
        self.states_[name] = seed

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


class _CudaFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        # A bare index (torch.cuda.current_device()) names a CUDA device; some torch releases
        # refuse torch.device(0) without an accelerator.
        if device is not None and (isinstance(device, int) and not isinstance(device, bool)
                                   or torch.device(device).type == "cuda"):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def cuda_factories_on_cpu():
    """A context in which ``device="cuda"`` tensor factories build on the CPU (no-op with CUDA), for
    Megatron's pipeline schedules, whose token counter is made on ``cuda`` unconditionally."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaFactoriesOnCpu()


def _cpu_memory_buffer():
    from megatron.core import utils

    class _CpuMemoryBuffer(utils.GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            numel = 1
            for dim in tensor_shape:
                numel *= dim
            buf = self.buffer.get((name, dtype))
            if buf is None or buf.numel() < numel:
                buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
            return buf[:numel].view(*tensor_shape)

    return _CpuMemoryBuffer()


def install_cpu_shims() -> bool:
    """Without CUDA, replace what Megatron-Core builds on ``cuda`` (the global memory buffer, the
    causal masks, the RNG tracker) with CPU versions; True if installed. Call after
    ``initialize_model_parallel`` and before building the model; idempotent."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    from megatron.core import parallel_state

    if not getattr(parallel_state._GLOBAL_MEMORY_BUFFER, "_vocabstats_cpu", False):
        parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_memory_buffer()
        parallel_state._GLOBAL_MEMORY_BUFFER._vocabstats_cpu = True
    if _INSTALLED:
        return True
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils

    for module in (transformer_utils, fused_softmax):
        if hasattr(module, "get_default_causal_mask"):
            module.get_default_causal_mask = _cpu_causal_mask
        if hasattr(module, "get_sliding_window_causal_mask"):
            module.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    mp_random._CUDA_RNG_STATE_TRACKER = _CpuRNGTracker()
    if hasattr(mp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _INSTALLED = True
    return True


def tag_torch_norm_for_sequence_parallel() -> None:
    """Let Megatron's ``WrappedTorchNorm`` (without Apex or transformer-engine) run under
    ``sequence_parallel``, its parameters tagged as Apex's are, so that ``finalize_model_grads``
    all-reduces their gradients over tp (docs/fused-head.md). Idempotent."""
    from megatron.core.transformer import torch_norm

    build = torch_norm.WrappedTorchNorm.__new__
    if getattr(build, "_tags_sequence_parallel", False):
        return

    def tagged(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = build(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    tagged._tags_sequence_parallel = True
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(tagged)
