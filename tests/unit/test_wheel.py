"""The built wheel works outside the repository: what a user gets from ``pip install``.

One build (``pip wheel --no-deps --no-build-isolation`` of a copy of the sources, so nothing is
written into the checkout), one ``pip install --no-deps --target`` into a temporary directory,
then this interpreter run from another directory with only that directory added to its path:
the package, ``megatron_vocabstats.patch``, the shipped ``pretrain_gpt.py`` patches and the
three command-line tools must all come from the wheel; and a ``pip install --dry-run`` of it
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

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = ("vocabstats-env", "vocabstats-patch-megatron", "vocabstats-profile")


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
    shutil.copytree(os.path.join(ROOT, "megatron_vocabstats"),
                    os.path.join(src, "megatron_vocabstats"),
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
        import inspect, json, importlib.metadata, importlib.resources, megatron_vocabstats
        dist = importlib.metadata.distribution("megatron-vocabstats")
        out = {"package": megatron_vocabstats.__file__, "version": megatron_vocabstats.__version__,
               "dist": str(dist.locate_file("")), "dist_version": dist.version,
               "patches": sorted(p.name for p in importlib.resources.files(
                   "megatron_vocabstats.megatron_lm").iterdir() if p.name.endswith(".patch")),
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
    assert out["patches"] == [f"pretrain_gpt.core_v0.{m}.patch" for m in (16, 17, 18, 19, 20)]
    assert sorted(out["tools"]) == sorted(TOOLS)
    assert all(path.startswith(site) for path in out["tools"].values()), out["tools"]
    if megatron:
        assert out["patch"].startswith(site) and out["patched"] is True


def test_wheel_command_line_tool_runs():
    site, _ = _installed()
    env, cwd = _elsewhere(site)
    for tool in TOOLS:
        assert os.path.isfile(os.path.join(site, "bin", tool)), f"the wheel has no {tool}"
    # The script wrapper pip wrote runs (the one tool that needs neither Megatron nor a report).
    listed = _run([os.path.join(site, "bin", "vocabstats-patch-megatron"), "--list"], env=env,
                  cwd=cwd)
    from megatron_vocabstats.megatron_lm import releases

    assert listed.count(site) == len(releases.RELEASES), listed
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
