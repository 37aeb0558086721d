"""The version warning: once per process, one warning per component outside its tested range.

:func:`warn_untested` compares what this process runs (Python, torch, Triton, megatron-core)
with the supported-versions table (:mod:`megatron_vocabstats.versions`) and issues one
:class:`UntestedVersionWarning` per component outside its range, naming the component, the
version found and the tested range, e.g.::

    UntestedVersionWarning: torch 2.16.0 is outside the supported range torch >=2.11,<2.16
    (tested: 2.11.0, 2.14.1, 2.15.0); megatron-vocabstats runs, untested

The plugin still runs. It is called at the first op call of the process (every op's input
check, :class:`megatron_vocabstats.ops.agreement.CrossRankCheck`; not at import, and never while
a tracer runs the call) and at the Megatron patch's first loss (which also checks the
megatron-core that Python imports). Each component is checked once per process, on global rank
0 only (``RANK`` before ``torch.distributed`` is initialised): no warning per call, per step or
per rank. After the first call the cost is one set-size comparison.

Why :func:`warnings.warn` rather than the ``megatron_vocabstats`` logger: the situation is one
the user can remove (by installing a tested version), which is what Python's warnings are for;
they are shown without any logging set-up, pytest lists them, and a category can be silenced
(``-W ignore::megatron_vocabstats.version_check.UntestedVersionWarning``) or made an error in CI
(``-W error::...``) without touching the plugin's log records.

Also the package's one rank-0 test, :func:`is_rank0` (the version warning, the Megatron patch's
log lines, the integrations' notes and the profiling command line's errors all use it): the
lowest module that every one of them may import.
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
    """``"0.19.2"`` (a pre-release tag appended, ``"0.20.0rc0"``) from a
    ``megatron.core.package_info`` module's ``VERSION`` tuple; None for a module (or None)
    without one."""
    version = getattr(info, "VERSION", None)
    if isinstance(version, tuple) and len(version) >= 3:
        return ".".join(str(part) for part in version[:3]) + "".join(map(str, version[3:]))
    return None


def _imported_megatron_core() -> str | None:
    """The release of an already imported megatron-core, else None: an op call never imports
    Megatron."""
    return package_info_release(sys.modules.get("megatron.core.package_info"))


def found_versions(*, megatron_core: str | None = None) -> dict[str, str]:
    """``{component: version}`` of what this process runs; a component absent (Triton not
    installed, megatron-core neither given nor imported) is left out. ``megatron_core``: the
    release of the imported megatron-core, when the caller knows it."""
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
    """Whether this process is global rank 0, the one that logs and warns: torch.distributed's
    rank once a process group is initialised, else ``RANK`` (as torchrun and Ray workers set it;
    unset, as in a single process, or not an integer: rank 0). Imports nothing (torch only if
    already imported)."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    try:
        return int(os.environ.get("RANK", "0")) == 0
    except ValueError:
        return True


def warn_untested(*, megatron_core: str | None = None, stacklevel: int = 2) -> list[str]:
    """Warn once per process about each component not yet checked that lies outside its range;
    returns the messages warned now (on ranks other than 0: none, the components are marked
    checked). ``megatron_core``: as in :func:`found_versions`."""
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
    """The ops' check, once per process (:class:`~megatron_vocabstats.ops.agreement.CrossRankCheck`
    calls it while :data:`op_checked` is False, never under a tracer)."""
    global op_checked
    op_checked = True
    warn_untested(stacklevel=4)


def reset() -> None:
    """Forget what was checked (tests): the next call checks every component again."""
    global op_checked
    op_checked = False
    _checked.clear()
