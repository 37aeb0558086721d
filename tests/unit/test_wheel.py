"""The built wheel works outside the repository: what a user gets from ``pip install``.

One build (``pip wheel --no-deps --no-build-isolation`` of a copy of the sources, so nothing is
written into the checkout), one ``pip install --no-deps --target`` into a temporary directory,
then this interpreter run from another directory with only that directory added to its path:
the package, ``megatron_vocabstats.patch``, the shipped ``pretrain_gpt.py`` patches (the
repository's top-level ``patches/``, mapped to ``megatron_vocabstats/megatron_lm/patches/``) and
the three command-line tools must all come from the wheel; and a ``pip install --dry-run`` of it
into this environment would change nothing but the plugin. About 15 s of CPU.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = ("vocabstats-env", "vocabstats-patch-megatron", "vocabstats-profile")
RELEASES = ("0.16", "0.17", "0.18", "0.19", "0.20")
# Where the wheel puts the repository's patches/ (pyproject.toml's package-dir mapping).
PATCHES = "megatron_vocabstats/megatron_lm/patches"


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc.stdout


@functools.cache
def _installed() -> tuple[str, str]:
    """``(target directory, wheel file name)`` of the wheel built and installed once."""
    tmp = tempfile.mkdtemp(prefix="vocabstats-wheel-")
    src = os.path.join(tmp, "src")
    os.makedirs(src)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src)
    for folder in ("megatron_vocabstats", "patches"):
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(src, folder),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist, site = os.path.join(tmp, "dist"), os.path.join(tmp, "site")
    quiet = ["--quiet", "--disable-pip-version-check", "--no-input"]
    _run([sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "--no-build-isolation",
          "-w", dist, src])
    (wheel,) = glob.glob(os.path.join(dist, "*.whl"))
    _run([sys.executable, "-m", "pip", "install", *quiet, "--no-deps", "--target", site, wheel])
    return site, os.path.basename(wheel)


def _elsewhere(site: str) -> tuple[dict, str]:
    cwd = tempfile.mkdtemp(prefix="vocabstats-user-")
    env = dict(os.environ, PYTHONPATH=site, PYTHONWARNINGS="ignore", PYTHONNOUSERSITE="1")
    return env, cwd


def test_wheel_imports_from_outside_the_repository():
    site, wheel = _installed()
    from megatron_vocabstats import __version__

    assert wheel.startswith(f"megatron_vocabstats-{__version__}-py3-none-any")
    env, cwd = _elsewhere(site)
    megatron = importlib.util.find_spec("megatron.core") is not None
    # One interpreter: the package, the patch, the shipped patches and every console script's
    # entry point, each from the wheel.
    code = """if True:
        import inspect, json, importlib.metadata, os, megatron_vocabstats
        from megatron_vocabstats.megatron_lm import releases
        dist = importlib.metadata.distribution("megatron-vocabstats")
        out = {"package": megatron_vocabstats.__file__, "version": megatron_vocabstats.__version__,
               "dist": str(dist.locate_file("")), "dist_version": dist.version,
               "patches_dir": releases.patches_dir(),
               "patches": sorted(p for p in os.listdir(releases.patches_dir())
                                 if p.endswith(".patch")),
               "tools": {ep.name: inspect.getfile(ep.load()) for ep in dist.entry_points
                         if ep.group == "console_scripts"}}
        if MEGATRON:
            import megatron_vocabstats.patch as patch
            out["patch"] = patch.__file__
            out["patched"] = patch.is_applied()
        print(json.dumps(out))
    """.replace("MEGATRON", str(megatron))
    out = json.loads(_run([sys.executable, "-c", code], env=env, cwd=cwd).strip().splitlines()[-1])
    assert out["package"].startswith(site), f"imported {out['package']}, not the wheel"
    assert out["dist"].startswith(site) and out["version"] == out["dist_version"] == __version__
    assert out["patches_dir"] == os.path.join(site, *PATCHES.split("/")), out["patches_dir"]
    assert out["patches"] == [f"pretrain_gpt.core_v{r}.patch" for r in RELEASES]
    assert sorted(out["tools"]) == sorted(TOOLS)
    assert all(path.startswith(site) for path in out["tools"].values()), out["tools"]
    if megatron:
        assert out["patch"].startswith(site) and out["patched"] is True


def test_wheel_holds_every_module_and_the_mapped_patches():
    """The wheel's files: every module of megatron_vocabstats/ (pyproject.toml lists the
    package's folders), and the repository's patches/ under megatron_lm/patches/ only."""
    site, wheel = _installed()
    with zipfile.ZipFile(os.path.join(os.path.dirname(site), "dist", wheel)) as zf:
        names = set(zf.namelist())
    source = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
              for d, _, files in os.walk(os.path.join(ROOT, "megatron_vocabstats"))
              for f in files if f.endswith(".py")}
    assert not source - names, f"not in the wheel: {sorted(source - names)}"
    patches = sorted(n for n in names if n.endswith(".patch"))
    assert patches == [f"{PATCHES}/pretrain_gpt.core_v{r}.patch" for r in RELEASES], patches
    assert not [n for n in names if n.startswith("patches/")], "a top-level patches/ in the wheel"


def test_pyproject_lists_every_package_and_maps_the_patches():
    """Without building: the explicit package list is the source tree's packages plus the mapped
    patches folder, and the mapping and its package data are there (the wheel needs all three)."""
    from setuptools import find_packages

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    mapped = PATCHES.replace("/", ".")
    found = find_packages(ROOT, include=["megatron_vocabstats", "megatron_vocabstats.*"])
    assert sorted(tool["packages"]) == sorted([*found, mapped])
    assert tool["package-dir"] == {mapped: "patches"}
    assert tool["package-data"][mapped] == ["*.patch"]
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "patches")) if f.endswith(".patch")) \
        == [f"pretrain_gpt.core_v{r}.patch" for r in RELEASES]


def test_wheel_command_line_tool_runs():
    site, _ = _installed()
    env, cwd = _elsewhere(site)
    for tool in TOOLS:
        assert os.path.isfile(os.path.join(site, "bin", tool)), f"the wheel has no {tool}"
    # The script wrapper pip wrote runs (the one tool that needs neither Megatron nor a report).
    tool = os.path.join(site, "bin", "vocabstats-patch-megatron")
    listed = _run([tool, "--list"], env=env, cwd=cwd)
    from megatron_vocabstats.megatron_lm import releases

    paths = re.findall(r"^(0\.\d+): (\S+)  \(made from ", listed, re.M)
    assert [r for r, _ in paths] == list(releases.RELEASES) == list(RELEASES), listed
    for release, path in paths:  # every release's patch, a file of the installed wheel
        assert path == os.path.join(site, *PATCHES.split("/"),
                                    f"pretrain_gpt.core_v{release}.patch"), listed
        assert os.path.isfile(path), path
    # --check on a checkout holding the 0.19 patch's pre-image: the installed patch applies.
    checkout = os.path.join(cwd, "Megatron-LM")
    os.makedirs(os.path.join(checkout, "megatron", "core"))
    with open(os.path.join(checkout, releases.PACKAGE_INFO), "w") as f:
        f.write("MAJOR = 0\nMINOR = 19\nPATCH = 0\n")
    with open(paths[3][1]) as f:
        pre_image = "".join(releases.read_hunk(f.read()).old)
    with open(os.path.join(checkout, releases.SCRIPT), "w") as f:
        f.write(pre_image)
    checked = _run([tool, checkout, "--check"], env=env, cwd=cwd)
    assert "pretrain_gpt.core_v0.19.patch (made from core_v0.19.0" in checked, checked
    assert "applies; nothing written" in checked, checked
    usage = _run([os.path.join(site, "bin", "vocabstats-profile"), "--help"], env=env, cwd=cwd)
    assert usage.startswith("usage: vocabstats-profile "), usage  # its own name, not python -m


def test_installing_the_wheel_leaves_torch_alone():
    """What pip does to the user's torch: nothing. ``pip install --dry-run`` of the wheel into
    this environment (each CI leg's torch, Triton, megatron-core) would install the plugin alone:
    its requirements (lower bounds) are met by what is there. Without the machine's pip
    configuration (its constraints file caps torch) and without an index, so nothing else could
    be fetched."""
    from megatron_vocabstats import __version__

    site, wheel = _installed()
    path = os.path.join(os.path.dirname(site), "dist", wheel)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                           "--disable-pip-version-check", path], env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    would = [line for line in out.splitlines() if line.startswith("Would install")]
    # None where this environment has the plugin installed already (editable, same version).
    assert would in ([], [f"Would install megatron-vocabstats-{__version__}"]), out[-2000:]
    assert re.search(r"^Requirement already satisfied: torch>=2\.11\.0a0 .*\(" +
                     re.escape(torch.__version__.split("+")[0]) + r"\)$", out, re.M), out[-2000:]


@pytest.fixture(autouse=True, scope="module")
def _cleanup():
    yield
    if _installed.cache_info().currsize:
        shutil.rmtree(os.path.dirname(_installed()[0]), ignore_errors=True)
        _installed.cache_clear()
