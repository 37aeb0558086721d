"""The one-line patch, the flag family and the config hook, on the installed megatron-core."""

from __future__ import annotations

import importlib
import logging
import sys
import warnings

import pytest
import torch

pytestmark = pytest.mark.megatron
pytest.importorskip("megatron.core")

from megatron.core.models.common.language_module.language_module import (  # noqa: E402
    LanguageModule,
)

from megatron_vocabstats.megatron import compat, settings  # noqa: E402
from megatron_vocabstats.megatron._patching import _ABSENT as ABSENT  # noqa: E402
from megatron_vocabstats.megatron._patching import MARKER  # noqa: E402

ORIGINAL_LOSS = LanguageModule.__dict__["compute_language_model_loss"]
MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--lr", "1e-4",
              "--train-iters", "1"]


@pytest.fixture
def patch():
    import megatron_vocabstats.patch as module

    module.apply()
    yield module
    module.remove()


def test_import_twice_patches_once_and_remove_restores_exactly(patch):
    from megatron_vocabstats.megatron._patching import PATCHER

    first = LanguageModule.__dict__["compute_language_model_loss"]
    assert getattr(first, MARKER) and first.__wrapped__ is ORIGINAL_LOSS
    names = patch.patched_names()
    bindings = [(r.owner, r.name, getattr(r.owner, r.name), r.original) for r in PATCHER.applied]
    assert len(bindings) >= 2  # the loss method and the GPTModel hook, at least
    importlib.reload(patch)  # a second import executes apply() again
    patch.apply()
    assert patch.patched_names() == names
    assert all(getattr(owner, name) is ours for owner, name, ours, _ in bindings)
    patch.remove()
    for owner, name, _, original in bindings:
        assert vars(owner).get(name, ABSENT) is original, f"{name} not restored"
    assert LanguageModule.__dict__["compute_language_model_loss"] is ORIGINAL_LOSS
    assert not patch.is_applied()
    assert settings.current() == settings.PluginSettings(active=False)


def test_inactive_plugin_runs_megatron_own_loss(patch, monkeypatch):
    from types import SimpleNamespace

    from megatron.core import tensor_parallel

    from megatron_vocabstats.megatron import model as patched_model

    ours, theirs = [], []
    monkeypatch.setattr(patched_model, "vocab_parallel_stats", lambda *a, **k: ours.append(1))
    monkeypatch.setattr(tensor_parallel, "vocab_parallel_cross_entropy",
                        lambda logits, labels, *a, **k: theirs.append(1) or labels.float())
    settings.update(active=False)  # what the config hook does without --vocab-parallel-stats
    fake = torch.nn.Module()
    fake.tp_group = None
    fake.config = SimpleNamespace(cross_entropy_loss_fusion=False)
    LanguageModule.compute_language_model_loss(fake, torch.zeros(1, 2, dtype=torch.long),
                                               torch.randn(2, 1, 4))
    assert theirs == [1] and ours == []


def test_call_site_reaches_ours(patch, monkeypatch):
    from megatron_vocabstats.megatron import model as patched_model

    calls = []
    original = patched_model.vocab_parallel_stats
    monkeypatch.setattr(patched_model, "vocab_parallel_stats",
                        lambda *a, **k: calls.append(k) or original(*a, **k))
    logits = torch.randn(5, 2, 16, requires_grad=True)  # [s, b, V]
    labels = torch.randint(0, 16, (2, 5))  # [b, s]
    fake = torch.nn.Module()  # a LanguageModule instance only needs a tp group here
    fake.tp_group = None
    loss = LanguageModule.compute_language_model_loss(fake, labels, logits)
    assert len(calls) == 1 and loss.shape == (2, 5) and loss.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits.detach().double().permute(1, 2, 0), labels,
                                            reduction="none")
    assert (loss.double() - ref).abs().max().item() <= 1e-5
    assert fake.last_vocab_stats.logprobs.shape == (2, 5)


def test_entropy_bonus_and_label_smoothing_reach_the_loss(patch):
    patch.apply(entropy="grad", entropy_coef=0.1, label_smoothing=0.2)
    logits = torch.randn(4, 1, 32)
    labels = torch.randint(0, 32, (1, 4))
    fake = torch.nn.Module()
    fake.tp_group = None
    loss = LanguageModule.compute_language_model_loss(fake, labels, logits)
    z = logits.double().transpose(0, 1)
    ce = torch.nn.functional.cross_entropy(z.permute(0, 2, 1), labels, reduction="none",
                                           label_smoothing=0.2)
    logp = torch.log_softmax(z, -1)
    expected = ce - 0.1 * -(logp.exp() * logp).sum(-1)
    assert (loss.double() - expected).abs().max().item() <= 1e-5


def test_rank0_logs_once(caplog, monkeypatch):
    import megatron_vocabstats.patch as module

    module.remove()
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        module.apply()
        module.apply()
    patched = [r for r in caplog.records if "patched" in r.getMessage()]
    assert len(patched) == 1 and compat.megatron_core_version() in patched[0].getMessage()
    module.remove()
    monkeypatch.setenv("RANK", "1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        module.apply()
    assert not [r for r in caplog.records if "patched" in r.getMessage()]
    module.remove()


def test_every_loss_path_is_patched_or_its_absence_logged(caplog):
    """HybridModel.forward (0.18+; MambaModel.forward before) and every binding of
    process_mtp_loss (0.17+) are patched (the fused head and MTP heads); where the release lacks
    them, the patch log says so."""
    import megatron_vocabstats.patch as module

    module.remove()
    with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
        module.apply()
    try:
        names, message = module.patched_names(), caplog.records[-1].getMessage()
    finally:
        module.remove()
    hybrid = compat.hybrid_model_class()
    if hybrid is not None:
        assert any(n.endswith(f"{hybrid.__name__}.forward") for n in names)
    else:
        assert "skipped HybridModel / MambaModel" in message
    bindings = compat.mtp_loss_bindings()
    assert sum(n.endswith(".process_mtp_loss") for n in names) == len(bindings)
    if not bindings:
        assert "process_mtp_loss (0.17+): not in this release" in message


def test_unsupported_release_fails_at_import(monkeypatch):
    import megatron_vocabstats.patch as module

    module.remove()
    monkeypatch.delattr(LanguageModule, "compute_language_model_loss")
    with pytest.raises(ImportError, match="compute_language_model_loss"):
        importlib.reload(module)
    monkeypatch.undo()
    importlib.reload(module)
    module.remove()


# ---- flags and the config hook: need megatron.training (the 0.17+ wheel) ----

def _parse(argv, monkeypatch):
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *MODEL_ARGS, *argv])
    return arguments, arguments.parse_args()


def test_flags_parse_through_megatron_parser(patch, monkeypatch):
    _, args = _parse(["--vocab-parallel-stats", "--logprobs-chunk-size", "64",
                      "--lm-head-chunk-size", "512", "--vocab-stats-entropy", "grad",
                      "--entropy-coef", "0.01"], monkeypatch)
    assert args.vocab_parallel_stats and args.logprobs_chunk_size == 64
    assert args.lm_head_chunk_size == 512 and args.vocab_stats_entropy == "grad"
    assert args.entropy_coef == 0.01


def test_require_fused_flag_reaches_the_settings_and_needs_the_fused_head(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--lm-head-chunk-size", "8",
                      "--require-fused-lm-head"], monkeypatch)
    assert config_hook(args).require_fused_lm_head is True
    _, args = _parse(["--vocab-parallel-stats", "--require-fused-lm-head"], monkeypatch)
    with pytest.raises(ValueError, match="--require-fused-lm-head needs the fused LM head"):
        config_hook(args)


def test_extra_args_provider_chains():
    import argparse

    from megatron_vocabstats.megatron.arguments import chain_providers, extra_args_provider

    def other(parser):
        parser.add_argument("--mine", type=int, default=3)
        return parser

    parser = chain_providers(other, extra_args_provider)(argparse.ArgumentParser())
    args = parser.parse_args(["--mine", "4", "--vocab-parallel-stats"])
    assert args.mine == 4 and args.vocab_parallel_stats


def test_config_hook_runs_before_validate_args(patch, monkeypatch):
    # The hook sets string dtypes that only Megatron's validate_args maps to torch dtypes: were
    # the hook to run after it, main_grads_dtype would still be the string "bf16".
    monkeypatch.setattr(compat, "transformer_engine_fused_adam_available", lambda: True)
    arguments, args = _parse(["--vocab-parallel-stats", "--precision-aware-optimizer-bf16",
                              "--bf16", "--use-distributed-optimizer",
                              "--vocab-stats-entropy", "metric"], monkeypatch)
    arguments.validate_args(args, {})
    assert args.use_precision_aware_optimizer
    assert args.main_grads_dtype is torch.bfloat16 and args.exp_avg_dtype is torch.bfloat16
    assert args.exp_avg_sq_dtype is torch.bfloat16
    assert settings.current().active and settings.current().entropy == "metric"


def test_precision_aware_prerequisites_listed_together(patch, monkeypatch):
    monkeypatch.setattr(compat, "transformer_engine_fused_adam_available", lambda: False)
    arguments, args = _parse(["--vocab-parallel-stats", "--precision-aware-optimizer-bf16",
                              "--optimizer", "sgd"], monkeypatch)
    with pytest.raises(ValueError) as err:
        arguments.validate_args(args, {})
    for missing in ("--optimizer adam", "--use-distributed-optimizer", "--bf16", "FusedAdam"):
        assert missing in str(err.value)


@pytest.mark.parametrize("recipe, per_shard", [("tensorwise", 16), ("delayed", 16),
                                               ("mxfp8", 32), ("blockwise", 128)])
def test_fp8_alignment_and_vocab_divisibility(patch, monkeypatch, recipe, per_shard):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--bf16", "--fp8-format", "e4m3",
                      "--fp8-recipe", recipe, "--make-vocab-size-divisible-by", "96",
                      "--tensor-model-parallel-size", "2", "--sequence-parallel",
                      "--context-parallel-size", "2"], monkeypatch)
    config_hook(args)
    assert args.make_vocab_size_divisible_by == 384  # lcm(96, 128)
    # Each of the cp=2 x tp=2 (sequence parallel) shards holds a multiple of the recipe's token
    # count, and every sequence splits into 2 * cp equal chunks: cp * tp * per_shard tokens.
    assert args.vocab_stats_token_alignment == 2 * 2 * per_shard
    assert settings.current().token_alignment == 2 * 2 * per_shard


def test_fp8_without_bf16_is_rejected(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--fp8-format", "hybrid"], monkeypatch)
    with pytest.raises(ValueError, match="--fp8-format needs --bf16"):
        config_hook(args)


@pytest.mark.parametrize("argv, name, value, flag", [
    # a scripted parser's string, under the tp-invariant check and under FP8
    (["--vocab-stats-batch-invariant", "tp"], "tensor_model_parallel_size", "2",
     "--tensor-model-parallel-size"),
    (["--bf16", "--fp8-format", "e4m3"], "tensor_model_parallel_size", "2",
     "--tensor-model-parallel-size"),
    (["--bf16", "--fp8-format", "e4m3"], "context_parallel_size", 0, "--context-parallel-size"),
    (["--bf16", "--fp8-format", "e4m3"], "make_vocab_size_divisible_by", None,
     "--make-vocab-size-divisible-by"),
    (["--vocab-stats-batch-invariant", "tp", "--tensor-model-parallel-size", "2"],
     "make_vocab_size_divisible_by", 128.0, "--make-vocab-size-divisible-by"),
    (["--bf16", "--fp8-format", "e4m3"], "fp8_recipe", ["mxfp8"], "--fp8-recipe"),
])
def test_config_hook_refuses_megatron_values_set_without_the_parser(patch, monkeypatch, argv,
                                                                   name, value, flag):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", *argv], monkeypatch)
    setattr(args, name, value)
    with pytest.raises(ValueError, match=f"^{flag} ") as err:
        config_hook(args)
    assert repr(value) in str(err.value)


def test_conflicting_flags_name_both(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--cross-entropy-loss-fusion"], monkeypatch)
    with pytest.raises(ValueError, match="--vocab-parallel-stats.*--cross-entropy-loss-fusion"):
        config_hook(args)
    _, args = _parse(["--vocab-parallel-stats", "--entropy-coef", "0.1"], monkeypatch)
    with pytest.raises(ValueError, match="--entropy-coef.*--vocab-stats-entropy grad"):
        config_hook(args)


def test_our_flags_without_the_switch_warn_and_turn_off(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--logprobs-chunk-size", "8"], monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config_hook(args)
    assert any("--logprobs-chunk-size" in str(w.message) for w in caught)
    assert not settings.current().active


@pytest.mark.parametrize("argv, mode", [([], False), (["--vocab-stats-batch-invariant"], True),
                                        (["--vocab-stats-batch-invariant", "tp"], "tp")])
def test_batch_invariant_flag_reaches_the_settings(patch, monkeypatch, argv, mode):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", *argv], monkeypatch)
    config_hook(args)
    assert settings.current().batch_invariant is mode or settings.current().batch_invariant == mode
    with pytest.raises(ValueError, match="batch_invariant"):
        settings.update(batch_invariant="yes")


def _record_op_keywords(monkeypatch) -> dict:
    """Let the patched call sites' ``vocab_parallel_stats`` record the keywords they pass."""
    from megatron_vocabstats.megatron import model

    seen = {}
    original = model.vocab_parallel_stats

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "vocab_parallel_stats", recording)
    return seen


def test_batch_invariant_setting_reaches_the_op(patch, monkeypatch):
    seen = _record_op_keywords(monkeypatch)
    patch.apply(batch_invariant="tp")
    fake = torch.nn.Module()
    fake.tp_group = None
    logits = torch.randn(4, 1, 32)
    loss = LanguageModule.compute_language_model_loss(fake, torch.randint(0, 32, (1, 4)), logits)
    assert seen["batch_invariant"] == "tp" and loss.shape == (1, 4)


def test_kernel_flag_reaches_the_settings_and_the_unfused_op(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--vocab-stats-kernel", "torch"], monkeypatch)
    config_hook(args)
    assert settings.current().kernel == "torch"
    assert settings.current().stats_options().kernel == "torch"
    assert settings.current().stats_options(fused=True).kernel == "torch"
    with pytest.raises(ValueError, match="kernel must be one of"):
        settings.update(kernel="cuda")
    seen = _record_op_keywords(monkeypatch)
    fake = torch.nn.Module()
    fake.tp_group = None
    loss = LanguageModule.compute_language_model_loss(fake, torch.randint(0, 32, (1, 4)),
                                                      torch.randn(4, 1, 32))
    assert seen["kernel"] == "torch" and loss.shape == (1, 4)


def test_full_cuda_graph_reset_drops_the_workspace(patch):
    from megatron_vocabstats.megatron import compat
    from megatron_vocabstats.ops.workspace import WORKSPACE

    wrapper = compat.full_cuda_graph_wrapper_class()
    if wrapper is None:
        pytest.skip(f"megatron-core {compat.megatron_core_version()} has no FullCudaGraphWrapper.reset_cuda_graph")
    assert getattr(wrapper.reset_cuda_graph, MARKER)
    WORKSPACE.give(WORKSPACE.take((4, 8), torch.float32, torch.device("cpu")))
    assert WORKSPACE.cached()[0] >= 1
    wrapper.reset_cuda_graph(None)  # class-level state only; self is unused
    assert WORKSPACE.cached() == (0, 0)
    patch.remove()
    assert not hasattr(wrapper.reset_cuda_graph, MARKER)


@pytest.mark.parametrize("extra, error", [
    (["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"], True),
    (["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256"], False),
    (["--make-vocab-size-divisible-by", "64"], False),  # tp = 1: any width is padded inside
])
def test_tp_invariant_mode_checks_vocab_padding_at_config_time(patch, monkeypatch, extra, error):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--vocab-stats-batch-invariant", "tp", *extra],
                     monkeypatch)
    if error:
        with pytest.raises(ValueError, match="--make-vocab-size-divisible-by.*got 64"):
            config_hook(args)
    else:
        assert config_hook(args).batch_invariant == "tp"


def test_tp_invariant_mode_with_fused_head_warns(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", "--vocab-stats-batch-invariant", "tp",
                      "--lm-head-chunk-size", "256"], monkeypatch)
    with pytest.warns(UserWarning, match="not tp-invariant"):
        config_hook(args)


# ---- bad values of the plugin's own flags: refused by the parser, and by the hook ----

@pytest.mark.parametrize("flag, value", [("--lm-head-chunk-size", "-1"),
                                         ("--logprobs-chunk-size", "-8"),
                                         ("--lm-head-chunk-size", "1.5"),
                                         ("--entropy-coef", "nan"), ("--entropy-coef", "inf"),
                                         ("--vocab-stats-label-smoothing", "1"),
                                         ("--vocab-stats-label-smoothing", "nan")])
def test_bad_flag_values_stop_megatron_parser(patch, monkeypatch, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        _parse(["--vocab-parallel-stats", flag, value], monkeypatch)
    assert exit_.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err


@pytest.mark.parametrize("switch", [["--vocab-parallel-stats"], []])
@pytest.mark.parametrize("name, value, message", [
    ("lm_head_chunk_size", -4, "--lm-head-chunk-size must be an int in [0, 2**63 - 1], got -4"),
    ("logprobs_chunk_size", "64", "--logprobs-chunk-size must be an int in [0, 2**63 - 1], got '64'"),
    ("entropy_coef", float("nan"), "--entropy-coef must be a finite number, got nan"),
    ("vocab_stats_label_smoothing", 1.0,
     "--vocab-stats-label-smoothing must be a finite number in [0, 1)"),
    ("vocab_stats_entropy", "yes", "--vocab-stats-entropy must be one of"),
    ("vocab_stats_batch_invariant", "maybe", "--vocab-stats-batch-invariant must be one of"),
    ("vocab_stats_kernel", "cuda", "--vocab-stats-kernel must be one of"),
])
def test_config_hook_refuses_values_set_without_the_parser(patch, monkeypatch, switch, name,
                                                           value, message):
    # A YAML config or a script sets args directly: the hook checks them before validate_args.
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse([*switch, "--vocab-stats-entropy", "grad"], monkeypatch)
    setattr(args, name, value)
    with pytest.raises(ValueError) as err:
        config_hook(args)
    assert message in str(err.value)


@pytest.mark.parametrize("changes, error, message", [
    (dict(entropy="grad", entropy_coef=float("nan")), ValueError, "entropy_coef must be a finite number, got nan"),
    (dict(label_smoothing=float("nan")), ValueError, r"label_smoothing must be a finite number in \[0, 1\), got nan"),
    (dict(lm_head_chunk_size=1.5), TypeError, "lm_head_chunk_size must be an int"),
    (dict(lm_head_chunk_size=-1), ValueError, "lm_head_chunk_size must be an int in"),
    (dict(logprobs_chunk_size=0), ValueError, "logprobs_chunk_size must be an int in .* or None"),
    (dict(token_alignment=0), ValueError, "token_alignment must be an int in"),
    (dict(vocab_size=0), ValueError, "vocab_size must be an int in"),
    (dict(validate="no"), TypeError, "validate must be a bool"),
    (dict(require_fused_lm_head=1, lm_head_chunk_size=8), TypeError,
     "require_fused_lm_head must be a bool"),
    (dict(require_fused_lm_head=True), ValueError, "require_fused_lm_head=True needs the fused"),
])
def test_settings_refuse_bad_fields(changes, error, message):
    with pytest.raises(error, match=message):
        settings.PluginSettings(**changes)


# ---- the rollout flags: the sampler replayed and the mismatch correction ----

def test_rollout_flags_defaults_are_off(patch, monkeypatch):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats"], monkeypatch)
    assert (args.rollout_temperature, args.rollout_top_k, args.rollout_top_p,
            args.rollout_min_p) == (1.0, None, 1.0, 0.0)
    assert (args.rollout_correction, args.rollout_correction_level) == ("none", "token")
    assert args.rollout_correction_threshold is None
    assert args.rollout_correction_low is None and args.rollout_correction_high is None
    current = config_hook(args)
    assert current.rollout_correction() is None
    assert current.sampler_options() == {"temperature": 1.0, "top_k": None, "top_p": None,
                                         "min_p": None}


@pytest.mark.parametrize("switch", [["--vocab-parallel-stats"], []])
def test_rollout_flags_reach_the_settings_and_builders(patch, monkeypatch, switch):
    from megatron_vocabstats import RolloutCorrection
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse([*switch, "--rollout-temperature", "0.7", "--rollout-top-k", "50",
                      "--rollout-top-p", "0.9", "--rollout-min-p", "0.05",
                      "--rollout-correction", "tis", "--rollout-correction-level", "sequence",
                      "--rollout-correction-threshold", "3"], monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rollout flags are not "ignored" without the switch
        current = config_hook(args)
    assert current.active == bool(switch)
    assert (current.rollout_temperature, current.rollout_top_k, current.rollout_top_p,
            current.rollout_min_p) == (0.7, 50, 0.9, 0.05)
    # (validate: the settings' own, on unless --vocab-stats-skip-checks)
    assert current.rollout_correction() == RolloutCorrection(mode="tis", level="sequence",
                                                             threshold=3.0, validate=True)
    assert current.sampler_options() == {"temperature": 0.7, "top_k": 50, "top_p": 0.9,
                                         "min_p": 0.05}


@pytest.mark.parametrize("argv, want", [
    (["--rollout-correction", "mis"], dict(mode="mis", low=0.5, high=2.0)),
    (["--rollout-correction", "mis", "--rollout-correction-high", "4"],
     dict(mode="mis", low=0.25, high=4.0)),
    (["--rollout-correction", "icepop"], dict(mode="icepop", low=0.5, high=5.0)),
    (["--rollout-correction", "icepop", "--rollout-correction-low", "0.8",
      "--rollout-correction-high", "1.5"], dict(mode="icepop", low=0.8, high=1.5)),
    (["--rollout-correction", "tis"], dict(mode="tis", threshold=2.0)),
])
def test_rollout_correction_builder(patch, monkeypatch, argv, want):
    from megatron_vocabstats import RolloutCorrection, policy_loss
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", *argv], monkeypatch)
    built = config_hook(args).rollout_correction()
    assert built == RolloutCorrection(**want, validate=True)
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    out = policy_loss(lp, lp, torch.ones(1, 3), torch.ones(1, 3), rollout_logprobs=lp - 0.1,
                      rollout_correction=built)
    assert "rollout k3 kl" in out[2]


def test_top_k_minus_one_is_off(patch, monkeypatch):
    _, args = _parse(["--rollout-top-k", "-1"], monkeypatch)
    assert args.rollout_top_k is None


def test_sampler_options_reach_the_sampling_op(patch, monkeypatch):
    from megatron_vocabstats import vocab_parallel_sampling_logprobs
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--rollout-top-k", "2", "--rollout-temperature", "0.5"], monkeypatch)
    options = config_hook(args).sampler_options()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    got = vocab_parallel_sampling_logprobs(logits, torch.tensor([1]), **options)
    want = torch.log_softmax(logits[0, :2] / 0.5, -1)[1]
    torch.testing.assert_close(got.logprobs[0], want)
    assert not got.outside.any()
    assert vocab_parallel_sampling_logprobs(logits, torch.tensor([2]), **options).outside.all()


@pytest.mark.parametrize("flag, value", [("--rollout-temperature", "0"),
                                         ("--rollout-temperature", "nan"),
                                         ("--rollout-top-k", "0"), ("--rollout-top-k", "-2"),
                                         ("--rollout-top-k", "1.5"),
                                         ("--rollout-top-p", "0"), ("--rollout-top-p", "1.1"),
                                         ("--rollout-min-p", "1"), ("--rollout-min-p", "-0.1"),
                                         ("--rollout-correction-threshold", "0"),
                                         ("--rollout-correction-low", "0"),
                                         ("--rollout-correction-low", "1.5"),
                                         ("--rollout-correction-high", "0.9")])
def test_bad_rollout_flag_values_stop_megatron_parser(patch, monkeypatch, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        _parse([flag, value], monkeypatch)
    assert exit_.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_unknown_rollout_correction_stops_megatron_parser(patch, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parse(["--rollout-correction", "is"], monkeypatch)
    assert "argument --rollout-correction: invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rollout-correction-threshold", "3"],
     "--rollout-correction-threshold applies to --rollout-correction tis"),
    (["--rollout-correction", "mis", "--rollout-correction-threshold", "3"],
     "--rollout-correction-threshold applies to --rollout-correction tis"),
    (["--rollout-correction", "tis", "--rollout-correction-high", "3"],
     "--rollout-correction-high applies to --rollout-correction mis or icepop"),
    (["--rollout-correction", "icepop", "--rollout-correction-level", "sequence"],
     "--rollout-correction icepop is token level only"),
    (["--rollout-correction", "mis", "--rollout-correction-low", "1",
      "--rollout-correction-high", "1"], "--rollout-correction mis with --rollout-correction-low"),
])
def test_rollout_correction_combinations_refused_naming_the_flags(patch, monkeypatch, argv,
                                                                  message):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats", *argv], monkeypatch)
    with pytest.raises(ValueError) as err:
        config_hook(args)
    assert message in str(err.value)


@pytest.mark.parametrize("name, value, message", [
    ("rollout_temperature", 0.0, "--rollout-temperature must be a finite number > 0"),
    ("rollout_top_k", 0, "--rollout-top-k must be an int >= 1, got 0 (or -1 = off)"),
    ("rollout_top_p", 2.0, "--rollout-top-p must be a finite number in (0, 1]"),
    ("rollout_correction", "yes", "--rollout-correction must be one of"),
    ("rollout_correction_level", "row", "--rollout-correction-level must be one of"),
])
def test_config_hook_refuses_rollout_values_set_without_the_parser(patch, monkeypatch, name,
                                                                   value, message):
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats"], monkeypatch)
    setattr(args, name, value)
    with pytest.raises(ValueError) as err:
        config_hook(args)
    assert message in str(err.value)


@pytest.mark.parametrize("changes, error, message", [
    (dict(rollout_temperature=-1.0), ValueError, "rollout_temperature must be a finite number > 0"),
    (dict(rollout_top_k=0), ValueError, "rollout_top_k must be an int >= 1 or None"),
    (dict(rollout_top_p=0.0), ValueError, r"rollout_top_p must be a finite number in \(0, 1\] or None"),
    (dict(rollout_min_p=1.0), ValueError, r"rollout_min_p must be a finite number in \[0, 1\) or None"),
    (dict(rollout_correction_mode="is"), ValueError, "rollout_correction_mode must be one of"),
    (dict(rollout_correction_low=0.5), ValueError, "rollout_correction_low needs a"),
    (dict(rollout_correction_mode="tis", rollout_correction_threshold=-1.0), ValueError,
     "threshold must be a finite number > 0"),
])
def test_settings_refuse_bad_rollout_fields(changes, error, message):
    with pytest.raises(error, match=message):
        settings.PluginSettings(**changes)


# ---- what the config hook catches itself ----


def test_config_hook_reads_a_minus_one_top_k_as_off(patch, monkeypatch):
    """--rollout-top-k -1 is documented as off; set without the parser (a YAML config) it was
    refused with a message about the rollout correction."""
    from megatron_vocabstats.megatron.arguments import config_hook

    _, args = _parse(["--vocab-parallel-stats"], monkeypatch)
    args.rollout_top_k = -1
    assert config_hook(args).rollout_top_k is None
    assert config_hook(args).sampler_options()["top_k"] is None


def test_config_hook_refuses_a_triton_kernel_that_cannot_run(patch, monkeypatch):
    """Without a GPU (and outside Triton's interpreter) kernel triton is refused when the
    arguments are checked, naming the flag, not at the first forward after the model is
    built."""
    import torch

    from megatron_vocabstats.megatron.arguments import config_hook

    for name in ("TRITON_INTERPRET", "VOCABSTATS_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, args = _parse(["--vocab-parallel-stats", "--vocab-stats-kernel", "triton"], monkeypatch)
    with pytest.raises(ValueError, match="--vocab-stats-kernel triton: kernel='triton' needs"):
        config_hook(args)
    args.vocab_stats_kernel = "auto"
    monkeypatch.setenv("VOCABSTATS_KERNEL", "triton")
    with pytest.raises(ValueError, match="--vocab-stats-kernel auto: VOCABSTATS_KERNEL=triton"):
        config_hook(args)


def test_schedule_plan_without_output_processor_is_named_or_refused():
    """A release whose ``forward`` takes the output processor but whose ``build_schedule_plan``
    does not (none is released yet) runs Megatron's own plan, and the fused head's absence is
    reported, or refused under ``require_fused_lm_head``; a logits request is left alone."""
    from megatron_vocabstats.megatron import model

    built = []

    class Model:
        def build_schedule_plan(self, input_ids, position_ids, attention_mask, labels=None,
                                inference_context=None):
            built.append(labels)
            return "plan"

    plan = model.make_unfused_schedule_plan(Model.build_schedule_plan)
    labels = torch.zeros(1, 4, dtype=torch.long)
    try:
        settings.update(active=True, lm_head_chunk_size=8, require_fused_lm_head=True)
        with pytest.raises(ValueError, match="build_schedule_plan takes no output_processor"):
            plan(Model(), None, None, None, labels=labels)
        assert plan(Model(), None, None, None) == "plan"  # logits: nothing to fuse
        settings.update(require_fused_lm_head=False)
        assert plan(Model(), None, None, None, labels=labels) == "plan"
    finally:
        settings.reset()
    assert built == [None, labels]
