"""The supported-versions table (megatron_vocabstats/versions.py) is the single source: README's
table is its rendering, pyproject declares its ranges, the error messages word its megatron-core
row, and its "tested" columns are what CI pins (requirements/, scripts/test.sh)."""

from __future__ import annotations

import os
import re
import sys
import tomllib

import pytest
import torch
from packaging.requirements import Requirement

import megatron_vocabstats
from megatron_vocabstats import versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN = "<!-- supported versions: `python -m megatron_vocabstats.versions` prints this table -->"
END = "<!-- end of supported versions -->"


def _read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_readme_table_is_the_table():
    text = _read("README.md")
    assert BEGIN in text and END in text, "README lacks the supported-versions markers"
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert shown == versions.markdown_table(), (
        "README's supported-versions table differs from megatron_vocabstats/versions.py: paste "
        "the output of `python -m megatron_vocabstats.versions`")


def _pyproject():
    return tomllib.loads(_read("pyproject.toml"))["project"]


def _requirement(specs, name):
    found = [Requirement(s) for s in specs if Requirement(s).name == name]
    assert len(found) == 1, f"{name} declared {len(found)} times in {specs}"
    return str(found[0].specifier)


@pytest.mark.parametrize("row", versions.SUPPORTED, ids=lambda r: r.name)
def test_pyproject_declares_each_range(row):
    project = _pyproject()
    normalise = lambda spec: sorted(spec.split(","))  # noqa: E731 - order-free comparison
    if row.declared_in is None:
        return
    if row.declared_in == "requires-python":
        declared = project["requires-python"]
    elif row.declared_in == "dependencies":
        declared = _requirement(project["dependencies"], row.distribution)
    else:
        extra = re.fullmatch(r"\[(\w+)\] extra", row.declared_in).group(1)
        declared = _requirement(project["optional-dependencies"][extra], row.distribution)
    assert normalise(declared) == normalise(row.specifier), (row.name, declared)


def test_version_is_one_string():
    project = _pyproject()
    assert "version" in project.get("dynamic", []) and "version" not in project
    assert tomllib.loads(_read("pyproject.toml"))["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "megatron_vocabstats.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", megatron_vocabstats.__version__)


def test_tested_columns_are_what_ci_pins():
    pins = {}
    for name in ("py311.txt", "py312.txt"):
        for line in _read("requirements", name).splitlines():
            if "==" in line and not line.startswith("#"):
                dist, version = line.split("==")
                pins.setdefault(dist.strip().lower(), set()).add(version.strip())
    assert pins["torch"] == set(versions.component("torch").tested)
    assert pins["megatron-core"] == set(versions.component("megatron-core").tested)
    pythons = set(re.findall(r"ensure_venv \S+ (3\.\d+) ", _read("scripts", "test.sh")))
    assert pythons == set(versions.component("Python").tested)
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in pythons
    assert torch.__version__.split("+")[0] in versions.component("torch").tested


def test_messages_word_the_megatron_row():
    from megatron_vocabstats.megatron import compat

    assert compat.SUPPORTED == versions.supported_range("megatron-core")
    assert compat.SUPPORTED == "megatron-core >=0.16,<0.20 (tested: 0.16.1, 0.19.2)"


def test_version_check_follows_the_table():
    assert versions.check_version("torch", "2.13.0+cu130") is None
    assert "outside the supported range torch >=2.13,<2.14" in versions.check_version(
        "torch", "2.9.0a0+nv25.09")
    assert versions.check_version("megatron-core", "0.19.2") is None
    assert versions.check_version("megatron-core", "0.20.0rc1") is not None
    assert versions.check_version("CUDA capability", "7.5") is not None
    assert versions.check_version("CUDA capability", "9.0") is None
    assert "not a version" in versions.check_version("Python", "banana")
    with pytest.raises(KeyError, match="no supported-versions row"):
        versions.component("jax")
