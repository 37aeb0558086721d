"""``import megatron_vocabstats.integrations.verl``: verl's Megatron engine computes its log-probs
and entropy with the ops.

Importing this module calls :func:`apply`, which replaces, in verl's own modules, every binding
its Megatron engine reads of

- ``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy`` and
  ``vocab_parallel_entropy_with_chunking`` (defined in ``verl.utils.megatron.tensor_parallel``,
  imported by ``verl.workers.engine.megatron.transformer_impl``: the unfused path,
  ``use_fused_kernels=False``), and
- ``linear_cross_entropy`` (``verl.utils.kernel.linear_cross_entropy``, imported by
  ``verl.models.mcore.model_forward_fused`` and ``model_forward_1f1b_overlap``: the fused path,
  ``use_fused_kernels=True``; verl's FSDP models import it from its module at call time, so
  they get it too)

with the functions of :mod:`.verl_ops` (verl's signatures and conventions; the differences are
logged once). Every replacement carries the marker of ``megatron._patching`` and ``__wrapped__``
(verl's original): applying twice patches once, :func:`remove` restores every original, and a
failure patches nothing (every target is resolved and checked first). In a Ray job every worker
process must import it: ``VERL_USE_EXTERNAL_MODULES=megatron_vocabstats.integrations.verl``
makes each process that imports verl do so (docs/verl.md).

Raises :class:`UnsupportedVerlError` (an ``ImportError``) when verl is missing, or a module, a
name or a signature above moved or changed (a release other than the one this was written
for, verl 0.9; tested with 0.9.1); then nothing is patched.

May import: :mod:`.verl_ops`, the package's ``VERL_PATCHER``, ``megatron._patching`` and
``megatron.settings``, ``versions``, torch, packaging, the standard library and, inside
:func:`apply`, verl.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging

import torch
from packaging.version import InvalidVersion, Version

from .. import versions
from ..megatron._patching import Patcher, describe
from ..megatron.settings import PluginSettings
from . import VERL_PATCHER, verl_ops

logger = logging.getLogger("megatron_vocabstats")

__all__ = ["UnsupportedVerlError", "apply", "remove", "is_applied", "patched_names",
           "DEFINITIONS", "CONSUMERS", "TESTED"]

# The verl releases whose names and conventions verl_ops was written against (major.minor).
TESTED = ("0.9",)

# Where verl defines each replaced function, and the replacement (whose parameter names must be
# verl's: the signature check).
DEFINITIONS = {
    "verl.utils.megatron.tensor_parallel": {
        "vocab_parallel_log_probs_from_logits": verl_ops.log_probs_from_logits,
        "vocab_parallel_entropy": verl_ops.entropy,
        "vocab_parallel_entropy_with_chunking": verl_ops.entropy_with_chunking,
    },
    "verl.utils.kernel.linear_cross_entropy": {
        "linear_cross_entropy": verl_ops.linear_cross_entropy,
    },
}
# The modules of verl's Megatron engine that bind those names at import (``from ... import``):
# their bindings are replaced too.
CONSUMERS = {
    "verl.workers.engine.megatron.transformer_impl": (
        "vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
        "vocab_parallel_entropy_with_chunking"),
    "verl.models.mcore.model_forward_fused": ("linear_cross_entropy",),
    "verl.models.mcore.model_forward_1f1b_overlap": ("linear_cross_entropy",),
}


class UnsupportedVerlError(ImportError):
    """verl is missing, or its modules, names or signatures are not the ones this integration
    replaces; nothing was patched."""


def verl_version() -> str | None:
    """The installed verl's version (its distribution metadata), None if it is not installed."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def _fail(version, problem: str) -> UnsupportedVerlError:
    return UnsupportedVerlError(
        f"megatron-vocabstats' verl integration: verl {version}: {problem}. It replaces the "
        f"names of verl {' and '.join(TESTED)} (tested with verl 0.9.1); nothing was patched")


def _import(name: str, version):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _fail(version, f"cannot import {name} ({type(exc).__name__}: {exc})") from exc


def _parameters(fn) -> tuple[str, ...] | None:
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


def _targets() -> list[tuple[object, str, object]]:
    """``(module, name, factory)`` of every binding to replace, all resolved and checked before
    anything is patched; raises :class:`UnsupportedVerlError`."""
    version = verl_version()
    if version is None:
        raise UnsupportedVerlError("megatron-vocabstats' verl integration needs verl (pip install "
                                   "'verl==0.9.*'); it is not installed")
    targets, originals = [], {}
    for module_name, names in DEFINITIONS.items():
        module = _import(module_name, version)
        for name, fn in names.items():
            if not hasattr(module, name):
                raise _fail(version, f"{module_name} has no {name}")
            original = _original(getattr(module, name))
            want, have = _parameters(fn), _parameters(original)
            if have != want:
                raise _fail(version, f"{module_name}.{name} takes {have}, not {want}")
            originals[name] = (f"{module_name}.{name}", original, fn)
            targets.append((module, name, _binding(fn)))
    for module_name, names in CONSUMERS.items():
        module = _import(module_name, version)
        for name in names:
            where, original, fn = originals[name]
            if not hasattr(module, name):
                raise _fail(version, f"{module_name} has no {name}")
            if _original(getattr(module, name)) is not original:
                raise _fail(version, f"{module_name}.{name} is not {where} (found "
                                     f"{getattr(module, name)!r})")
            targets.append((module, name, _binding(fn)))
    if _minor(version) not in TESTED:
        logger.warning("megatron-vocabstats (verl): verl %s is not a release this integration "
                       "was tested with (%s); its names and signatures match", version,
                       ", ".join(TESTED))
    return targets


def _minor(version: str) -> str:
    try:
        return ".".join(map(str, Version(version).release[:2]))
    except InvalidVersion:
        return version


def apply(**options) -> PluginSettings:
    """Replace verl's log-prob and entropy functions (module docstring) with the ops.

    ``options`` (:data:`.verl_ops.OPTIONS`, fields of ``PluginSettings`` with their meaning):
    ``vocab_size`` (the real V: padding columns get zero probability; default None, verl's
    W·tp columns), ``logprobs_chunk_size`` (tokens per fp32 chunk of the unfused op, None =
    auto), ``lm_head_chunk_size`` (tokens per chunk of the fused head, 0 = auto),
    ``validate`` (the ops' host-side checks, default True), ``batch_invariant`` and ``kernel``.
    Idempotent: what is patched stays; the given options replace the current ones. Returns the
    options in force.

    Raises:
        UnsupportedVerlError: verl missing or its names moved (nothing is patched then).
        ValueError, TypeError: an unknown or invalid option (nothing is patched then).
    """
    settings = verl_ops.configured(**options)
    targets = _targets()
    verl_ops.configure(settings)
    patched = []
    try:
        for module, name, factory in targets:
            if VERL_PATCHER.replace(module, name, factory):
                patched.append(describe(module, name))
    except BaseException:
        remove()
        raise
    if patched and verl_ops.rank0():
        # verl's environments pin their own torch (verl[vllm] 0.9.1: torch 2.11): say so where
        # verl's root logger (WARNING) shows it, as the Megatron patch's first-loss line does.
        untested = versions.check_version("torch", torch.__version__)
        logger.log(logging.WARNING if untested else logging.INFO,
                   "megatron-vocabstats: patched %s for verl %s%s", ", ".join(patched),
                   verl_version(), f"; untested: {untested}" if untested else "")
    return settings


def remove() -> list[str]:
    """Restore every original verl binding; returns the names restored."""
    restored = VERL_PATCHER.remove_all()
    verl_ops.reset()
    if restored and verl_ops.rank0():
        logger.info("megatron-vocabstats: restored %s", ", ".join(restored))
    return restored


def is_applied() -> bool:
    """True while any verl binding is replaced."""
    return bool(VERL_PATCHER.applied)


def patched_names() -> list[str]:
    """``module.name`` of every verl binding currently replaced."""
    return VERL_PATCHER.names()


apply()
