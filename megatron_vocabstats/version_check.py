"""The version warning and the package's rank-0 test (:func:`is_rank0`). :func:`warn_untested`
warns once per component outside its range in :mod:`.versions`, on global rank 0, at the first
op call and at the Megatron patch's first loss (docs/install.md, "Outside the tested ranges").
"""

from __future__ import annotations

import os
import platform
import sys
import warnings

from . import versions

__all__ = ["UntestedVersionWarning", "package_info_release", "found_versions", "untested",
           "warn_untested", "at_first_op", "reset", "is_rank0"]

COMPONENTS = ("Python", "torch", "Triton", "megatron-core")
_checked: set[str] = set()
# Whether an op call has checked already: the ops' one test per call (a module-level bool, which
# a tracer that inlines the test guards on without a graph break).
op_checked = False


class UntestedVersionWarning(UserWarning):
    """A component outside the tested range of the supported-versions table; the plugin runs."""


def _distribution_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def package_info_release(info) -> str | None:
    """``"0.19.2"`` (``"0.20.0rc0"``) from a ``package_info``'s ``VERSION``; None without one."""
    version = getattr(info, "VERSION", None)
    if isinstance(version, tuple) and len(version) >= 3:
        return ".".join(str(part) for part in version[:3]) + "".join(map(str, version[3:]))
    return None


def _imported_megatron_core() -> str | None:
    """The release of an already imported megatron-core, else None (never imports it)."""
    return package_info_release(sys.modules.get("megatron.core.package_info"))


def found_versions(*, megatron_core: str | None = None) -> dict[str, str]:
    """``{component: version}`` of what this process runs, absent components left out."""
    found = {"Python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = str(torch.__version__)
    triton = _distribution_version("triton")
    if triton is not None:
        found["Triton"] = triton
    megatron_core = megatron_core or _imported_megatron_core()
    if megatron_core is not None:
        found["megatron-core"] = megatron_core
    return found


def untested(found: dict[str, str]) -> list[str]:
    """Why each of ``found``'s versions is outside its tested range (empty: all inside)."""
    return [problem for name, version in found.items()
            if (problem := versions.check_version(name, version)) is not None]


def is_rank0() -> bool:
    """Whether this process is global rank 0: torch.distributed's rank once initialised, else
    ``RANK`` (unset or not an integer: rank 0). Imports nothing."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def warn_untested(*, megatron_core: str | None = None, stacklevel: int = 2) -> list[str]:
    """Warn once per process per component outside its range; returns the messages warned now."""
    if len(_checked) == len(COMPONENTS) or (
            _checked and megatron_core is None and "megatron.core.package_info" not in sys.modules):
        return []   # the first call checked all but a megatron-core not imported (yet)
    found = {name: version for name, version in
             found_versions(megatron_core=megatron_core).items() if name not in _checked}
    # Python, torch and Triton (found or not) once; megatron-core once it is imported.
    _checked.update({"Python", "torch", "Triton"} | found.keys())
    if not is_rank0():
        return []
    problems = untested(found)
    for problem in problems:
        warnings.warn(f"{problem}; megatron-vocabstats runs, untested", UntestedVersionWarning,
                      stacklevel=stacklevel + 1)
    return problems


def at_first_op() -> None:
    """The ops' check (``CrossRankCheck`` calls it while :data:`op_checked` is False)."""
    global op_checked
    op_checked = True
    warn_untested(stacklevel=4)


def reset() -> None:
    """Forget what was checked (tests): the next call checks every component again."""
    global op_checked
    op_checked = False
    _checked.clear()
