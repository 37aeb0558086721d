"""The AReaL integration (``megatron_vocabstats.integrations.areal``) on AReaL's real modules
from the installed AReaL 1.0.4 wheel (loaded by ``_framework_stubs`` without AReaL's heavy
dependencies), in one process: what it replaces and restores (all or nothing), its errors on a
release whose names moved or without AReaL, the engine it skips when that engine's backend is
missing, the differences it logs once, and its argument errors. AReaL's own functions at tp = 1
and 2: ``test_areal_dist.py``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import logging
import pathlib

import pytest
import torch

import _framework_stubs

INTEGRATION = "megatron_vocabstats.integrations.areal"
VP = "areal.utils.functional.vocab_parallel"
ENGINE = "areal.engine.megatron_engine"
FSDP = "areal.engine.fsdp_engine"


@pytest.fixture(scope="module")
def areal():
    """The areal modules (real code, stubbed dependencies) and the integration, applied."""
    yield from _framework_stubs.applied("areal", INTEGRATION, "requirements/py311-nodeps.txt")


def _untouched(modules, integration) -> bool:
    return all(getattr(modules[m], n).__module__ == VP and not hasattr(getattr(modules[m], n),
                                                                       "__wrapped__")
               for m, n in _framework_stubs.bindings(integration))


def test_import_applies_every_binding_and_remove_restores(areal):
    modules, integration = areal
    from megatron_vocabstats.megatron._patching import Patcher

    integration.remove()
    assert _untouched(modules, integration)
    originals = {b: getattr(modules[b[0]], b[1]) for b in _framework_stubs.bindings(integration)}
    importlib.reload(integration)  # the import applies it
    assert len(integration.patched_names()) == len(originals) == 12
    for (module, name), original in originals.items():
        current = getattr(modules[module], name)
        assert Patcher.is_ours(current) and current.__wrapped__ is original, (module, name)
    assert sorted(integration.remove()) == sorted(f"{m}.{n}" for m, n in originals)
    assert all(getattr(modules[m], n) is o for (m, n), o in originals.items())
    assert integration.remove() == [] and not integration.is_applied()
    integration.apply()
    integration.apply(validate=False)  # twice: patched once, options replaced
    assert len(integration.patched_names()) == 12
    integration.apply()


def test_every_import_of_the_names_in_the_wheel_is_covered(areal):
    """Every AReaL module whose import-time code binds gather_logprobs(_entropy) from AReaL
    (``from areal... import``) is in CONSUMERS with both names."""
    _, integration = areal
    root = pathlib.Path(_framework_stubs.root("areal"))
    names = set(integration.DEFINITIONS[VP])
    found = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "gather_logprobs" not in text:
            continue
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        todo = list(ast.parse(text).body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            todo.extend(ast.iter_child_nodes(node))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("areal"):
                hit = names & {a.name for a in node.names}
                if hit:
                    found.setdefault(module, set()).update(hit)
    assert found == {m: set(n) for m, n in integration.CONSUMERS.items()}


def _name_removed(modules, monkeypatch):
    monkeypatch.delattr(modules[VP], "gather_logprobs_entropy")


def _new_signature(modules, monkeypatch):
    monkeypatch.setattr(modules[VP], "gather_logprobs",
                        lambda logits, labels, temperature=1.0, tp_group=None: None)


def _consumer_rebound(modules, monkeypatch):
    monkeypatch.setattr(modules[ENGINE], "gather_logprobs", lambda *a: None)


def _engine_renamed(modules, monkeypatch):
    real = importlib.import_module

    def fake(name, package=None):
        if name == FSDP:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, package)
    monkeypatch.setattr(importlib, "import_module", fake)


def _not_installed(modules, monkeypatch):
    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize("move, message", [
    (_name_removed, f"AReaL 1.0.4: {VP} has no gather_logprobs_entropy"),
    (_new_signature, "gather_logprobs takes ('logits', 'labels', 'temperature', 'tp_group'), not "
                     "('logits', 'labels', 'temperature', 'tp_group', 'chunk_size')"),
    (_consumer_rebound, f"{ENGINE}.gather_logprobs is not {VP}.gather_logprobs"),
    (_engine_renamed, f"cannot import {FSDP}"),
    (_not_installed, "needs AReaL (pip install 'areal==1.0.4'); it is not installed"),
], ids=["name_removed", "new_signature", "consumer_rebound", "engine_renamed", "not_installed"])
def test_moved_names_raise_and_patch_nothing(areal, monkeypatch, move, message):
    """One UnsupportedArealError (an ImportError) naming the binding, what was expected and what
    was found, at import and from apply(); nothing patched."""
    modules, integration = areal
    integration.remove()
    try:
        move(modules, monkeypatch)
        with pytest.raises(integration.UnsupportedArealError) as info:
            integration.apply()
        assert message in str(info.value) and isinstance(info.value, ImportError), info.value
        with pytest.raises(ImportError):
            importlib.reload(integration)
        assert not integration.is_applied()
        for m, n in _framework_stubs.bindings(integration):
            assert not hasattr(getattr(modules[m], n, None), "__wrapped__"), (m, n)
    finally:
        monkeypatch.undo()
        importlib.reload(integration)


def test_engine_without_its_backend_is_skipped(areal, monkeypatch, caplog):
    """An engine whose import needs a missing third-party module (peft for the FSDP engine) cannot
    run: it is skipped with one INFO line, everything else is patched."""
    modules, integration = areal
    integration.remove()
    real = importlib.import_module

    def fake(name, package=None):
        if name == FSDP:
            raise ModuleNotFoundError("No module named 'peft'", name="peft")
        return real(name, package)
    monkeypatch.setattr(importlib, "import_module", fake)
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        integration.apply()
    assert f"{FSDP} not patched: it needs peft" in caplog.text
    assert len(integration.patched_names()) == 10
    assert not any(n.startswith(FSDP) for n in integration.patched_names())
    monkeypatch.undo()
    integration.remove()
    integration.apply()
    assert len(integration.patched_names()) == 12


@pytest.mark.parametrize("options, error", [
    (dict(vocab_size=10), "unknown option"),
    (dict(lm_head_chunk_size=4), "unknown option"),
    (dict(validate="yes"), "validate must be a bool"),
    (dict(kernel="cuda"), "kernel must be one of"),
])
def test_bad_option_raises_and_patches_nothing(areal, options, error):
    modules, integration = areal
    integration.remove()
    try:
        with pytest.raises((TypeError, ValueError), match=error):
            integration.apply(**options)
        assert not integration.is_applied() and _untouched(modules, integration)
    finally:
        integration.apply()


def test_each_difference_is_logged_once_on_rank_0(areal, monkeypatch, caplog):
    modules, integration = areal
    logits, labels = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    for rank, count in (("0", 1), ("1", 0)):
        integration.remove()
        integration.apply()
        monkeypatch.setenv("RANK", rank)
        with caplog.at_level(logging.WARNING, logger="megatron_vocabstats"):
            for _ in range(2):
                modules[ENGINE].gather_logprobs(logits, labels, 1.0, None)
                modules[ENGINE].gather_logprobs_entropy(logits, labels, 1.0, None)
        for name in ("gather_logprobs", "gather_logprobs_entropy"):
            assert caplog.text.count(f"(AReaL): {name} runs on") == count, caplog.text
        caplog.clear()


@pytest.mark.parametrize("args, kwargs, error", [
    ((torch.randn(4, 11), torch.randn(4)), {}, "labels must be a tensor of integer token ids"),
    ((torch.randn(4, 11), torch.zeros(3, dtype=torch.long)), {}, r"labels must have the shape"),
    ((torch.randn(0, 11), torch.zeros(0, dtype=torch.long)), {}, "logits is an empty micro"),
    ((torch.randn(4, 11), torch.zeros(4, dtype=torch.long)), dict(chunk_size=0), "chunk_size"),
    ((torch.randn(4, 11), torch.zeros(4, dtype=torch.long)), dict(temperature=0.0),
     "temperature"),
    ((torch.tensor(1.0), torch.tensor(0)), {}, "logits must be a tensor"),
])
def test_bad_input_names_the_argument(areal, args, kwargs, error):
    modules, _ = areal
    for fn in (modules[ENGINE].gather_logprobs, modules[ENGINE].gather_logprobs_entropy):
        with pytest.raises(ValueError, match=error):
            fn(*args, **kwargs)
