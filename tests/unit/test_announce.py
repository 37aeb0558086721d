"""The plugin's one log line (megatron_vocabstats.megatron.announce): rank 0, on the first loss
the patched call sites compute, once, saying how the plugin computes. The real training loop's
log is checked in test_megatron_training_dist.py."""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")

from megatron.core.models.common.language_module.language_module import (  # noqa: E402
    LanguageModule,
)

from megatron_vocabstats import version_check  # noqa: E402
from megatron_vocabstats.megatron import announce, compat, settings  # noqa: E402


@pytest.fixture
def patch():
    import megatron_vocabstats.patch as module

    module.apply()
    announce.reset()
    version_check.reset()
    yield module
    module.remove()
    announce.reset()
    version_check.reset()


def _loss(module, steps=1):
    for _ in range(steps):
        LanguageModule.compute_language_model_loss(module, torch.randint(0, 16, (2, 5)),
                                                   torch.randn(5, 2, 16))


def _module(**config):
    fake = torch.nn.Module()
    fake.tp_group = None
    fake.config = SimpleNamespace(**config)
    return fake


def _lines(caplog):
    return [r for r in caplog.records if r.getMessage().startswith("megatron-vocabstats ")
            and " on: " in r.getMessage()]


def test_first_loss_logs_one_line_on_rank0(patch, caplog, monkeypatch):
    from megatron_vocabstats import __version__

    monkeypatch.delenv("VOCABSTATS_KERNEL", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", version_check.UntestedVersionWarning)  # CI's versions
        with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
            _loss(_module(sequence_parallel=False, context_parallel_size=1), steps=3)
    (record,) = _lines(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        f"megatron-vocabstats {__version__} on: unfused (chunk auto), entropy off, kernel auto "
        "-> torch, label smoothing 0.0, checks on, batch invariance off; tp 1, cp 1, sequence "
        f"parallel off; megatron-core {compat.megatron_core_release()}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        _loss(_module())
    assert not _lines(caplog), "logged again: must be once per run"
    announce.reset()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        _loss(_module())
    assert not _lines(caplog), "a rank other than 0 logged"


def test_line_names_the_kernel_variable_that_decided(patch, caplog, monkeypatch):
    """VOCABSTATS_KERNEL under kernel auto: the line says the environment chose the backend; an
    explicit kernel ignores the variable, and the line does not name it."""
    from megatron_vocabstats.ops import kernels

    monkeypatch.setenv("VOCABSTATS_KERNEL", "triton")
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    module = _module(sequence_parallel=False, context_parallel_size=1)
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        announce.once(module, settings.current(), fused=False, device=torch.device("cuda"))
    (record,) = _lines(caplog)
    assert ", kernel auto -> triton (VOCABSTATS_KERNEL=triton), " in record.getMessage()
    assert announce.describe(settings.current()).count("(VOCABSTATS_KERNEL=triton)") == 1
    patch.apply(kernel="torch")
    assert "VOCABSTATS" not in announce.describe(settings.current(), device=torch.device("cuda"))


def test_line_says_how(patch, caplog, monkeypatch):
    patch.apply(lm_head_chunk_size=64, entropy="grad", entropy_coef=0.01, kernel="torch",
                logprobs_chunk_size=32, batch_invariant="tp", validate=False)
    cfg = settings.current()
    assert announce.describe(cfg) == (
        "on: fused LM head (chunk 64 tokens), entropy grad (coef 0.01), kernel torch, label "
        "smoothing 0.0, checks off, batch invariance tp")
    assert announce.describe(cfg, fused=False).startswith("on: unfused (chunk 32 tokens)")
    batch = settings.PluginSettings(batch_invariant=True)
    assert announce.describe(batch).endswith("batch invariance batch")
    assert announce.describe(settings.PluginSettings(active=False)).startswith("off")
    assert announce.layout(_module(sequence_parallel=True, context_parallel_size=2)) == \
        "tp 1, cp 2, sequence parallel on"
    # A torch and a megatron-core outside the supported range: one warning each, once per
    # process; the line itself stays INFO and the plugin runs.
    monkeypatch.setattr(torch, "__version__", "2.16.0a0+nv26.12")
    monkeypatch.setattr(compat, "megatron_core_release", lambda: "0.21.0")
    with pytest.warns(version_check.UntestedVersionWarning) as caught, \
            caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        _loss(_module())
    (record,) = _lines(caplog)
    assert record.levelno == logging.INFO
    messages = sorted(str(w.message) for w in caught
                      if issubclass(w.category, version_check.UntestedVersionWarning))
    assert len(messages) == 2, messages
    assert messages[0].startswith("megatron-core 0.21.0 is outside the supported range "
                                  "megatron-core >=0.16,<0.21 (tested: ")
    assert messages[1].startswith("torch 2.16.0a0+nv26.12 is outside the supported range torch "
                                  ">=2.11,<2.16 (tested: ")
    announce.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", version_check.UntestedVersionWarning)
        _loss(_module())   # the next run's line: the versions were checked in this process
