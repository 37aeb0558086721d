"""The verl integration (``megatron_vocabstats.integrations.verl``) on verl's real modules from
the installed verl wheel (loaded by ``_framework_stubs`` without verl's heavy dependencies), in one
process: what it replaces and restores, the bindings it must cover in the pinned wheel, its
errors on a release whose names moved, the differences it logs, and the fused path (tp = 1)
against float64. The tp = 2 cases and verl's own functions: ``test_verl_dist.py``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import logging
import pathlib
import sys

import pytest
import torch

import _framework_stubs
from _reference import (
    UNIT_ROUNDOFF,
    assert_within,
    linear_logits_error,
    reference_stats,
    stats_bounds,
)

INTEGRATION = "megatron_vocabstats.integrations.verl"
T_PROC = "verl.utils.megatron.tensor_parallel"
ENGINE = "verl.workers.engine.megatron.transformer_impl"
FUSED = "verl.models.mcore.model_forward_fused"
LCE = "verl.utils.kernel.linear_cross_entropy"


@pytest.fixture(scope="module")
def verl():
    """The verl modules (real code, stubbed dependencies) and the integration, applied."""
    yield from _framework_stubs.applied("verl", INTEGRATION, "requirements/py312-nodeps.txt")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _is_verl_original(obj) -> bool:
    owner = getattr(obj, "__self__", None)
    return (getattr(owner, "__name__", None) == "LinearCrossEntropy"
            or getattr(obj, "__module__", "") == T_PROC)


def test_import_applies_every_binding_and_remove_restores(verl):
    modules, integration = verl
    from megatron_vocabstats.megatron._patching import Patcher

    integration.remove()
    assert not integration.is_applied()
    originals = {b: getattr(modules[b[0]], b[1]) for b in _framework_stubs.bindings(integration)}
    assert all(_is_verl_original(o) for o in originals.values()), originals
    importlib.reload(integration)  # the import applies it
    assert len(integration.patched_names()) == len(originals) == 9
    for (module, name), original in originals.items():
        current = getattr(modules[module], name)
        assert Patcher.is_ours(current) and current.__wrapped__ is original, (module, name)
    restored = integration.remove()
    assert sorted(restored) == sorted(f"{m}.{n}" for m, n in originals)
    assert all(getattr(modules[m], n) is o for (m, n), o in originals.items())
    assert integration.remove() == [] and not integration.is_applied()
    integration.apply()


def test_apply_twice_patches_once_and_replaces_the_options(verl):
    modules, integration = verl
    from megatron_vocabstats.integrations import verl_ops

    integration.apply()
    before = {b: getattr(modules[b[0]], b[1]) for b in _framework_stubs.bindings(integration)}
    settings = integration.apply(logprobs_chunk_size=7, validate=False)
    assert settings is verl_ops.OPTIONS.settings and settings.logprobs_chunk_size == 7
    assert all(getattr(modules[m], n) is obj for (m, n), obj in before.items())
    assert len(integration.patched_names()) == 9
    integration.apply()
    assert verl_ops.OPTIONS.settings.logprobs_chunk_size is None and verl_ops.OPTIONS.settings.validate


@pytest.mark.parametrize("options, error", [
    (dict(entropy_coef=0.1), "unknown option"),
    (dict(validate="yes"), "validate must be a bool"),
    (dict(kernel="cuda"), "kernel must be one of"),
    (dict(lm_head_chunk_size=-1), r"lm_head_chunk_size must be an int in \[0, "),
])
def test_bad_option_raises_and_patches_nothing(verl, options, error):
    modules, integration = verl
    integration.remove()
    try:
        with pytest.raises((TypeError, ValueError), match=error):
            integration.apply(**options)
        assert not integration.is_applied()
        assert all(_is_verl_original(getattr(modules[m], n))
                   for m, n in _framework_stubs.bindings(integration))
    finally:
        integration.apply()


def _import_time_nodes(node):
    """The statements of a module that run at import (function bodies excluded)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield child
        yield from _import_time_nodes(child)


def test_every_import_of_a_replaced_name_in_the_wheel_is_covered(verl):
    """Every verl module that binds a replaced name at import (``from <definition> import
    <name>``) is in CONSUMERS with exactly those names; imports inside functions read the
    definition module at call time, which is patched."""
    _, integration = verl
    root = pathlib.Path(_framework_stubs.root("verl"))
    replaced = {name for names in integration.DEFINITIONS.values() for name in names}
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if not any(name in text for name in replaced):
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in _import_time_nodes(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            names = set(integration.DEFINITIONS.get(source, ())) & {a.name for a in node.names}
            if names:
                found.setdefault(module, set()).update(names)
    assert found == {m: set(names) for m, names in integration.CONSUMERS.items()}


def _remove_name(modules, monkeypatch):
    monkeypatch.delattr(modules[T_PROC], "vocab_parallel_entropy")


def _consumer_gone(modules, monkeypatch):
    monkeypatch.setitem(sys.modules, "verl.models.mcore.model_forward_1f1b_overlap", None)


def _new_signature(modules, monkeypatch):
    monkeypatch.setattr(modules[T_PROC], "vocab_parallel_log_probs_from_logits",
                        lambda logits, labels, tp_group=None: None)


def _consumer_rebound(modules, monkeypatch):
    monkeypatch.setattr(modules[ENGINE], "vocab_parallel_entropy",
                        lambda vocab_parallel_logits: None)


def _not_installed(modules, monkeypatch):
    def version(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", version)


@pytest.mark.parametrize("move, message", [
    (_remove_name, f"verl 0.9.1: {T_PROC} has no vocab_parallel_entropy"),
    (_consumer_gone, "cannot import verl.models.mcore.model_forward_1f1b_overlap"),
    (_new_signature, "vocab_parallel_log_probs_from_logits takes ('logits', 'labels', "
                     "'tp_group'), not ('logits', 'labels')"),
    (_consumer_rebound, f"{ENGINE}.vocab_parallel_entropy is not {T_PROC}.vocab_parallel_entropy"),
    (_not_installed, "needs verl"),
], ids=["name_removed", "consumer_gone", "new_signature", "consumer_rebound", "not_installed"])
def test_moved_names_raise_and_patch_nothing(verl, monkeypatch, move, message):
    """A release whose modules, names or signatures moved: UnsupportedVerlError (an ImportError)
    saying what moved, at import and from apply(), and nothing patched."""
    modules, integration = verl
    integration.remove()
    try:
        move(modules, monkeypatch)
        with pytest.raises(integration.UnsupportedVerlError) as info:
            integration.apply()
        assert message in str(info.value), str(info.value)
        assert isinstance(info.value, ImportError)
        assert not integration.is_applied()
        with pytest.raises(ImportError, match=message.replace("(", r"\(").replace(")", r"\)")):
            importlib.reload(integration)
        assert not integration.is_applied()
        for m, n in _framework_stubs.bindings(integration):
            obj = getattr(modules[m], n, None)
            assert obj is None or not hasattr(obj, "__wrapped__"), (m, n)
    finally:
        monkeypatch.undo()
        importlib.reload(integration)


def test_untested_release_warns_once_names_match(verl, monkeypatch, caplog):
    _, integration = verl
    integration.remove()
    monkeypatch.setattr(integration.FRAMEWORK, "version_of", lambda: "0.10.0")
    with caplog.at_level(logging.WARNING, logger="megatron_vocabstats"):
        integration.apply()
    assert integration.is_applied()
    assert "verl 0.10.0 is not a release this integration was tested with (0.9)" in caplog.text


def test_torch_outside_the_supported_range_is_a_warning(verl, monkeypatch, caplog):
    """A torch outside the supported range: the patched line says so at WARNING, which verl's
    root logger (set to WARNING on import) shows; INFO in the range (verl[vllm] 0.9.1's 2.11)."""
    _, integration = verl
    for version, level in (("2.10.0+cu128", logging.WARNING), ("2.11.0+cu128", logging.INFO)):
        integration.remove()
        monkeypatch.setattr(torch, "__version__", version)
        with caplog.at_level(logging.INFO, logger="megatron_vocabstats"):
            integration.apply()
        (line,) = [r for r in caplog.records if "megatron-vocabstats: patched" in r.getMessage()]
        assert line.levelno == level, (version, line.getMessage())
        assert ("untested: torch 2.10.0+cu128 is outside the supported range torch >=2.11"
                in line.getMessage()) == (level == logging.WARNING)
        caplog.clear()


def _call_all(modules, calls=1):
    logits, labels = torch.randn(2, 3, 11), torch.randint(0, 9, (2, 3))  # < vocab_size 9
    hidden, weight = torch.randn(6, 1, 8), torch.randn(11, 8)
    for _ in range(calls):
        modules[ENGINE].vocab_parallel_log_probs_from_logits(logits, labels)
        modules[ENGINE].vocab_parallel_entropy(logits)
        modules[ENGINE].vocab_parallel_entropy_with_chunking(logits)
        modules[FUSED].linear_cross_entropy(hidden, weight, labels.view(1, 6), 1.0, "none", None)


def test_each_difference_is_logged_once_on_rank_0(verl, monkeypatch, caplog):
    modules, integration = verl
    from megatron_vocabstats.integrations.verl_ops import NOTES

    integration.remove()
    integration.apply()
    with caplog.at_level(logging.WARNING, logger="megatron_vocabstats"):
        _call_all(modules, calls=2)
    notes = [r.getMessage() for r in caplog.records]
    for name in NOTES:
        assert sum(f"(verl): {name} runs on" in n for n in notes) == 1, (name, notes)
    assert "rounded once to the model dtype" in caplog.text
    caplog.clear()
    integration.remove()
    integration.apply(vocab_size=9)  # after remove() the notes come again, here with vocab_size
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="megatron_vocabstats"):
        _call_all(modules)
    assert caplog.text.count("vocab_size=9: the padding columns get zero probability") == 4
    caplog.clear()
    integration.remove()
    integration.apply()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="megatron_vocabstats"):
        _call_all(modules)
    assert "(verl)" not in caplog.text


def test_unfused_conventions_tp1(verl):
    """Without Megatron's parallel state (tp = 1): verl's dtypes and shapes, values within the
    float64 bounds."""
    modules, _ = verl
    engine = modules[ENGINE]
    full = torch.randn(2, 3, 11, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (2, 3))
    for dtype in (torch.float32, torch.bfloat16):
        logits = full.to(dtype)
        lp_ref, h_ref, _ = reference_stats(logits, labels)
        b = stats_bounds(logits.double().reshape(-1, 11))
        lp = engine.vocab_parallel_log_probs_from_logits(logits, labels)
        h = engine.vocab_parallel_entropy(logits)
        hc = engine.vocab_parallel_entropy_with_chunking(logits, chunk_size=1)
        assert (lp.dtype, h.dtype, hc.dtype) == (torch.float32, dtype, torch.float32)
        assert lp.shape == h.shape == hc.shape == labels.shape
        u = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 0.0
        h_bound = b.entropy.view(labels.shape)
        assert_within(lp, lp_ref, b.logp.gather(-1, labels.view(-1, 1)).view(labels.shape), "lp")
        assert_within(h, h_ref, h_bound + u * (h_ref.abs() + h_bound), f"entropy {dtype}")
        assert_within(hc, h_ref, h_bound, f"chunked entropy {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_tp1_matches_float64(verl, dtype):
    """verl's fused binding (model_forward_fused.linear_cross_entropy, no group: tp = 1) on
    hidden [T, 1, H] and labels [1, T]: fp32 [T] log-probs and entropy of hidden @ weight.T / 0.7
    within the float64 bounds of our convention (logits rounded once to the model dtype); in
    bf16 that rounding is the logged difference to verl's fp32-logit kernel: above the fp32
    bound, within one bf16 rounding of the logits."""
    modules, _ = verl
    tokens, hidden_size, vocab = 7, 16, 11
    hidden = torch.randn(tokens, 1, hidden_size, dtype=torch.float64).to(dtype)
    weight = (torch.randn(vocab, hidden_size, dtype=torch.float64) * 2.5
              / hidden_size**0.5).to(dtype)  # logits of a few units, as fused_linear_cases
    labels = torch.randint(0, vocab, (1, tokens))
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = modules[FUSED].linear_cross_entropy(h, w, labels, 0.7, "none", None)
    assert lp.shape == ent.shape == (tokens,) and lp.dtype == ent.dtype == torch.float32
    z, dz = linear_logits_error(hidden.reshape(tokens, -1), weight, vocab, 0.7)
    b = stats_bounds(z, dz=dz)
    lp_ref, h_ref, _ = reference_stats(z, labels.view(-1))
    assert_within(lp, lp_ref, b.logp.gather(-1, labels.view(-1, 1))[:, 0], "log_probs")
    assert_within(ent, h_ref, b.entropy, "entropy")
    if dtype == torch.bfloat16:
        z32, dz32 = linear_logits_error(hidden.float().reshape(tokens, -1), weight.float(),
                                        vocab, 0.7)
        b32 = stats_bounds(z32, dz=dz32)
        gap = (lp.double() - lp_ref).abs() - b32.logp.gather(-1, labels.view(-1, 1))[:, 0]
        assert gap.max() > 0, "bf16 logits were not rounded (the logged difference)"
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == h.shape and h.grad.dtype == dtype and w.grad.dtype == dtype
    zl = (hidden.double().reshape(tokens, -1) @ weight.double().T).to(dtype).double()
    zl.requires_grad_()
    lp64, ent64, _ = reference_stats(zl / 0.7, labels.view(-1))
    (lp64.sum() + ent64.sum()).backward()
    rtol = 1e-5 if dtype == torch.float32 else 2**-5  # fused_linear_cases' gradient tolerances
    g = zl.grad
    assert_within(h.grad.view(tokens, -1), g @ weight.double(),
                  rtol * (g.abs() @ weight.double().abs()) + 1e-6, "d_hidden")
    assert_within(w.grad, g.T @ hidden.double().view(tokens, -1),
                  rtol * (g.abs().T @ hidden.double().view(tokens, -1).abs()) + 1e-6, "d_weight")


def test_linear_cross_entropy_reductions_and_errors_tp1(verl):
    modules, _ = verl
    fn = modules[LCE].linear_cross_entropy
    hidden, weight, labels = torch.randn(5, 8), torch.randn(11, 8), torch.randint(0, 11, (5,))
    lp, ent = fn(hidden, weight, labels)
    assert torch.equal(fn(hidden, weight, labels, 1.0, "sum")[0], lp.sum())
    assert torch.equal(fn(hidden, weight, labels, 1.0, "mean")[0], lp.mean())
    with pytest.raises(ValueError, match="reduction must be one of"):
        fn(hidden, weight, labels, 1.0, "avg")
    with pytest.raises(ValueError, match="target shape"):
        fn(hidden, weight, labels[:4])
    with pytest.raises(ValueError, match="target"):
        fn(hidden, weight, torch.full((5,), 11))
