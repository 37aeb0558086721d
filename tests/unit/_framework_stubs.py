"""Test support: a framework's real modules from its installed wheel (verl, AReaL, SkyRL,
Megatron-Bridge, whose package ``megatron.bridge`` shares the ``megatron`` namespace with
megatron-core), without the framework's heavy dependencies (ray, vllm, transformers, ...).

The tests install each framework with ``pip install --no-deps`` (``requirements/*-nodeps.txt``,
see ``scripts/_env.sh``). Its package ``__init__`` files import much of the framework and all of
those dependencies, so :func:`load` imports only the modules an integration patches or a test
calls (:data:`REAL`), executing their real code from the wheel, and answers every other import
they make with a stub:

- every other module of the framework's package (its ``__init__`` included) is a
  :class:`StubModule` whose ``__path__`` is the real directory, so that the real submodules are
  found there;
- a third-party module that the framework's code imports and no installed package provides is a
  :class:`StubModule` too, and so is another framework of :data:`REAL` that it imports (installed
  with ``--no-deps``, it cannot import itself); only while loading: these stubs leave
  ``sys.modules`` afterwards.
  Imports by other code (torch's optional imports, say) fail as usual.

A stub module's attributes are stub classes: they can be subclassed, called, used as decorators
(``@EngineRegistry.register(...)`` returns the class unchanged) and in annotations, which is all
that the real modules do with them at import. The functions under test touch only real code:
torch, megatron-core and the framework modules in :data:`REAL`.
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

# Per top-level package: the modules its integration patches (and the tests call), loaded from
# the wheel; and how to install the wheel.
REAL = {
    "verl": (
        "verl.utils.megatron.tensor_parallel",
        "verl.utils.kernel.linear_cross_entropy",
        "verl.workers.engine.megatron.transformer_impl",
        "verl.models.mcore.model_forward_fused",
        "verl.models.mcore.model_forward_1f1b_overlap",
    ),
    "areal": (
        "areal.utils.functional.vocab_parallel",
        "areal.utils.functional",
        "areal.models.tree_attn.functional",
        "areal.engine.megatron_engine",
        "areal.engine.fsdp_engine",
        "areal.experimental.engine.archon_engine",
    ),
    "skyrl": (
        "skyrl.backends.skyrl_train.distributed.megatron.model_utils",
        "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper",
    ),
    # A sub-package of the ``megatron`` namespace that megatron-core shares: only its own
    # modules are stubbed, megatron.core stays real.
    "megatron.bridge": (
        "megatron.bridge.training.losses",
        "megatron.bridge.training.utils.packed_seq_utils",
        "megatron.bridge.training.utils.pg_utils",
        "megatron.bridge.training.gpt_step",
    ),
}
INSTALL = {
    "verl": "pip install --no-deps 'verl==0.9.*'",
    "areal": "pip install --no-deps 'areal==1.0.4'",
    "skyrl": "pip install --no-deps 'skyrl==0.3.0'",
    "megatron.bridge": "pip install --no-deps 'megatron-bridge==0.3.1'",
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def root(package: str) -> str | None:
    """The installed package's directory (without importing it), None if not installed."""
    spec = importlib.util.find_spec(package) if package not in sys.modules else None
    if spec is None:
        module = sys.modules.get(package)
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
    """``own``: stub every module of ``package`` (a dotted name may be a sub-package of a
    namespace package, as ``megatron.bridge``: its siblings stay real) but its :data:`REAL` ones
    (first on ``sys.meta_path``); otherwise stub what no other finder found for the package's
    code (last on it)."""

    def __init__(self, package: str, root: str, own: bool):
        self.package, self.root, self.own = package, root, own
        self.made: list[str] = []
        self.foreign: list[str] = []

    def _foreign(self, fullname) -> bool:
        """Another framework of :data:`REAL` (installed ``--no-deps`` for its own tests, so its
        ``__init__`` imports fail), imported by this package's code and not imported yet:
        AReaL's engine imports ``megatron.bridge``."""
        return (fullname not in sys.modules
                and any(_within(fullname, other) for other in REAL if other != self.package)
                and self._imported_by_package())

    def find_spec(self, fullname, path=None, target=None):
        is_own = _within(fullname, self.package)
        if self.own and not is_own and self._foreign(fullname):
            self.foreign.append(fullname)
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if is_own != self.own or fullname in REAL[self.package]:
            return None
        if not self.own and not self._imported_by_package():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def _imported_by_package(self) -> bool:
        """Whether the innermost frame outside the import machinery is the package's code."""
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
        # the package's own directory, then the parts of the name below the package
        inner = spec.name.split(".")[len(self.package.split(".")):]
        directory = os.path.join(self.root, *inner)
        own_dir = self.own and spec.name not in self.foreign and os.path.isdir(directory)
        module.__path__ = [directory] if own_dir else []
        self.made.append(spec.name)
        return module

    def exec_module(self, module):
        pass


def load(package: str) -> dict[str, types.ModuleType]:
    """Import the package's :data:`REAL` modules from the installed wheel (idempotent);
    ``{name: module}``. Raises ``ImportError`` if the package is not installed."""
    where = root(package)
    if where is None:
        raise ImportError(f"{package} is not installed ({INSTALL[package]})")
    own, missing = _Stubs(package, where, own=True), _Stubs(package, where, own=False)
    sys.meta_path.insert(0, own)
    sys.meta_path.append(missing)
    try:
        modules = {name: importlib.import_module(name) for name in REAL[package]}
    finally:
        sys.meta_path.remove(own)
        sys.meta_path.remove(missing)
        for name in missing.made + own.foreign:
            sys.modules.pop(name, None)
    return modules


def unload(package: str) -> None:
    """Drop every module of the package from ``sys.modules`` (the next :func:`load` starts
    afresh)."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def eager():
    """Frameworks wrap some products in ``torch.compile`` (verl's ``vocab_parallel_entropy``):
    run them eagerly (the same arithmetic, without compiling on a CPU test machine)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def applied(package: str, integration: str, requirements: str):
    """A pytest fixture's body: the package's :data:`REAL` modules and the integration module
    ``integration``, imported (which applies it); ``(modules, integration module)``, removed and
    unloaded afterwards. Skips without megatron-core or the package (``requirements``: the file
    that pins it)."""
    import pytest

    pytest.importorskip("megatron.core")
    if root(package) is None:
        pytest.skip(f"{package} is not installed ({requirements})")
    modules = load(package)
    module = importlib.import_module(integration)
    module.apply()
    try:
        yield modules, module
    finally:
        module.remove()
        unload(package)


def bindings(integration) -> list[tuple[str, str]]:
    """``(module name, attribute)`` of every binding an integration module replaces."""
    return [(module, name) for table in (integration.DEFINITIONS, integration.CONSUMERS)
            for module, names in table.items() for name in names]
