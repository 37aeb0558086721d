"""The supported versions: one table, the single source of the README, pyproject and messages.

:data:`SUPPORTED` lists, per component, the versions the test suite ran (``tested``), the range
the plugin declares (``specifier``, a PEP 440 specifier that ``pyproject.toml`` repeats: its
``requires-python``, ``dependencies`` or the ``[megatron]`` extra), and how that is known
(``note``). ``tests/unit/test_versions.py`` checks that README's table is :func:`markdown_table`
and that pyproject declares each specifier; :func:`supported_range` words the error messages
(``megatron_vocabstats.megatron.compat.SUPPORTED``) and :func:`check_version` the warnings and the
environment report (``python -m megatron_vocabstats.env``).

Update the table when CI covers another version; nothing else needs editing by hand.

May import: the standard library and ``packaging`` (a declared dependency); nothing of the
package, so that every layer can read it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Component", "SUPPORTED", "component", "supported_range", "check_version",
           "markdown_table"]


@dataclass(frozen=True, slots=True)
class Component:
    """One row of the table.

    ``name``: as the README and the messages write it; ``distribution``: the pip name (None for
    Python and the GPU); ``tested``: the versions CI ran; ``specifier``: the declared range (PEP
    440, None where pip has nothing to check); ``declared_in``: where pyproject declares it;
    ``note``: what the range means and how it is known.
    """

    name: str
    distribution: str | None
    tested: tuple[str, ...]
    specifier: str | None
    declared_in: str | None
    note: str


SUPPORTED: tuple[Component, ...] = (
    Component("Python", None, ("3.11", "3.12"), ">=3.11,<3.13", "requires-python",
              "3.12 with megatron-core 0.19.2, 3.11 with 0.16.1 (`bash scripts/test.sh`)"),
    Component("torch", "torch", ("2.13.0",), ">=2.13,<2.14", "dependencies",
              "CPU (gloo) in CI; the GPU suite (`tests/gpu/run.sh`) has not run yet"),
    Component("megatron-core", "megatron-core", ("0.16.1", "0.19.2"), ">=0.16,<0.20",
              "[megatron] extra",
              "the patch finds Megatron's names by feature, not by version; "
              "`pretrain_gpt.py` patches for 0.16, 0.17, 0.18, 0.19"),
    Component("Triton", "triton", ("3.7.1",), ">=3.7", "[triton] extra",
              "optional, only for `kernel=\"triton\"` (torch's CUDA wheels bring it); tested "
              "under its CPU interpreter and compiled offline for sm_90, not yet run on a GPU"),
    Component("CUDA capability", None, (), ">=8.0", None,
              "for the Triton kernels (Triton's own minimum, Ampere; bf16 `tl.dot`); the torch "
              "path runs on any device torch supports, CPU included"),
)


def component(name: str) -> Component:
    """The row called ``name`` (``"torch"``, ``"megatron-core"``, ...); ``KeyError`` if none."""
    for row in SUPPORTED:
        if row.name == name:
            return row
    raise KeyError(f"no supported-versions row {name!r}; rows: {[r.name for r in SUPPORTED]}")


def supported_range(name: str) -> str:
    """``"megatron-core >=0.16,<0.20 (tested: 0.16.1, 0.19.2)"``: the row in words."""
    row = component(name)
    tested = f" (tested: {', '.join(row.tested)})" if row.tested else ""
    return f"{row.name} {row.specifier}{tested}"


def check_version(name: str, version: str) -> str | None:
    """None if ``version`` lies in the row's range, else why not (for a warning or the report).

    Local version labels (``2.13.0+cu130``) and pre-releases are compared by their release
    number (``2.9.0a0+nv25.09`` counts as 2.9.0). Raises ``KeyError`` for an unknown row.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    row = component(name)
    if row.specifier is None:
        return None
    try:
        release = Version(version).release
    except InvalidVersion:
        return f"{row.name} {version!r} is not a version number; supported: {supported_range(name)}"
    plain = ".".join(str(part) for part in release)
    if plain in SpecifierSet(row.specifier):
        return None
    return f"{row.name} {version} is outside the supported range {supported_range(name)}"


def markdown_table() -> str:
    """The table README.md shows (checked by ``tests/unit/test_versions.py``)."""
    lines = ["| component | supported | tested in CI | declared in pyproject | note |",
             "|---|---|---|---|---|"]
    for row in SUPPORTED:
        lines.append(f"| {row.name} | `{row.specifier}` | {', '.join(row.tested) or '-'} | "
                     f"{f'`{row.declared_in}`' if row.declared_in else '-'} | {row.note} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m megatron_vocabstats.versions: print README's table
    print(markdown_table())
