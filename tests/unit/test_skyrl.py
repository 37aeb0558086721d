"""The SkyRL integration (``megatron_vocabstats.integrations.skyrl``) on SkyRL's real modules from
the installed ``skyrl==0.3.0`` wheel (loaded by ``_framework_stubs`` without SkyRL's heavy
dependencies), in one process: what it replaces and restores, the bindings it must cover in the
wheel, its errors on a release whose names moved, and bad arguments. Values and gradients
against SkyRL's own functions and float64 at tp 1, 2 and cp 2: ``test_skyrl_dist.py``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata

import pytest
import torch

import _framework_stubs

INTEGRATION = "megatron_vocabstats.integrations.skyrl"
MU = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
WRAPPER = "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper"


@pytest.fixture(scope="module")
def skyrl():
    """The skyrl modules (real code, stubbed dependencies) and the integration, applied."""
    yield from _framework_stubs.applied("skyrl", INTEGRATION, "requirements/py311-nodeps.txt")


def test_import_applies_every_binding_and_remove_restores(skyrl):
    modules, integration = skyrl
    integration.remove()
    originals = {b: getattr(modules[b[0]], b[1]) for b in _framework_stubs.bindings(integration)}
    assert all(o.__module__ == MU for o in originals.values()), originals
    importlib.reload(integration)  # the import applies it
    assert len(integration.patched_names()) == len(originals) == 16
    for (module, name), original in originals.items():
        bound = getattr(modules[module], name)
        assert bound is not original and bound.__wrapped__ is original, (module, name)
    assert integration.apply() and len(integration.patched_names()) == 16  # once
    integration.remove()
    assert all(getattr(modules[m], n) is o for (m, n), o in originals.items())
    integration.apply()


def test_every_model_utils_name_the_wrapper_imports_is_covered(skyrl):
    """The wheel's megatron_model_wrapper imports exactly the eight replaced functions from
    model_utils (a new one would compute log-probs or entropy unpatched)."""
    modules, integration = skyrl
    tree = ast.parse(open(modules[WRAPPER].__file__).read())
    imported = {alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == MU
                for alias in node.names}
    assert imported == set(integration.NAMES)


def _remove_name(modules, monkeypatch):
    monkeypatch.delattr(modules[MU], "vocab_parallel_entropy")


def _new_signature(modules, monkeypatch):
    monkeypatch.setattr(modules[MU], "from_parallel_hidden_to_logprobs",
                        lambda hidden, lm_head_weight, target: None)


def _consumer_rebound(modules, monkeypatch):
    monkeypatch.setattr(modules[WRAPPER], "from_parallel_logits_to_logprobs", lambda *a: None)


def _helper_gone(modules, monkeypatch):
    monkeypatch.delattr(modules[MU], "_packed_cp_rank_and_local_indices")


def _not_installed(modules, monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name == "skyrl":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize("move, message", [
    (_remove_name, f"{MU} has no vocab_parallel_entropy"),
    (_new_signature, "from_parallel_hidden_to_logprobs takes ('hidden', 'lm_head_weight', "
                     "'target'), not"),
    (_consumer_rebound, f"{WRAPPER}.from_parallel_logits_to_logprobs is not"),
    (_helper_gone, "has no _packed_cp_rank_and_local_indices (its CP/packing code"),
    (_not_installed, "needs SkyRL (pip install"),
])
def test_moved_names_raise_and_patch_nothing(skyrl, monkeypatch, move, message):
    modules, integration = skyrl
    integration.remove()
    try:
        move(modules, monkeypatch)
        with pytest.raises(integration.UnsupportedSkyRLError, match="SkyRL") as info:
            integration.apply()
        assert message in str(info.value), str(info.value)
        assert isinstance(info.value, ImportError)
        assert not integration.is_applied()
    finally:
        monkeypatch.undo()
        integration.apply()


def test_bad_option_patches_nothing(skyrl):
    _, integration = skyrl
    integration.remove()
    try:
        with pytest.raises(ValueError, match="unknown option"):
            integration.apply(chunk=3)
        assert not integration.is_applied()
    finally:
        integration.apply()


def test_a_window_other_than_megatrons_split_names_the_argument(skyrl):
    modules, _ = skyrl
    logits, target = torch.randn(2, 5, 16), torch.randint(0, 16, (2, 5))
    with pytest.raises(ValueError, match="vocab_start_index"):
        modules[WRAPPER].from_parallel_logits_to_logprobs(logits, target, 3, 19, None)
    out = modules[WRAPPER].from_parallel_logits_to_logprobs(logits, target, 0, 16, None)
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, target[:, 1:, None])[..., 0]
    torch.testing.assert_close(out, ref)
