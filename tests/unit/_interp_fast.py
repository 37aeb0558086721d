"""Two shortcuts in Triton's CPU interpreter for the interpreter runs of the kernels
(``_triton_interp.py``, ``_triton_fused_interp.py``, ``dist/triton_cases.py``); same results,
a fraction of the time. Both replace Python-level bookkeeping of ``triton.runtime.interpreter``
(the same code in Triton 3.6 to 3.9), never what a kernel computes; :func:`install` leaves an
interpreter without the expected functions as it is.

* ``tl.reduce`` with a custom combine function (the kernels' NaN-propagating maximum,
  ``triton_tiles.amax_nan``): ``ReduceOps.generic_reduce`` calls the combine function once per
  element, on scalars. :func:`_fold` takes the same left fold along the reduced axis for all the
  outputs at once: ``acc = x[..., 0]``, then ``acc = combine(acc, x[..., k])`` for k = 1, 2, ...,
  so the combine function sees the same operands in the same order for every output element,
  and one that works elementwise (as a Triton combine function does) gives the same bits. A
  combine function whose result has another shape falls back to the interpreter's loop.
* Every call of a ``@triton.jit`` device function re-patches ``triton.language`` for the
  interpreter (``_patch_lang``: ``inspect.getmembers`` of four modules), although the launch
  already patched those modules and undoes the patches only when it ends. Within a launch, a
  device function whose ``triton.language`` modules the launch patched skips it.
"""

from __future__ import annotations

import inspect

import numpy as np


def _fold(self, input):
    """``generic_reduce`` as a vectorised left fold (see the module's docstring), or None when
    the combine function is not elementwise."""
    import triton.language as tl

    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    data = [arg.handle.data for arg in input]
    shape = data[0].shape
    out_shape = shape[:axis] + shape[axis + 1:]
    dtypes = [d.dtype for d in data]
    acc = [np.zeros(out_shape, dtype=dt) for dt in dtypes]
    if shape[axis]:
        acc = [np.take(d, 0, axis=axis).astype(dt) for d, dt in zip(data, dtypes)]
    for k in range(1, shape[axis]):
        left = tuple(self.to_tensor(a, arg.dtype) for a, arg in zip(acc, input))
        right = tuple(self.to_tensor(np.take(d, k, axis=axis), arg.dtype)
                      for d, arg in zip(data, input))
        ret = self.combine_fn.fn(*left, *right)
        acc = []
        for r, dt in zip(ret if isinstance(ret, tuple) else (ret,), dtypes):
            value = np.asarray(r.handle.data if isinstance(r, tl.core.tensor) else r)
            if value.shape != out_shape:
                if value.size != 1 or out_shape != ():
                    return None
                value = value.reshape(())
            acc.append(value.astype(dt))
    out = []
    for a, arg in zip(acc, input):
        if self.keep_dims:
            if original_axis is not None:
                a = np.expand_dims(a, axis)
            else:
                for _ in range(len(shape)):
                    a = np.expand_dims(a, 0)
        elif original_axis is None:
            a = a.item()
        out.append(self.to_tensor(a, arg.dtype))
    return out


class _Launch:
    """The ``triton.language`` modules the running launch has patched (None: no launch)."""

    patched: set | None = None


class _NoScope:
    def restore(self) -> None:
        pass


def install() -> None:
    """Install both shortcuts (idempotent; each only where the interpreter has the functions it
    replaces)."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_vocabstats_fast", False):
        return
    interpreter._vocabstats_fast = True
    ops = interpreter.ReduceOps
    if callable(getattr(ops, "generic_reduce", None)) and hasattr(ops, "unravel"):
        original_reduce = ops.generic_reduce

        def generic_reduce(self, input):
            out = _fold(self, input)
            return original_reduce(self, input) if out is None else out

        ops.generic_reduce = generic_reduce

    executor = getattr(interpreter, "GridExecutor", None)
    original_patch = getattr(interpreter, "_patch_lang", None)
    if executor is None or not callable(original_patch):
        return
    lang = (interpreter.tl, interpreter.tl.core)
    original_call = executor.__call__

    def _patch_lang(fn):
        mods = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang}
        patched = _Launch.patched
        if patched is not None and mods and mods <= patched:
            return _NoScope()
        scope = original_patch(fn)
        if patched is not None:
            patched.update(mods)
        return scope

    def call(self, *args, **kwargs):
        _Launch.patched = set()
        try:
            return original_call(self, *args, **kwargs)
        finally:
            _Launch.patched = None

    interpreter._patch_lang = _patch_lang
    executor.__call__ = call
