"""The NeMo-RL integration (``megatron_vocabstats.integrations.nemo_rl``) in one process, on the
stand-in of ``_nemo_rl_standin`` (NeMo-RL ships no installable package): what it replaces and
restores, its errors without NeMo-RL or on a release whose names moved (nothing patched), the
cases it leaves to NeMo-RL, the notes it logs and its option checks. Values at tp 1, tp 2 and
cp 2: ``test_nemo_rl_dist.py``.
"""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

import _nemo_rl_standin

INTEGRATION = "megatron_vocabstats.integrations.nemo_rl"
MU = "nemo_rl.distributed.model_utils"


@pytest.fixture
def nemo_rl():
    """The stand-in's modules and the integration, imported (which applies it)."""
    modules = _nemo_rl_standin.install()
    integration = importlib.import_module(INTEGRATION)
    integration.apply()
    yield modules, integration  # pytest runs the rest even when the test fails
    integration.remove()
    _nemo_rl_standin.uninstall()


def _bindings(integration):
    return ([(m, n) for m, names in integration.DEFINITIONS.items() for n in names]
            + [(m, n) for m, names in integration.CONSUMERS.items() for n in names])


def test_every_binding_replaced_and_restored(nemo_rl):
    modules, integration = nemo_rl
    originals = {(m, n): getattr(modules[m], n).__wrapped__ for m, n in _bindings(integration)}
    assert len(originals) == 12 and integration.is_applied()
    for (m, n), original in originals.items():
        assert getattr(modules[m], n).__module__.endswith("nemo_rl_ops"), (m, n)
        assert original is getattr(_nemo_rl_standin, n), (m, n)
    assert integration.apply() is not None and len(integration.patched_names()) == 12
    integration.remove()
    for (m, n), original in originals.items():
        assert getattr(modules[m], n) is original
    integration.apply()


def test_missing_nemo_rl_names_it():
    _nemo_rl_standin.uninstall()
    sys.modules.pop(INTEGRATION, None)
    with pytest.raises(ImportError, match="NeMo-RL"):
        importlib.import_module(INTEGRATION)


def test_moved_binding_patches_nothing(nemo_rl):
    modules, integration = nemo_rl
    integration.remove()
    mu = modules[MU]
    saved = mu.distributed_vocab_topk
    mu.distributed_vocab_topk = lambda vocab_parallel_logits, k, group: None
    try:
        with pytest.raises(integration.UnsupportedNemoRLError,
                           match=r"distributed_vocab_topk takes .*'group'.*not .*'tp_group'"):
            integration.apply()
        assert not integration.is_applied()
        name = "from_parallel_logits_to_logprobs"
        assert getattr(mu, name) is getattr(_nemo_rl_standin, name)
    finally:
        mu.distributed_vocab_topk = saved
    del modules["nemo_rl.models.megatron.train"].from_parallel_logits_to_logprobs
    with pytest.raises(integration.UnsupportedNemoRLError, match="train has no "
                       "from_parallel_logits_to_logprobs"):
        integration.apply()
    assert not integration.is_applied()


def test_left_to_nemo_rl_and_logged(nemo_rl, caplog):
    """Single-device logits go to NeMo-RL's own function; a vocab-parallel call logs its note
    once; bad ranges and options name the argument."""
    modules, integration = nemo_rl
    logits, ids = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    loss = modules["nemo_rl.algorithms.loss.utils"]
    out = loss.get_next_token_logprobs_from_logits(ids, logits)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.equal(out, ref)
    assert integration.apply.__module__ == INTEGRATION
    with pytest.raises(ValueError, match="unknown option"):
        integration.apply(chunk=3)
    topk = modules["nemo_rl.models.megatron.train"].distributed_vocab_topk
    with caplog.at_level(logging.WARNING, "megatron_vocabstats"):
        with pytest.raises(ValueError, match="vocab_end_index=9"):
            topk(logits, 2, None, vocab_start_index=0, vocab_end_index=9)
        vals, idx = topk(logits, 2, None, vocab_start_index=0, vocab_end_index=7)
        topk(logits, 2, None, vocab_start_index=0, vocab_end_index=7)
    assert torch.equal(vals, logits.topk(2).values) and torch.equal(idx, logits.topk(2).indices)
    notes = [r for r in caplog.records if "distributed_vocab_topk" in r.getMessage()]
    assert len(notes) == 1 and "lowest id first" in notes[0].getMessage()
