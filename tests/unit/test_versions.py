"""The supported-versions table (megatron_vocabstats/versions.py) is the single source: README's
table is its rendering, pyproject declares its ranges, the error messages word its megatron-core
row, and its "tested" columns are what CI pins (requirements/pyNNN.txt, one per CI leg); the
running interpreter is read, never assumed."""

from __future__ import annotations

import glob
import os
import platform
import re
import sys
import tomllib
from importlib import metadata

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import megatron_vocabstats
from megatron_vocabstats import versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN = "<!-- supported versions: `vocabstats-env --versions` prints this table -->"
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
        "the output of `vocabstats-env --versions`")


def _pyproject():
    return tomllib.loads(_read("pyproject.toml"))["project"]


def _requirement(specs, name):
    found = [Requirement(s) for s in specs if Requirement(s).name == name]
    assert len(found) == 1, f"{name} declared {len(found)} times in {specs}"
    return str(found[0].specifier)


@pytest.mark.parametrize("row", versions.SUPPORTED, ids=lambda r: r.name)
def test_pyproject_declares_each_requirement(row):
    project = _pyproject()
    if row.declared_in is None:
        assert row.requirement is None
        return
    if row.declared_in == "requires-python":
        declared = project["requires-python"]
    elif row.declared_in == "dependencies":
        declared = _requirement(project["dependencies"], row.distribution)
    else:
        extra = re.fullmatch(r"\[(\w+)\] extra", row.declared_in).group(1)
        declared = _requirement(project["optional-dependencies"][extra], row.distribution)
    assert SpecifierSet(declared) == SpecifierSet(row.requirement), (row.name, declared)


@pytest.mark.parametrize("row", [r for r in versions.SUPPORTED if r.requirement],
                         ids=lambda r: r.name)
def test_requirement_is_the_ranges_lower_bound_only(row):
    """pip is never told an upper bound (it would replace the user's torch), and admits the
    whole supported range, NVIDIA's pre-release builds of its lowest release included."""
    requirement = SpecifierSet(row.requirement)
    assert all(spec.operator == ">=" for spec in requirement), row.requirement
    supported = SpecifierSet(row.supported)
    lowest = next(s.version for s in supported if s.operator == ">=")
    (bound,) = requirement
    assert Version(bound.version).release[:2] == \
        Version(lowest).release[:2]
    if row.name == "torch":
        assert requirement.contains("2.11.0a0+nv26.02", prereleases=True)
        assert requirement.contains("2.13.0a0+gitabc123.nv26.06")
        assert requirement.contains("3.0.0")


def test_version_is_one_string():
    project = _pyproject()
    assert "version" in project.get("dynamic", []) and "version" not in project
    assert tomllib.loads(_read("pyproject.toml"))["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "megatron_vocabstats.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", megatron_vocabstats.__version__)


def _ci_pins() -> dict[str, dict[str, str]]:
    """``{"3.12": {"torch": "2.15.0", ...}, ...}``: each CI venv's ``requirements/pyNNN.txt``."""
    legs = {}
    for path in sorted(glob.glob(os.path.join(ROOT, "requirements", "py3*.txt"))):
        match = re.fullmatch(r"py3(\d+)\.txt", os.path.basename(path))
        if match is None:   # py312-nodeps.txt: installed with --no-deps, no versions of ours
            continue
        pins = legs.setdefault(f"3.{match.group(1)}", {})
        for line in _read("requirements", os.path.basename(path)).splitlines():
            if "==" in line and not line.lstrip().startswith("#"):
                dist, version = line.split("#")[0].split("==")
                pins[dist.strip().lower()] = version.strip()
    return legs


def test_tested_columns_are_what_ci_pins():
    legs = _ci_pins()
    assert set(legs) == set(versions.component("Python").tested)
    for name in ("torch", "megatron-core"):
        assert {pins[name] for pins in legs.values()} == set(versions.component(name).tested), name
    # Triton: pinned where pinned, else the one the leg's torch wheel brings (checked below on
    # the leg that runs).
    assert {pins["triton"] for pins in legs.values() if "triton" in pins} <= \
        set(versions.component("Triton").tested)


def test_running_versions_are_a_ci_leg():
    """This interpreter is one of the CI legs, with that leg's pins; each of its components is
    inside the supported range (no warning where CI runs)."""
    leg = f"{sys.version_info.major}.{sys.version_info.minor}"
    pins = _ci_pins()[leg]
    assert torch.__version__.split("+")[0] == pins["torch"]
    assert versions.check_version("Python", platform.python_version()) is None
    assert versions.check_version("torch", torch.__version__) is None
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    if triton is not None:
        assert triton == pins.get("triton", triton)
        assert triton in versions.component("Triton").tested, triton
        assert versions.check_version("Triton", triton) is None
    try:
        megatron = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        megatron = None
    if megatron is not None:
        assert megatron == pins["megatron-core"]
        assert versions.check_version("megatron-core", megatron) is None


def test_messages_word_the_megatron_row():
    from megatron_vocabstats.megatron import compat

    assert compat.SUPPORTED == versions.supported_range("megatron-core")
    assert compat.SUPPORTED == "megatron-core >=0.16,<0.21 (tested: 0.16.1, 0.19.2)"


def test_version_check_follows_the_table():
    assert versions.check_version("torch", "2.13.0+cu130") is None
    # NVIDIA's containers: pre-releases count as their release, inside the range.
    for ngc in ("2.11.0a0+a5b3d0c.nv26.02", "2.13.0a0+gitabc123.nv26.06",
                "2.14.0a0+f70c2cd.nv26.08"):
        assert versions.check_version("torch", ngc) is None, ngc
    for outside in ("2.10.0", "2.9.0a0+nv25.09", "2.16.0", "2.16.0a0+nv26.12"):
        assert "outside the supported range torch >=2.11,<2.16 (tested: 2.11.0, 2.14.1, " \
            "2.15.0)" in versions.check_version("torch", outside), outside
    assert versions.check_version("megatron-core", "0.19.2") is None
    assert versions.check_version("megatron-core", "0.20.0") is None       # Megatron-LM main
    assert versions.check_version("megatron-core", "0.20.0rc1") is None
    assert versions.check_version("megatron-core", "0.21.0") is not None
    assert versions.check_version("megatron-core", "0.15.1") is not None
    assert versions.check_version("Triton", "3.6.0") is None
    assert versions.check_version("Triton", "3.10.0") is not None
    assert versions.check_version("Python", "3.13.13") is None
    assert "Python 3.14.0 is outside" in versions.check_version("Python", "3.14.0")
    assert versions.check_version("CUDA capability", "7.5") is not None
    assert versions.check_version("CUDA capability", "9.0") is None
    assert "not a version" in versions.check_version("Python", "banana")
    with pytest.raises(KeyError, match="no supported-versions row"):
        versions.component("jax")


def _untested_warnings(caught) -> list[str]:
    from megatron_vocabstats import version_check

    return sorted(str(w.message) for w in caught
                  if issubclass(w.category, version_check.UntestedVersionWarning))


# The version warning (megatron_vocabstats.version_check): once per process, one per component.

@pytest.fixture
def fresh_check():
    from megatron_vocabstats import version_check

    version_check.reset()
    yield version_check
    version_check.reset()


def test_ops_alone_warn_once_per_component(fresh_check, monkeypatch):
    """A user of the ops alone (no patch) hears of a torch or Triton outside the tested range:
    one warning per component at the first op call of the process, none at import or later."""
    import warnings

    from megatron_vocabstats.ops import vocab_parallel_logprobs

    version_check = fresh_check
    logits, target = torch.randn(3, 7), torch.tensor([0, 6, 2])
    with warnings.catch_warnings():     # the running (CI) versions: inside the range
        warnings.simplefilter("error", version_check.UntestedVersionWarning)
        vocab_parallel_logprobs(logits, target)
    version_check.reset()
    monkeypatch.setattr(torch, "__version__", "2.16.0a0+nv26.12")
    monkeypatch.setattr(version_check, "_distribution_version",
                        lambda name: "3.10.0" if name == "triton" else None)
    monkeypatch.setattr(platform, "python_version", lambda: "3.14.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            out = vocab_parallel_logprobs(logits, target)
    reference = torch.log_softmax(logits.double(), -1).gather(1, target[:, None])[:, 0]
    torch.testing.assert_close(out.double(), reference)        # the plugin still runs
    messages = _untested_warnings(caught)
    assert len(messages) == 3, messages
    assert messages[0].startswith("Python 3.14.0 is outside the supported range Python "
                                  ">=3.11,<3.14 (tested: 3.11, 3.12, 3.13)")
    assert messages[1].startswith("Triton 3.10.0 is outside the supported range Triton "
                                  ">=3.6,<3.10 (tested: ")
    assert messages[2].startswith("torch 2.16.0a0+nv26.12 is outside the supported range "
                                  "torch >=2.11,<2.16 (tested: 2.11.0, 2.14.1, 2.15.0)")
    # Another rank of the job says nothing (rank 0 speaks for it).
    version_check.reset()
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vocab_parallel_logprobs(logits, target)
    assert _untested_warnings(caught) == []


def test_ngc_torch_is_its_release_for_pip_and_the_warning():
    """NVIDIA's container builds: pip's requirement admits them (a pre-release sorts below its
    release, hence ``>=2.11.0a0``) and the run-time check calls them supported."""
    from megatron_vocabstats import version_check

    (req,) = [r for r in _pyproject()["dependencies"] if Requirement(r).name == "torch"]
    for ngc in ("2.11.0a0+a5b3d0c.nv26.02", "2.13.0a0+gitabc123.nv26.06",
                "2.14.0a0+f70c2cd.nv26.08"):
        assert Requirement(req).specifier.contains(ngc), (req, ngc)
        assert version_check.untested({"torch": ngc}) == [], ngc


def test_one_warning_per_component_once_per_process(fresh_check, monkeypatch):
    """All four components, megatron-core as the patch passes it; the patch's and the ops'
    checks together warn once per component."""
    import warnings

    monkeypatch.setattr(torch, "__version__", "2.10.0")
    monkeypatch.setattr(platform, "python_version", lambda: "3.14.1")
    real = fresh_check._distribution_version
    monkeypatch.setattr(fresh_check, "_distribution_version",
                        lambda name: "3.10.0" if name == "triton" else real(name))
    monkeypatch.setenv("RANK", "3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh_check.warn_untested(megatron_core="0.15.0") == []
    assert not _untested_warnings(caught), "a rank other than 0 warned"
    fresh_check.reset()
    monkeypatch.setenv("RANK", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh_check.warn_untested(megatron_core="0.15.0")
        fresh_check.warn_untested(megatron_core="0.15.0")
        fresh_check.at_first_op()
    messages = sorted(_untested_warnings(caught))
    assert [m.split(" is outside")[0] for m in messages] == [
        "Python 3.14.1", "Triton 3.10.0", "megatron-core 0.15.0", "torch 2.10.0"], messages
    assert "the supported range Triton >=3.6,<3.10 (tested: 3.6.0, 3.8.0, 3.9.0)" in messages[1]


def test_import_alone_does_not_warn():
    """The check runs at the first op call, not at import (a torch outside the range)."""
    import subprocess

    code = ("import warnings, torch; torch.__version__ = '2.16.0'; "
            "warnings.simplefilter('error'); import megatron_vocabstats, megatron_vocabstats.ops; "
            "warnings.simplefilter('always'); "
            "from megatron_vocabstats.version_check import UntestedVersionWarning as W\n"
            "with warnings.catch_warnings(record=True) as c:\n"
            "    warnings.simplefilter('always')\n"
            "    megatron_vocabstats.vocab_parallel_logprobs(torch.randn(2, 4), "
            "torch.tensor([0, 1]))\n"
            "print(sum(issubclass(w.category, W) for w in c))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1"
