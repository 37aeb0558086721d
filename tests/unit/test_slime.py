"""The slime integration (``megatron_vocabstats.integrations.slime``) in one process, on the
stand-in of ``_slime_standin`` (slime ships no installable package): what it replaces and
restores, slime's ``--custom-megatron-init-path`` hook, its errors without slime or on a release
whose names moved (nothing patched), its input errors, the note it logs and its option checks.
Values against float64 and the stand-in at tp 1 and tp 2: ``test_slime_dist.py``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import pytest
import torch

import _slime_standin

INTEGRATION = "megatron_vocabstats.integrations.slime"
PPO, LOSS = "slime.utils.ppo_utils", "slime.backends.megatron_utils.loss"
NAME = "calculate_log_probs_and_entropy"


@pytest.fixture
def slime():
    """The stand-in's modules and the integration, imported (which applies it)."""
    modules = _slime_standin.install()
    integration = importlib.import_module(INTEGRATION)
    integration.apply()
    try:
        yield modules, integration
    finally:
        integration.remove()
        _slime_standin.uninstall()


def test_both_bindings_replaced_and_restored(slime):
    modules, integration = slime
    original = _slime_standin.calculate_log_probs_and_entropy
    for module in (PPO, LOSS):
        fn = getattr(modules[module], NAME)
        assert fn.__module__.endswith("slime_ops") and fn.__wrapped__ is original, module
    assert sorted(integration.patched_names()) == [f"{LOSS}.{NAME}", f"{PPO}.{NAME}"]
    assert integration.apply() is not None and len(integration.patched_names()) == 2
    integration.remove()
    assert not integration.is_applied()
    assert all(getattr(modules[m], NAME) is original for m in (PPO, LOSS))


def test_custom_megatron_init_hook(slime, caplog):
    """slime runs ``load_function(path)(args)``: import the module part, take ``apply``, call it
    with slime's argument namespace."""
    modules, integration = slime
    integration.remove()
    path = f"{INTEGRATION}.apply"
    module_path, _, attr = path.rpartition(".")
    hook = getattr(importlib.import_module(module_path), attr)
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        hook(argparse.Namespace(rollout_temperature=1.0, log_probs_chunk_size=-1))
    assert integration.is_applied()
    assert f"{LOSS}.{NAME} for slime 0.3.1" in caplog.text
    assert getattr(modules[LOSS], NAME).__module__.endswith("slime_ops")


def test_ours_runs_and_notes_once(slime, caplog):
    modules, _ = slime
    logits = torch.randn(5, 8)
    with caplog.at_level(logging.WARNING, logger="megatron_vocabstats"):
        for _ in range(2):
            lp, ent = getattr(modules[LOSS], NAME)(logits, torch.arange(5), None,
                                                  with_entropy=True)
    assert caplog.text.count("calculate_log_probs_and_entropy runs on vocab_parallel_stats") == 1
    theirs_lp, theirs_ent = _slime_standin.calculate_log_probs_and_entropy(
        logits, torch.arange(5), None, with_entropy=True)
    assert (lp.shape, lp.dtype, ent.shape) == (theirs_lp.shape, theirs_lp.dtype, theirs_ent.shape)
    torch.testing.assert_close(lp, theirs_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, theirs_ent, rtol=0, atol=1e-5)


def test_missing_slime_names_it():
    _slime_standin.uninstall()
    sys.modules.pop(INTEGRATION, None)
    with pytest.raises(ImportError, match="slime"):
        importlib.import_module(INTEGRATION)


def _moved(logits, tokens, tp_group, with_entropy=False, chunk_size=-1):
    raise AssertionError("not called")


def _other(logits, tokens, tp_group, with_entropy=False, chunk_size=-1, log_prob_keep_mask=None,
           with_entropy_grad=True):
    raise AssertionError("not called")


@pytest.mark.parametrize("where, fn, untouched, match", [
    (PPO, _moved, LOSS, r"slime 0\.3\.1: slime\.utils\.ppo_utils\.calculate_log_probs_and_entropy "
                        r"takes"),
    (LOSS, _other, PPO, "loss.calculate_log_probs_and_entropy is not"),
], ids=["signature moved", "consumer bound elsewhere"])
def test_moved_names_patch_nothing(where, fn, untouched, match):
    modules = _slime_standin.install()
    try:
        setattr(modules[where], NAME, fn)
        sys.modules.pop(INTEGRATION, None)
        with pytest.raises(ImportError, match=match):
            importlib.import_module(INTEGRATION)
        assert getattr(modules[untouched], NAME) is _slime_standin.calculate_log_probs_and_entropy
    finally:
        _slime_standin.uninstall()
        sys.modules.pop(INTEGRATION, None)


def test_options(slime):
    _, integration = slime
    with pytest.raises(ValueError, match="unknown option"):
        integration.apply(chunk=3)
    with pytest.raises((TypeError, ValueError), match="vocab_size"):
        integration.apply(vocab_size=0)
    settings = integration.apply(argparse.Namespace(), vocab_size=6, logprobs_chunk_size=2)
    assert (settings.vocab_size, settings.logprobs_chunk_size) == (6, 2)


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.randn(2, 3, 4)), "logits"),
    (dict(tokens=torch.zeros(3, dtype=torch.long)), "tokens"),
    (dict(tokens=torch.zeros(4)), "tokens"),
    (dict(log_prob_keep_mask=torch.ones(4, 8)), "log_prob_keep_mask"),
    (dict(log_prob_keep_mask=torch.ones(4, 7, dtype=torch.bool)), "log_prob_keep_mask"),
])
def test_bad_input_names_the_argument(slime, bad, match):
    modules, _ = slime
    call = dict(logits=torch.randn(4, 8), tokens=torch.zeros(4, dtype=torch.long), tp_group=None)
    call.update(bad)
    with pytest.raises(ValueError, match=match):
        getattr(modules[LOSS], NAME)(**call)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_empty_row_as_slime(slime, with_entropy):
    modules, _ = slime
    logits = torch.randn(0, 8, dtype=torch.bfloat16)
    tokens = torch.zeros(0, dtype=torch.long)
    ours = getattr(modules[LOSS], NAME)(logits, tokens, None, with_entropy=with_entropy)
    theirs = _slime_standin.calculate_log_probs_and_entropy(logits, tokens, None,
                                                            with_entropy=with_entropy)
    for o, t in zip(ours, theirs):
        assert (o is None) == (t is None)
        if o is not None:
            assert (o.shape, o.dtype) == (t.shape, t.dtype) == ((0,), torch.bfloat16)
