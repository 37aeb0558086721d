"""What ``import megatron_vocabstats.patch`` reports and does when Megatron is not the wheel or is
broken: the version of the megatron actually imported, and all-or-nothing patching."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, *, pythonpath: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*pythonpath, ROOT]), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_version_is_the_imported_megatrons_not_the_wheels(tmp_path):
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("__version__ = '0.99.0rc7-checkout'\n")
    out = _run("from megatron_vocabstats.megatron import compat; print(compat.megatron_core_version())",
               pythonpath=[str(tmp_path)])
    assert out.strip() == f"0.99.0rc7-checkout ({core})"


@pytest.mark.parametrize("installed", [True, False])
def test_version_drops_the_commit_of_the_repository_around_a_wheel(tmp_path, installed):
    # Megatron appends `+<commit of the git repository holding the package>` to __version__: for
    # a wheel in a virtual environment inside another project's clone that is the project's
    # commit, so it is dropped; a source checkout keeps its own.
    root = tmp_path / ("venv/lib/python3/site-packages" if installed else "Megatron-LM")
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("from .package_info import __version__\n")
    (core / "package_info.py").write_text(
        "VERSION = (0, 19, 2, '')\n__version__ = '0.19.2+8639773'\n")
    out = _run("from megatron_vocabstats.megatron import compat; "
               "print(compat.megatron_core_release(), compat.megatron_core_version())",
               pythonpath=[str(root)])
    suffix = "" if installed else "+8639773"
    assert out.strip() == f"0.19.2 0.19.2{suffix} ({core})"


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="this megatron-core wheel has no megatron.training")
def test_a_broken_megatron_training_import_patches_nothing_and_says_why():
    # megatron.training is there but one of its imports fails (as pydantic missing does on some
    # releases): the import must raise and leave every Megatron binding as it was.
    out = _run("""
        import importlib.abc, sys

        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "megatron.training.yaml_arguments":
                    raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")

        sys.meta_path.insert(0, Broken())
        from megatron.core.models.common.language_module.language_module import LanguageModule
        before = LanguageModule.__dict__["compute_language_model_loss"]
        try:
            import megatron_vocabstats.patch
        except ImportError as exc:
            print(type(exc).__name__, "|", exc)
        from megatron_vocabstats.megatron._patching import PATCHER
        print("patched:", PATCHER.names())
        print("same:", LanguageModule.__dict__["compute_language_model_loss"] is before)
    """, pythonpath=[])
    lines = [line for line in out.strip().splitlines() if not line.startswith("INFO:")]
    assert lines[0].startswith("UnsupportedMegatronError | importing megatron.training.yaml_arguments")
    assert "pydantic" in lines[0]
    assert lines[1:] == ["patched: []", "same: True"]


def test_patch_without_megatron_core_says_how_to_install_it(tmp_path):
    """Importing the patch where megatron-core is not installed names the missing package and
    how to get it, instead of only the failed import."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'megatron' or name.startswith('megatron.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", "import megatron_vocabstats.patch"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "pip install megatron-core into this environment" in run.stderr, run.stderr[-2000:]
