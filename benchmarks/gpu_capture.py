"""Capture what an op would launch on a CUDA GPU, without one: every Triton kernel launch (the
kernel, its grid, its arguments and constexprs exactly as the op's host code passes them) and
every torch kernel (matmuls with their shapes and dtypes, the elementwise glue with its bytes),
in order.

The op runs on fake CUDA tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes,
strides, dtypes and a ``cuda`` device, no storage), so its host code takes the branches a GPU run
takes (``kernel="triton"`` resolves on the device type, ``x.is_cuda`` is True); the Triton
launches are recorded by a patched ``JITFunction.run`` instead of compiled and run, and the torch
kernels by a ``TorchDispatchMode`` on top of the fake mode. What a GPU-less process cannot fake is
patched for the capture only: the current stream and events (``ops.workspace``), the device
capability (``(9, 0)``, an H100/H200), the weight-gradient GEMM mode (``"addmm"``, what
``engine.wgrad`` probes on a CUDA build of torch >= 2.8; its fake ``addmm(out_dtype=...)``, which
torch 2.11 cannot run, by a shape check), ``.item()`` (a value the caller
gives; Liger reads a count of valid targets on the host), and the workspace cache, whose free
buffers the capture's fake ones never join.

:func:`specialisation` then turns a recorded launch into what ``JITFunction.run`` would compile:
Triton's own binder (``create_function_from_signature``) and argument packing on the recorded
values, a tensor's 16-byte alignment from its storage offset (CUDA allocations are 256-byte
aligned), ints equal to 1 made constexpr and multiples of 16 marked divisible, as a launch does.
Used by ``benchmarks/gpu_model.py`` and ``tests/unit/_triton_compile.py``.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

# Address of every captured tensor's storage: CUDA's caching allocator hands out 512-byte aligned
# blocks, so only the storage offset decides a pointer's 16-byte alignment.
_BASE = 1 << 21
# The target a launch on an H100/H200 compiles for.
SM90 = ("cuda", 90, 32)


@dataclass(frozen=True)
class TensorSpec:
    """A captured tensor argument: what a kernel launch and the cost model read of it."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    offset: int  # storage offset in elements

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset())

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.itemsize

    def data_ptr(self) -> int:  # what Triton's specialisation reads of a pointer argument
        return _BASE + self.offset * self.itemsize


@dataclass
class TritonLaunch:
    """One ``kernel[grid](*args, **kwargs)`` as the op's host code made it."""

    kernel: object  # triton JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    phase: str

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def arg(self, name: str):
        """The value of parameter ``name`` (positional or keyword)."""
        names = self.kernel.arg_names
        i = names.index(name)
        return self.args[i] if i < len(self.args) else self.kwargs[name]

    def ctas(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n


@dataclass
class TorchOp:
    """One aten op that runs a kernel: its name, input and output tensors."""

    name: str
    inputs: list
    outputs: list
    kwargs: dict
    phase: str


@dataclass
class Capture:
    """The launches of one captured run, in order; ``phase`` labels what follows."""

    events: list = field(default_factory=list)
    phase: str = "forward"
    host_syncs: int = 0

    def triton(self) -> list:
        return [e for e in self.events if isinstance(e, TritonLaunch)]


# aten ops that launch no kernel: views, allocation without a fill, metadata.
_NO_KERNEL = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
              "detach", "alias", "lift_fresh", "_to_copy_meta", "set_", "resize_",
              "record_stream", "sym_size", "sym_stride", "sym_numel", "is_same_size",
              "_local_scalar_dense")


def _specs(x) -> list:
    out = []
    for v in x if isinstance(x, (list, tuple)) else (x,):
        if isinstance(v, torch.Tensor):
            out.append(TensorSpec.of(v))
        elif isinstance(v, (list, tuple)):
            out.extend(_specs(v))
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self, capture: Capture, item_value):
        super().__init__()
        self.capture, self.item_value = capture, item_value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":  # .item(): a host sync on a GPU
            self.capture.host_syncs += 1
            return self.item_value(args[0])
        if name == "equal":  # Liger's backward skips its scaling when the upstream grad is 1
            self.capture.host_syncs += 1
            return True
        if func == torch.ops.aten.addmm.dtype_out:
            # torch 2.11's fake addmm(out_dtype=...) fails in its decomposition: the shapes
            # checked by a fake mm instead (not recorded: this mode is off inside its dispatch)
            out = kwargs["out"]
            if torch.mm(args[1], args[2], out_dtype=args[3]).shape != out.shape:
                raise RuntimeError(f"addmm: out {tuple(out.shape)} does not fit the product")
        else:
            out = func(*args, **kwargs)
        outputs = _specs(out)
        if outputs and not (func.is_view or name in _NO_KERNEL):
            self.capture.events.append(TorchOp(
                name, _specs(list(args)), outputs,
                {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)},
                self.capture.phase))
        return out


class _Stream:
    def wait_event(self, event):
        pass


class _Event:
    def record(self, stream=None):
        pass


@contextlib.contextmanager
def capturing(item_value=lambda t: 1):
    """``with capturing() as cap:`` run an op on tensors made inside the block on ``"cuda"``;
    ``cap.events`` then holds its launches. ``item_value(t)``: what ``t.item()`` returns."""
    import triton.runtime.jit as jit

    from megatron_vocabstats.ops import workspace
    from megatron_vocabstats.ops.engine import wgrad

    cap = Capture()

    def run(self, *args, grid, warmup, **kwargs):
        cap.events.append(TritonLaunch(self, tuple(grid), tuple(_spec_args(args)),
                                       {k: _spec_arg(v) for k, v in kwargs.items()}, cap.phase))

    saved = (jit.JITFunction.run, torch.cuda.current_stream, torch.cuda.Event,
             torch.cuda.get_device_capability, dict(wgrad._WGRAD_MODES))
    # The workspace cache (a process-wide object) holds the capture's fake buffers only while
    # it runs: its real free buffers are set aside and given back untouched afterwards.
    saved_free, saved_release = workspace.WORKSPACE._free, workspace._release
    workspace.WORKSPACE._free, workspace._release = [], (lambda entry: None)
    jit.JITFunction.run = run
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.Event = _Event
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    wgrad._WGRAD_MODES["cuda"] = "addmm"
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), _Recorder(cap, item_value):
            yield cap
    finally:
        (jit.JITFunction.run, torch.cuda.current_stream, torch.cuda.Event,
         torch.cuda.get_device_capability) = saved[:4]
        wgrad._WGRAD_MODES.clear()
        wgrad._WGRAD_MODES.update(saved[4])
        workspace.WORKSPACE._free, workspace._release = saved_free, saved_release


def _spec_arg(v):
    return TensorSpec.of(v) if isinstance(v, torch.Tensor) else v


def _spec_args(args):
    return [_spec_arg(v) for v in args]


def backward(output: torch.Tensor, *grads) -> tuple:
    """The gradients of a custom autograd Function's inputs from ``output``'s ``grad_fn``: its
    ``backward`` called directly (the autograd engine needs a real device for CUDA tensors),
    with ``grads`` the upstream gradients of its leading outputs (None for none; outputs past
    them, e.g. the fused op's argmax, get None)."""
    params = inspect.signature(output.grad_fn._forward_cls.backward).parameters.values()
    if all(p.kind is not p.VAR_POSITIONAL for p in params):
        grads = (*grads, *[None] * (len(params) - 1 - len(grads)))
    with torch.no_grad():
        return output.grad_fn.apply(*grads)


def specialisation(launch: TritonLaunch, target=SM90):
    """``(signature, constexprs, attrs, options)`` that ``JITFunction.run`` compiles for
    ``launch`` on ``target`` (``(backend, arch, warp size)``): Triton's own binder on the
    recorded arguments."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(GPUTarget(*target))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)  # as JITFunction.run completes them
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec,
                                                              options)
    return signature, constexprs, attrs, options


def specialisation_key(launch: TritonLaunch, target=SM90) -> str:
    """A string naming the compiled variant of ``launch`` (equal keys: one binary)."""
    signature, constexprs, attrs, options = specialisation(launch, target)
    consts = sorted((str(k), repr(v)) for k, v in constexprs.items())
    return repr((launch.name, sorted(signature.items()), consts,
                 sorted((str(k), repr(v)) for k, v in attrs.items()),
                 options.num_warps, options.num_stages))


def compile_launch(launch: TritonLaunch, target=SM90):
    """The ``CompiledKernel`` a GPU run of ``launch`` would build (cubin, PTX, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = specialisation(launch, target)
    src = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget(*target), options=options.__dict__)
