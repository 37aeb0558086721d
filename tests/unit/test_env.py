"""``vocabstats-env`` (megatron_vocabstats.env): the versions Python actually imports, checked
against the supported-versions table, the devices, what kernel="auto" picks and why, and which
patch targets this Megatron has; never raises, never applies the patch."""

from __future__ import annotations

import platform
import re
import sys
import warnings

import pytest
import torch

from megatron_vocabstats import env, versions


def _report(capsys) -> str:
    assert env.main([]) == 0
    return capsys.readouterr().out


def _row(text: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}\s+(.*)$", text, re.M)
    assert match, f"no row {name!r} in:\n{text}"
    return match.group(1)


def test_report_names_what_is_imported(capsys, monkeypatch):
    monkeypatch.delenv("VOCABSTATS_KERNEL", raising=False)
    text = _report(capsys)
    for section in ("[versions]", "[devices]", "[kernels]"):
        assert section in text
    assert _row(text, "torch").startswith(f"{torch.__version__} (")
    assert _row(text, "torch").endswith("[ok]")
    assert _row(text, "Python").startswith(platform.python_version())
    assert _row(text, "Python").endswith("[ok]")
    try:
        import triton
    except ImportError:
        assert _row(text, "Triton") == "not installed"
    else:
        assert _row(text, "Triton").startswith(f"{triton.__version__} (")
        assert _row(text, "Triton").endswith("[ok]")
    assert "transformer-engine" in text and "apex" in text
    if not torch.cuda.is_available():
        assert _row(text, 'kernel="auto" picks') == "torch"
        assert "no CUDA device" in _row(text, "because")
        assert _row(text, "CUDA devices") == "none available"


def test_report_says_why_a_forced_kernel(capsys, monkeypatch):
    monkeypatch.setenv("VOCABSTATS_KERNEL", "torch")
    assert _row(_report(capsys), "because") == "VOCABSTATS_KERNEL=torch is set"
    monkeypatch.setenv("VOCABSTATS_KERNEL", "bogus")
    text = _report(capsys)
    assert _row(text, 'kernel="auto" picks') == "error"
    assert "VOCABSTATS_KERNEL must be one of" in _row(text, "because")


def test_missing_and_broken_packages_are_reported_not_raised(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "apex", None)             # import fails: not installed
    text = _report(capsys)
    assert _row(text, "apex") == "not installed"
    monkeypatch.setattr(torch, "__version__", "2.9.0a0+nv25.09")   # an old NGC container's torch
    assert _row(_report(capsys), "torch").endswith("[OUTSIDE the supported >=2.11,<2.16]")
    monkeypatch.setattr(torch, "__version__", "2.13.0a0+a5b3d0c.nv26.06")   # counts as 2.13
    assert _row(_report(capsys), "torch").endswith("[ok]")


@pytest.mark.megatron
def test_megatron_version_and_patch_targets(capsys, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from megatron_vocabstats.megatron import compat
    from megatron_vocabstats.megatron._patching import PATCHER

    applied = list(PATCHER.names())
    text = _report(capsys)
    release = compat.megatron_core_release()
    assert _row(text, "megatron-core").startswith(f"{release} (")
    assert "+" not in release and _row(text, "megatron-core").endswith("[ok]")
    assert _row(text, "LanguageModule.compute_language_model_loss") == "found"
    hook = ("GPTModel.forward(output_processor=...)" if release >= "0.18"
            else "GPTModel._postprocess")
    assert _row(text, hook).startswith("found")
    assert list(PATCHER.names()) == applied, "the report changed what is patched"
    # A release without the consumer the patch needs: reported as MISSING, not raised.
    monkeypatch.delattr(LanguageModule, "compute_language_model_loss")
    assert _row(_report(capsys), "LanguageModule.compute_language_model_loss").startswith(
        "MISSING")


@pytest.mark.megatron
def test_install_md_sample_lists_every_patch_target_row(capsys):
    """docs/install.md's sample report (made on megatron-core 0.19) has the rows this report
    prints there (it had lost HybridModel.forward and process_mtp_loss)."""
    pytest.importorskip("megatron.core")
    from megatron_vocabstats.megatron import compat

    if not (compat.megatron_core_release() or "").startswith("0.19"):
        pytest.skip("the sample was made with megatron-core 0.19")
    root = __file__.rsplit("/tests/", 1)[0]
    with open(f"{root}/docs/install.md", encoding="utf-8") as f:
        sample = f.read().split("[patch targets in this Megatron]\n", 1)[1].split("```", 1)[0]
    assert [line.split("  ")[0] for line in sample.splitlines()] == \
        [name for name, _ in env.patch_targets()]


def test_help_is_usage_and_status_0_other_arguments_2(capsys):
    assert env.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: vocabstats-env [--versions]\n")
    assert env.main(["--bogus"]) == 2
    assert "usage: vocabstats-env" in capsys.readouterr().err


def test_versions_prints_the_supported_versions_table(capsys):
    assert env.main(["--versions"]) == 0
    assert capsys.readouterr().out == versions.markdown_table() + "\n"



def test_component_imports_do_not_print_their_warnings(monkeypatch, capsys):
    """``vocabstats-env`` does not repeat a component's import-time warnings (Megatron's about
    Transformer Engine and Apex) above its report."""
    devices = env._devices

    def noisy(torch):
        warnings.warn("Transformer Engine and Apex are not installed")
        return devices(torch)

    monkeypatch.setattr(env, "_devices", noisy)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert env.main([]) == 0
    assert not shown, [str(w.message) for w in shown]
    assert capsys.readouterr().out.startswith(env.TITLE)
