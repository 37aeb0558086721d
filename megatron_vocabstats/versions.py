"""The supported versions: one table (:data:`SUPPORTED`), the single source of the README,
pyproject and messages (checked by ``tests/unit/test_versions.py``). Update it when CI covers
another version.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Component", "SUPPORTED", "component", "supported_range", "check_version",
           "markdown_table"]


@dataclass(frozen=True, slots=True)
class Component:
    """One row of the table: ``supported`` is the PEP 440 range of the ``tested`` versions (else
    a warning); ``requirement`` the pip requirement, a lower bound only so that installing the
    plugin never changes the user's torch; ``declared_in`` where pyproject declares it."""

    name: str
    distribution: str | None
    tested: tuple[str, ...]
    supported: str
    requirement: str | None
    declared_in: str | None
    note: str


SUPPORTED: tuple[Component, ...] = (
    Component("Python", None, ("3.11", "3.12", "3.13"), ">=3.11,<3.14", ">=3.11",
              "requires-python",
              "3.12 (torch 2.15), 3.11 (torch 2.11), 3.13 (torch 2.14.1; NeMo-RL's Python)"),
    # >=2.11.0a0: NVIDIA's containers carry pre-releases (2.13.0a0+...nv26.06), which sort
    # below their release; pip must accept them as the warning does.
    Component("torch", "torch", ("2.11.0", "2.14.1", "2.15.0"), ">=2.11,<2.16", ">=2.11.0a0",
              "dependencies",
              "a lower bound only: pip never changes an installed torch (verl 0.9.1 and "
              "NeMo-RL pin 2.11.0); NGC builds count as their release; CPU (gloo) in CI"),
    Component("megatron-core", "megatron-core", ("0.16.1", "0.19.2"), ">=0.16,<0.21", ">=0.16",
              "[megatron] extra",
              "0.20.0 is Megatron-LM main (no release yet); the patch finds Megatron's names by "
              "feature, not by version; `pretrain_gpt.py` patches for 0.16 to 0.19 and 0.20 "
              "(Megatron-LM main)"),
    Component("Triton", "triton", ("3.6.0", "3.8.0", "3.9.0"), ">=3.6,<3.10", ">=3.6",
              "[triton] extra",
              "optional, only for `kernel=\"triton\"`; the one each torch's CUDA wheel pins "
              "(2.11: 3.6, 2.14: 3.8, 2.15: 3.9); tested under its CPU interpreter and "
              "compiled offline for sm_90"),
    Component("CUDA capability", None, (), ">=8.0", None, None,
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
    """``"megatron-core >=0.16,<0.21 (tested: 0.16.1, 0.19.2)"``: the row in words."""
    row = component(name)
    tested = f" (tested: {', '.join(row.tested)})" if row.tested else ""
    return f"{row.name} {row.supported}{tested}"


def check_version(name: str, version: str) -> str | None:
    """None if ``version`` lies in the row's supported range, else why not; local labels and
    pre-releases count as their release (``2.13.0a0+...nv26.06`` as 2.13.0)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    row = component(name)
    try:
        release = Version(version).release
    except InvalidVersion:
        return f"{row.name} {version!r} is not a version number; supported: {supported_range(name)}"
    plain = ".".join(str(part) for part in release)
    if plain in SpecifierSet(row.supported):
        return None
    return f"{row.name} {version} is outside the supported range {supported_range(name)}"


def markdown_table() -> str:
    """The table README.md shows (checked by ``tests/unit/test_versions.py``)."""
    lines = ["| component | supported (else a warning) | tested in CI | pip requirement "
             "(pyproject) | note |",
             "|---|---|---|---|---|"]
    for row in SUPPORTED:
        pip = f"`{row.requirement}` ({row.declared_in})" if row.requirement else "-"
        lines.append(f"| {row.name} | `{row.supported}` | {', '.join(row.tested) or '-'} | "
                     f"{pip} | {row.note} |")
    return "\n".join(lines)
