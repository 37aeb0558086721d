"""Prove, on CPU as on GPU, that a code path never synchronises with the host (as a CUDA graph
requires): aten ops checked against torch's ``data_dependent_output`` and ``dynamic_output_shape``
tags, and the ``Tensor`` methods that copy data to Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "forbid_host_sync"]

_aten = torch.ops.aten

# Tensor methods that hand data to Python directly (C++ copies, no aten op to see).
_HOST_METHODS = {
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.__array__: "Tensor.__array__",
}

# Ops tagged dynamic_output_shape whose shape is static for some arguments.
_INDEX_OPS = (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
              _aten._index_put_impl_.default)
_SIZED_REPEAT = _aten.repeat_interleave.Tensor
# Copies that move device data to the host.
_COPY_OPS = (_aten._to_copy.default, _aten.copy_.default)


class HostSyncError(RuntimeError):
    """Raised inside :func:`forbid_host_sync` by an op that would synchronise with the host."""


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _device_to_host(func, args, kwargs) -> bool:
    if func is _aten._to_copy.default:
        src, dst = args[0], kwargs.get("device")
        return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    dst, src = args[0], args[1]
    return src.device.type != "cpu" and dst.device.type == "cpu"


def _reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` needs the host, or None if it does not."""
    tags = func.tags
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(_is_mask(i) for i in indices):
            return "boolean-mask indexing (its output shape depends on the mask's values)"
        return None
    if func is _SIZED_REPEAT and kwargs.get("output_size") is not None:
        return None
    if torch.Tag.data_dependent_output in tags or func is _aten.is_nonzero.default:
        return "reads a tensor value on the host"
    if torch.Tag.dynamic_output_shape in tags:
        return "its output shape depends on tensor values"
    if func in _COPY_OPS and _device_to_host(func, args, kwargs):
        return "copies device memory to the host"
    return None


class _DispatchGuard(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch >= 2.9 wraps __torch_dispatch__ in dynamo.disable unless this says False, which
        # imports torch._dynamo (seconds per process) at the first op. The guard runs eager code.
        return False

    def __init__(self, allowed: frozenset[str]):
        super().__init__()
        self.allowed = allowed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _reason(func, args, kwargs)
        if reason is not None and func.name() not in self.allowed and str(func) not in self.allowed:
            raise HostSyncError(f"{func}: {reason}, so it would synchronise with the host")
        return func(*args, **kwargs)


class _FunctionGuard(TorchFunctionMode):
    def __init__(self, allowed: frozenset[str]):
        super().__init__()
        self.allowed = allowed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = _HOST_METHODS.get(func)
        if name is not None and name not in self.allowed:
            raise HostSyncError(f"{name}: copies tensor data to Python, so it would "
                                "synchronise with the host")
        return func(*args, **(kwargs or {}))


@contextmanager
def forbid_host_sync(*, allow: Iterable[str] = ()) -> Iterator[None]:
    """Raise :class:`HostSyncError`, naming the op, at the first op inside the block that would
    synchronise with the host, on every device: host reads of a value (``.item()``, ``int(t)``,
    ``bool(t)``, ``if t:``, ``aten.equal``, ``aten.allclose``, ``Tensor.tolist``, ``.numpy``,
    ``__array__``), value-dependent output shapes (``nonzero``, ``argwhere``, ``masked_select``,
    ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``, boolean-mask
    indexing; integer-tensor indexing is allowed), device-to-CPU copies.

    ``allow``: op names to let through, as ``func.name()`` (``"aten::nonzero"``), ``str(func)``
    (``"aten.nonzero.default"``) or ``"Tensor.tolist"`` and the like. Only ops dispatched in this
    thread and the autograd threads are seen, not syncs inside a C++ kernel or extension."""
    allowed = frozenset(allow)
    with _DispatchGuard(allowed), _FunctionGuard(allowed):
        yield
