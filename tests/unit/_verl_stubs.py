"""Test support: verl's real modules from the installed verl wheel, without verl's heavy
dependencies (ray, vllm, transformers, tensordict, omegaconf, ...).

The tests install verl with ``pip install --no-deps`` (``requirements/py312-nodeps.txt``, see
``scripts/_env.sh``). Its package ``__init__`` files import half of verl and all of those
dependencies, so :func:`load_verl` imports only the modules the integration patches
(:data:`REAL`), executing their real code from the wheel, and answers every other import they
make with a stub:

- every other ``verl.*`` module (its package ``__init__`` included) is a :class:`StubModule`
  whose ``__path__`` is the real directory, so that the real submodules are found there;
- a third-party module that verl's code imports and no installed package provides is a
  :class:`StubModule` too (only while loading; these stubs leave ``sys.modules`` afterwards).
  Imports by other code (torch's optional imports, say) fail as usual.

A stub module's attributes are stub classes: they can be subclassed, called, used as decorators
(``@EngineRegistry.register(...)`` returns the class unchanged) and in annotations, which is all
that the real modules do with them at import. The functions under test touch only real code:
torch, megatron-core and the verl modules in :data:`REAL`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

# The verl modules the integration patches (and the tests call), loaded from the wheel.
REAL = (
    "verl.utils.megatron.tensor_parallel",
    "verl.utils.kernel.linear_cross_entropy",
    "verl.workers.engine.megatron.transformer_impl",
    "verl.models.mcore.model_forward_fused",
    "verl.models.mcore.model_forward_1f1b_overlap",
)


def verl_root() -> str | None:
    """The installed verl package's directory (without importing it), None if not installed."""
    spec = importlib.util.find_spec("verl") if "verl" not in sys.modules else None
    if spec is None:
        module = sys.modules.get("verl")
        paths = getattr(module, "__path__", None)
        return list(paths)[0] if paths else None
    return list(spec.submodule_search_locations)[0]


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return stub_class(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return super().__call__(*args, **kwargs)


class StubObject(metaclass=_StubMeta):
    """Instances keep their keyword arguments as attributes; calling one returns itself (or,
    as a decorator, the decorated object)."""

    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return StubObject()


def stub_class(name: str) -> type:
    return _StubMeta(name, (StubObject,), {})


class StubModule(types.ModuleType):
    """A module whose every missing attribute is a stub class of that name."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = stub_class(name)
        setattr(self, name, value)
        return value


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``verl``: stub every module but :data:`REAL` (first on ``sys.meta_path``); otherwise
    stub what no other finder found (last on it)."""

    def __init__(self, root: str, verl: bool):
        self.root, self.verl = root, verl
        self.made: list[str] = []

    def find_spec(self, fullname, path=None, target=None):
        is_verl = fullname.split(".")[0] == "verl"
        if is_verl != self.verl or fullname in REAL:
            return None
        if not self.verl and not self._imported_by_verl():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def _imported_by_verl(self) -> bool:
        """Whether the innermost frame outside the import machinery is verl's code."""
        frame = sys._getframe(1)
        machinery = os.path.dirname(importlib.__file__)
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith("<frozen") or name.startswith(machinery)
                    or name == __file__):
                return name.startswith(self.root)
            frame = frame.f_back
        return False

    def create_module(self, spec):
        module = StubModule(spec.name)
        directory = os.path.join(os.path.dirname(self.root), *spec.name.split("."))
        module.__path__ = [directory] if self.verl and os.path.isdir(directory) else []
        self.made.append(spec.name)
        return module

    def exec_module(self, module):
        pass


def load_verl() -> dict[str, types.ModuleType]:
    """Import the :data:`REAL` modules from the installed wheel (idempotent); ``{name: module}``.
    Raises ``ImportError`` if verl is not installed."""
    root = verl_root()
    if root is None:
        raise ImportError("verl is not installed (pip install --no-deps 'verl==0.9.*')")
    verl_stubs, missing = _Stubs(root, verl=True), _Stubs(root, verl=False)
    sys.meta_path.insert(0, verl_stubs)
    sys.meta_path.append(missing)
    try:
        modules = {name: importlib.import_module(name) for name in REAL}
    finally:
        sys.meta_path.remove(verl_stubs)
        sys.meta_path.remove(missing)
        for name in missing.made:
            sys.modules.pop(name, None)
    return modules


def unload_verl() -> None:
    """Drop every verl module from ``sys.modules`` (the next :func:`load_verl` starts afresh)."""
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]


@contextlib.contextmanager
def eager():
    """verl's ``vocab_parallel_entropy`` wraps a product in ``torch.compile``: run it eagerly
    (the same arithmetic, without compiling on a CPU test machine)."""
    with torch._dynamo.config.patch(disable=True):
        yield
