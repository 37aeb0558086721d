"""Chunk buffers reused across calls, with lifetimes that stay safe under streams and CUDA graphs.

:data:`WORKSPACE`, one small bounded cache, keeps the ops' fp32 chunk buffers between calls. A
buffer taken is private until given back, its content undefined (like ``torch.empty``); on CUDA
its next user's stream waits for every stream that used it (an event, no host sync); under CUDA
graph capture or a tracer (:func:`tracing`) the cache is bypassed. The rules in full:
``docs/cuda-graphs.md``, "The chunk workspace".
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._argtypes import check_number

__all__ = [
    "WORKSPACE",
    "Lease",
    "Workspace",
    "configure_workspace",
    "reset_workspace",
    "with_workspace_reset",
]

DEFAULT_MAX_BUFFERS = 8
DEFAULT_MAX_BYTES = 2 * 2**30


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False before CUDA is initialised:
    without a usable GPU the capture query itself would raise)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def tracing() -> bool:
    """Whether a tracer runs the call on stand-in tensors: ``torch.compile`` (dynamo), or
    ``make_fx``/``torch.export`` (fake tensors, symbolic shapes included, or a proxy of real
    ones). Such tensors belong to that trace: none is cached, and their values are not read on
    the host."""
    if torch.compiler.is_compiling():
        return True
    try:
        from torch._guards import detect_fake_mode

        proxy = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    except (ImportError, AttributeError):  # pragma: no cover - every supported torch has them
        return False
    return proxy is not None or detect_fake_mode() is not None


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def untracked(tensor: torch.Tensor) -> torch.Tensor:
    """An autograd Function's input as its forward should use it: under a tracer
    (:func:`tracing`) a floating tensor viewed as the same-width integer dtype and back (same
    memory, no copy), else ``tensor``. ``make_fx`` records the forward's ops without their grad
    mode, so a replay on inputs that require grad would track the forward's in-place and ``out=``
    work and fail; through an integer view nothing is tracked, as in eager."""
    if not tracing() or not tensor.is_floating_point():
        return tensor
    return tensor.view(_SAME_WIDTH_INT[tensor.element_size()]).view(tensor.dtype)


def _size_class(numel: int) -> int:
    """``numel`` rounded up to a multiple of about 1/8 to 1/16 of itself (at least 1)."""
    step = 1 << max(0, numel.bit_length() - 4)
    return max(1, -(-numel // step) * step)


@dataclass(eq=False)
class Lease:
    """A buffer taken from a :class:`Workspace`, ``tensor`` the view to use; give it back with
    :meth:`Workspace.give` (or let it go: an un-returned lease is simply freed)."""

    tensor: torch.Tensor
    _base: torch.Tensor
    _cacheable: bool
    _streams: list = field(default_factory=list)

    def record_stream(self, stream) -> None:
        """Declare that ``stream`` (a ``torch.cuda.Stream``) reads or writes the buffer too; its
        pending work is waited for before the buffer is handed to anyone else."""
        if stream not in self._streams:
            self._streams.append(stream)


@dataclass(eq=False)
class _Free:
    base: torch.Tensor
    key: tuple
    events: list
    streams: list


class Workspace:
    """A bounded cache of flat buffers keyed by ``(device, dtype, size class)``, keeping at most
    ``max_buffers`` free buffers and ``max_bytes`` bytes of them (``ValueError`` for a bound that
    is not a non-negative int)."""

    def __init__(self, *, max_buffers: int = DEFAULT_MAX_BUFFERS,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self._lock = threading.Lock()
        self._free: list[_Free] = []
        self.configure(max_buffers=max_buffers, max_bytes=max_bytes)

    def configure(self, *, max_buffers: int | None = None, max_bytes: int | None = None) -> None:
        """Change the bounds (None keeps one); free buffers beyond them are dropped now."""
        bound = dict(integer=True, low=0, high=2**63 - 1, none_ok=True)
        max_buffers = check_number("max_buffers", max_buffers, **bound)
        max_bytes = check_number("max_bytes", max_bytes, **bound)
        with self._lock:
            if max_buffers is not None:
                self.max_buffers = max_buffers
            if max_bytes is not None:
                self.max_bytes = max_bytes
            self._trim()

    def take(self, shape, dtype: torch.dtype, device) -> Lease:
        """A buffer viewed as ``shape`` (content undefined), cached if one fits, else new (always
        new and never cached under capture or :func:`tracing`). No host sync: on CUDA the wait for
        its previous streams is queued on the current stream."""
        device = torch.device(device)
        numel = 1
        for n in shape:
            numel *= int(n)
        size = _size_class(numel)
        key = (device, dtype, size)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if capturing() or tracing():
            base = torch.empty(size, dtype=dtype, device=device)
            return Lease(base[:numel].view(shape), base, False, [stream] if stream else [])
        entry = None
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if self._free[i].key == key:
                    entry = self._free.pop(i)
                    break
        if entry is None:
            base = torch.empty(size, dtype=dtype, device=device)
            streams = [stream] if stream else []
        else:
            base = entry.base
            for event in entry.events:
                stream.wait_event(event)
            streams = list(entry.streams)
            if stream is not None and stream not in streams:
                streams.append(stream)
        return Lease(base[:numel].view(shape), base, True, streams)

    def give(self, *leases: Lease | None) -> None:
        """Return leases (None entries ignored); their tensors must not be used afterwards."""
        keep = not (capturing() or tracing())
        for lease in leases:
            if lease is None or lease._base is None or not lease._cacheable or not keep:
                continue
            base = lease._base
            events = []
            for stream in lease._streams:
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
            entry = _Free(base, (base.device, base.dtype, base.numel()), events, lease._streams)
            with self._lock:
                self._free.append(entry)
                self._trim()
            lease.tensor = lease._base = None

    def reset(self) -> None:
        """Drop every free buffer (their memory goes back to the allocator)."""
        with self._lock:
            dropped, self._free = self._free, []
        for entry in dropped:
            _release(entry)

    def cached(self) -> tuple[int, int]:
        """``(free buffers, their bytes)`` now in the cache."""
        with self._lock:
            return len(self._free), sum(_nbytes(e.base) for e in self._free)

    def free_buffers(self) -> list[torch.Tensor]:
        """The free cached buffers (flat tensors, e.g. for a memory tracker), still owned by the
        cache: read their sizes, never write to them."""
        with self._lock:
            return [e.base for e in self._free]

    def _trim(self) -> None:
        total = sum(_nbytes(e.base) for e in self._free)
        while self._free and (len(self._free) > self.max_buffers or total > self.max_bytes):
            entry = self._free.pop(0)
            total -= _nbytes(entry.base)
            _release(entry)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _release(entry: _Free) -> None:
    """Let the allocator have the memory back once every stream that used it is done."""
    if entry.base.device.type == "cuda":
        for stream in entry.streams:
            entry.base.record_stream(stream)


WORKSPACE = Workspace()


def reset_workspace() -> None:
    """Drop every free buffer of :data:`WORKSPACE` (back to the allocator); buffers a running op
    holds go back to the emptied cache when given back. Raises nothing."""
    WORKSPACE.reset()


def configure_workspace(*, max_buffers: int | None = None, max_bytes: int | None = None) -> None:
    """Set the bounds of :data:`WORKSPACE`: at most ``max_buffers`` free buffers and ``max_bytes``
    bytes (None keeps a bound; defaults 8 and 2 GiB; ``max_buffers=0`` turns the cache off).
    Results never depend on it; free buffers beyond the new bounds are dropped at once.

    Raises:
        ValueError: a bound that is not a non-negative int.
    """
    WORKSPACE.configure(max_buffers=max_buffers, max_bytes=max_bytes)


def with_workspace_reset(reset: Callable) -> Callable:
    """``reset`` (e.g. Megatron's ``FullCudaGraphWrapper.reset_cuda_graph`` or
    ``delete_cuda_graphs``) followed by :func:`reset_workspace`::

        FullCudaGraphWrapper.reset_cuda_graph = with_workspace_reset(
            FullCudaGraphWrapper.reset_cuda_graph)

    Same signature and result as ``reset``; if ``reset`` raises, the cache is left as it was.
    """

    @functools.wraps(reset)
    def wrapped(*args, **kwargs):
        result = reset(*args, **kwargs)
        reset_workspace()
        return result

    return wrapped
