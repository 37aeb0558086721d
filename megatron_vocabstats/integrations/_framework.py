"""Rebinding a framework's own functions to the ops (:class:`Framework`): resolve and
signature-check every binding, then replace all of them or none; restore on request.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from packaging.version import InvalidVersion, Version

from .. import versions
from ..megatron._patching import Patcher, describe
from ..version_check import is_rank0
from . import PATCHERS

logger = logging.getLogger("megatron_vocabstats")


class UnsupportedFrameworkError(ImportError):
    """The framework is missing, or its modules, names or signatures are not the ones the
    integration replaces; nothing was patched."""


def parameters(fn) -> tuple[str, ...] | None:
    """Parameter names of ``fn``; for an autograd Function's ``apply``, those of its
    ``forward`` after ``ctx``. None if they cannot be read."""
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        fn = owner.forward
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if owner is not None and names[:1] == ("ctx",) else names


def _original(obj):
    return obj.__wrapped__ if Patcher.is_ours(obj) else obj


def _binding(fn):
    """The patcher's replacement factory: a fresh function per binding that calls ``fn``."""
    def make(_original_fn):
        @functools.wraps(fn)
        def replacement(*args, **kwargs):
            return fn(*args, **kwargs)
        return replacement
    return make


def _minor(version: str) -> str:
    try:
        return ".".join(map(str, Version(version).release[:2]))
    except InvalidVersion:
        return version


@dataclass
class Framework:
    """One framework's bindings and how to replace them, the mechanism every integration shares
    (docs/integrations.md). ``distribution``: its pip name (None: ``version_of()`` reads the
    version); ``tested``: the major.minor releases written against (another whose names and
    signatures match is patched with a WARNING); ``definitions``: ``{module: {name:
    replacement}}`` where the framework defines each function, the replacement taking its
    parameter names; ``consumers``: ``{module: names}`` binding a defined name at import;
    ``optional``: consumers skipped (logged) when a third-party module they import is missing."""

    name: str
    distribution: str | None
    install_hint: str
    tested: tuple[str, ...]
    definitions: Mapping[str, Mapping[str, Callable]]
    consumers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    optional: tuple[str, ...] = ()
    version_of: Callable[[], str | None] | None = None
    error: type[UnsupportedFrameworkError] = UnsupportedFrameworkError
    options: object = None

    @property
    def patcher(self) -> Patcher:
        # Kept in the package's __init__, so that reloading an integration module cannot forget
        # what it replaced.
        return PATCHERS.setdefault(self.name, Patcher())

    def version(self) -> str | None:
        """The installed framework's version, None if it is not installed."""
        if self.version_of is not None:
            return self.version_of()
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def _fail(self, version, problem: str) -> UnsupportedFrameworkError:
        return self.error(
            f"megatron-vocabstats' {self.name} integration: {self.name} {version}: {problem}. It "
            f"replaces the names of {self.name} {' and '.join(self.tested)}; nothing was patched")

    def _import(self, module_name: str, version):
        try:
            return importlib.import_module(module_name)
        except ImportError as exc:
            raise self._fail(version, f"cannot import {module_name} "
                                      f"({type(exc).__name__}: {exc})") from exc

    def _import_consumer(self, module_name: str, version):
        """The module, or None for an optional one missing a third-party module (logged)."""
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if module_name not in self.optional or missing in ("", module_name.split(".")[0]):
                raise self._fail(version, f"cannot import {module_name} "
                                          f"({type(exc).__name__}: {exc})") from exc
            logger.info("megatron-vocabstats (%s): %s not patched: it needs %s, which is not "
                        "installed", self.name, module_name, exc.name)
            return None
        except ImportError as exc:
            raise self._fail(version, f"cannot import {module_name} "
                                      f"({type(exc).__name__}: {exc})") from exc

    def targets(self) -> list[tuple[object, str, object]]:
        """``(module, name, factory)`` of every binding to replace, resolved and checked."""
        version = self.version()
        if version is None:
            raise self.error(
                f"megatron-vocabstats' {self.name} integration needs {self.name} "
                f"({self.install_hint}); it is not installed")
        targets, originals = [], {}
        for module_name, names in self.definitions.items():
            module = self._import(module_name, version)
            for name, fn in names.items():
                if not hasattr(module, name):
                    raise self._fail(version, f"{module_name} has no {name}")
                original = _original(getattr(module, name))
                want, have = parameters(fn), parameters(original)
                if have != want:
                    raise self._fail(version, f"{module_name}.{name} takes {have}, not {want}")
                originals[name] = (f"{module_name}.{name}", original, fn)
                targets.append((module, name, _binding(fn)))
        for module_name, names in self.consumers.items():
            module = self._import_consumer(module_name, version)
            if module is None:
                continue
            for name in names:
                where, original, fn = originals[name]
                if not hasattr(module, name):
                    raise self._fail(version, f"{module_name} has no {name}")
                if _original(getattr(module, name)) is not original:
                    raise self._fail(version, f"{module_name}.{name} is not {where} (found "
                                              f"{getattr(module, name)!r})")
                targets.append((module, name, _binding(fn)))
        if _minor(version) not in self.tested:
            logger.warning("megatron-vocabstats (%s): %s %s is not a release this integration "
                           "was tested with (%s); its names and signatures match", self.name,
                           self.name, version, ", ".join(self.tested))
        return targets

    def apply(self, options: Mapping[str, object], before: Callable[[], None] | None = None):
        """Check ``options``, then replace every binding or none; returns the ``PluginSettings``
        now in force. Idempotent: a second call only replaces the options. ``before()`` runs
        after the checks, before any patch. Raises ``ValueError`` / ``TypeError`` (a bad option)
        or :attr:`error` (missing framework, moved binding), nothing patched then."""
        settings = self.options.configured(**options)
        targets = self.targets()
        if before is not None:
            before()
        self.options.configure(settings)
        patched = []
        try:
            for module, name, factory in targets:
                if self.patcher.replace(module, name, factory):
                    patched.append(describe(module, name))
        except BaseException:
            self.patcher.remove_all()
            raise
        if patched and is_rank0():
            untested = versions.check_version("torch", torch.__version__)
            logger.log(logging.WARNING if untested else logging.INFO,
                       "megatron-vocabstats: patched %s for %s %s%s", ", ".join(patched),
                       self.name, self.version(), f"; untested: {untested}" if untested else "")
        return settings

    def remove(self) -> list[str]:
        """Restore every original binding and the default options; returns the names restored."""
        restored = self.patcher.remove_all()
        if self.options is not None:
            self.options.reset()
        if restored and is_rank0():
            logger.info("megatron-vocabstats: restored %s", ", ".join(restored))
        return restored

    def original(self, module_name: str, name: str) -> Callable:
        """The framework's own ``module_name.name`` (unwrapped if replaced); imports the module."""
        return _original(getattr(importlib.import_module(module_name), name))

    def is_applied(self) -> bool:
        """True while any binding is replaced."""
        return bool(self.patcher.applied)

    def patched_names(self) -> list[str]:
        """``module.name`` of every binding currently replaced."""
        return self.patcher.names()
