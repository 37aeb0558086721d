"""AReaL's real functions (the installed AReaL 1.0.4 wheel, loaded by ``_framework_stubs``)
against the AReaL integration on gloo ranks: tp = 2 (``test_areal_dist.py`` launches 2 ranks)
and tp = 1 (1 rank: AReaL's non-parallel branch).

Each case calls AReaL's own ``gather_logprobs`` / ``gather_logprobs_entropy`` through the names
``areal.engine.megatron_engine`` and ``areal.models.tree_attn.functional`` bind, before and
after ``integrations.areal.apply()``, on the same shard and labels. Values are compared with
float64 references within the bounds of ``_reference`` (``docs/numerics.md``); gradients within
numerics.md's fp32 1e-5 of the magnitude of their terms.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main
from _reference import assert_within, reference_stats, stats_bounds, temperature_dz
from verl_cases import _grad_close, _shard

CASES = Cases()
WIDTH = 24  # the vocabulary: shards of 12 at tp = 2
ENGINE = "areal.engine.megatron_engine"
TREE = "areal.models.tree_attn.functional"


def _areal():
    """AReaL's real modules and the integration (imported, which applies it, then removed:
    each case applies it itself)."""
    import _framework_stubs

    try:
        modules = _framework_stubs.load("areal")
    except ImportError as exc:
        raise Skip(str(exc)) from exc
    import megatron_vocabstats.integrations.areal as integration

    integration.remove()
    return modules, integration


def _reference(x, labels, temperature, w_lp, w_h):
    """Float64 ``(logprobs, entropy, bounds, d/dx of sum(w_lp lp) + sum(w_h H), its scale)`` of
    the full logits ``x`` [..., V] in AReaL's convention (an id outside [0, V): max - logsumexp,
    gradient -p)."""
    leaf = (x.double() / temperature).detach().requires_grad_()
    outside = (labels < 0) | (labels >= x.shape[-1])
    lp, ent, lse = reference_stats(leaf, torch.where(outside, 0, labels))
    lp = torch.where(outside, leaf.detach().amax(-1) - lse, lp)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    z = leaf.detach()
    p, logp = torch.softmax(z, -1), torch.log_softmax(z, -1)
    plogp = torch.where(p > 0, p * logp.abs(), 0.0)
    scale = (w_lp.abs().unsqueeze(-1) * (p + (~outside).unsqueeze(-1).double())
             + w_h.abs().unsqueeze(-1) * (plogp + p * ent.detach().unsqueeze(-1)))
    flat = z.reshape(-1, z.shape[-1])
    dz = temperature_dz(flat, temperature)
    b = stats_bounds(flat, dz=dz, parts=2)
    lp_bound = torch.where(outside.reshape(-1), b.logsumexp + 1e-6 * flat.amax(-1).abs(),
                           b.logp.gather(-1, torch.where(outside, 0, labels).reshape(-1, 1))[:, 0])
    # AReaL's side: its entropy is (max + log S) - E_p[z] of the unshifted fp32 z, each term a
    # few roundings of u (as verl's, verl_cases): 6 u (|max| + log S + E_p|z|) more.
    m = z.amax(-1)
    slack = 6 * 2.0**-24 * (m.abs() + (lse - m) + (p * torch.where(p > 0, z.abs(), 0.0)).sum(-1))
    return (lp.detach(), ent.detach(), (lp_bound.view(labels.shape), b.entropy.view(labels.shape),
                                        slack.detach()),
            leaf.grad / temperature, scale / temperature)


def _run(fn, shard, labels, temperature, group, w_lp, w_h, *, chunk_size, backward):
    leaf = shard.clone().requires_grad_()
    out = fn(leaf, labels, temperature, tp_group=group, chunk_size=chunk_size)
    lp, ent = out if isinstance(out, tuple) else (out, None)
    if backward:
        ((lp * w_lp).sum() + (0 if ent is None else (ent * w_h).sum())).backward()
    return lp, ent, leaf


def _both(modules, integration, name, full, labels, temperature, group, options=None, **kwargs):
    """AReaL's own ``name`` and ours (``apply(**options)``) through the engine's binding:
    ``{side: (lp, ent, leaf)}``."""
    shard = _shard(full, group).contiguous()
    engine = modules[ENGINE]
    out = {"areal": _run(getattr(engine, name), shard, labels, temperature, group, chunk_size=4,
                         **kwargs)}
    integration.apply(**(options or {}))
    try:
        assert getattr(engine, name).__wrapped__ is not None  # the replacement runs
        out["ours"] = _run(getattr(engine, name), shard, labels, temperature, group,
                           chunk_size=1024, **kwargs)
    finally:
        integration.remove()
    return out


def _check(results, ref, group, backward, what):
    lp_ref, h_ref, (lp_b, h_b, slack), g_ref, scale = ref
    for side, (lp, ent, leaf) in results.items():
        if side == "areal":
            lp_b, h_b = lp_b + slack, h_b + slack
        assert lp.dtype == torch.float32 and lp.shape == lp_ref.shape, f"{side} {what}"
        assert_within(lp, lp_ref, lp_b, f"{side} logprobs {what}")
        if ent is not None:
            assert ent.dtype == torch.float32, f"{side} entropy dtype {what}"
            assert_within(ent, h_ref, h_b, f"{side} entropy {what}")
        if backward:
            _grad_close(leaf.grad, _shard(g_ref, group), _shard(scale, group),
                        f"{side} gradient {what}")


@CASES.register
def areal_functions_match(group):
    """gather_logprobs(_entropy) as megatron_engine binds them, AReaL's (in chunks of 4 rows)
    and ours, on [T, W] and [B, S, W] shards, fp32 and bf16, temperature 1 and 0.7: fp32
    results shaped like the labels, both within the float64 bounds, the same gradients (fp32)."""
    modules, integration = _areal()
    for shape in ((9,), (2, 5)):
        labels = torch.randint(0, WIDTH, shape)
        w_lp, w_h = (torch.rand(shape, dtype=torch.float64) + 0.5 for _ in range(2))
        for dtype in (torch.float32, torch.bfloat16):
            full = (torch.randn(*shape, WIDTH, dtype=torch.float64) * 3).to(dtype)
            for temperature in (1.0, 0.7):
                backward = dtype == torch.float32
                what = f"{shape} {dtype} T={temperature}"
                for name, wh in (("gather_logprobs_entropy", w_h),
                                 ("gather_logprobs", torch.zeros_like(w_h))):
                    ref = _reference(full, labels, temperature, w_lp, wh)
                    results = _both(modules, integration, name, full, labels, temperature, group,
                                    w_lp=w_lp, w_h=wh, backward=backward)
                    _check(results, ref, group, backward, f"{name} {what}")


@CASES.register
def areal_tree_attention_binding(group):
    """AReaL's tree-attention helpers (real code) reach the replacement: the same values
    before and after apply(), and the log-probs of a node's internal tokens and of a
    transition within the float64 bounds."""
    modules, integration = _areal()
    tree = modules[TREE]
    full = torch.randn(7, WIDTH, dtype=torch.float64).float() * 3
    ids = torch.randint(0, WIDTH, (8,))
    shard = _shard(full, group).contiguous()
    out = {}
    for side in ("areal", "ours"):
        if side == "ours":
            integration.apply()
        try:
            out[side] = (tree._compute_internal_node_logprobs_entropy(shard, ids, 0, 6, 0.7, 3,
                                                                       group),
                         tree._compute_transition_logprob(shard, ids, 6, 7, 0.7, group))
        finally:
            integration.remove()
    lp_ref, h_ref, _ = reference_stats(full.double() / 0.7, ids[1:])
    for side, ((lp, ent), lp_t) in out.items():
        assert lp.shape == ent.shape == (6,) and lp_t.shape == (), side
        assert_within(lp, lp_ref[:6], 1e-5 * (1 + lp_ref[:6].abs()), f"{side} tree logprobs")
        assert_within(ent, h_ref[:6], 1e-5 * (1 + h_ref[:6].abs()), f"{side} tree entropy")
        assert_within(lp_t, lp_ref[6], 1e-5 * (1 + lp_ref[6].abs()), f"{side} transition")


@CASES.register
def areal_ids_outside_the_vocabulary(group):
    """Ids outside [0, V) (-100, V, 3V): under tensor parallelism AReaL gives max - logsumexp and
    the gradient -p, and so do we; at tp = 1 AReaL's gather raises an indexing error, ours keeps
    the tp > 1 rule. Never NaN."""
    modules, integration = _areal()
    labels = torch.tensor([3, -100, WIDTH, 17, 3 * WIDTH, 0])
    w_lp, w_h = (torch.rand(6, dtype=torch.float64) + 0.5 for _ in range(2))
    full = torch.randn(6, WIDTH, dtype=torch.float64).float() * 3
    ref = _reference(full, labels, 0.7, w_lp, w_h)
    for validate in (True, False):
        if dist.get_world_size(group) > 1:
            results = _both(modules, integration, "gather_logprobs_entropy", full, labels, 0.7,
                            group, dict(validate=validate), w_lp=w_lp, w_h=w_h, backward=True)
        else:
            _raises(lambda: modules[ENGINE].gather_logprobs_entropy(full, labels, 0.7,
                                                                    tp_group=group),
                    (IndexError, RuntimeError), "index", "AReaL's tp = 1 gather")
            integration.apply(validate=validate)
            try:
                results = {"ours": _run(modules[ENGINE].gather_logprobs_entropy, full, labels,
                                        0.7, group, w_lp, w_h, chunk_size=2, backward=True)}
            finally:
                integration.remove()
        _check(results, ref, group, True, f"ids outside, validate={validate}")


@CASES.register
def areal_masked_vocabulary(group):
    """A -inf-masked vocabulary (every third column, on both shards; one label on a masked
    column): AReaL's entropy is NaN (0 * -inf), ours is the float64 entropy, its gradient
    finite and equal to float64's; that label's log-prob is -inf on both sides."""
    modules, integration = _areal()
    full = torch.randn(5, WIDTH, dtype=torch.float64).float() * 3
    full[:, ::3] = float("-inf")
    labels = torch.tensor([1, 4, 3, 23, 11])  # 3: masked
    w_lp, w_h = (torch.rand(5, dtype=torch.float64) + 0.5 for _ in range(2))
    results = _both(modules, integration, "gather_logprobs_entropy", full, labels, 1.0, group,
                    w_lp=torch.zeros_like(w_lp), w_h=w_h, backward=False)
    assert torch.isnan(results["areal"][1]).all(), "AReaL's entropy of a masked vocabulary"
    ours = results["ours"]
    assert ours[0][2] == float("-inf") and torch.isfinite(ours[0][[0, 1, 3, 4]]).all()
    lp_ref, h_ref, (lp_b, h_b, _), _, _ = _reference(full, labels, 1.0, w_lp, w_h)
    assert_within(ours[0], lp_ref, lp_b, "ours masked logprobs")
    assert_within(ours[1], h_ref, h_b, "ours masked entropy")
    keep = torch.tensor([True, True, False, True, True])  # the -inf log-prob has no gradient
    w = torch.where(keep, w_lp, 0.0)
    integration.apply()
    try:
        _, _, leaf = _run(modules[ENGINE].gather_logprobs_entropy, _shard(full, group).contiguous(),
                          labels, 1.0, group, w, w_h, chunk_size=1024, backward=True)
    finally:
        integration.remove()
    _, _, _, g_ref, scale = _reference(full, labels, 1.0, w, w_h)
    assert torch.isfinite(leaf.grad).all(), "a non-finite gradient"
    _grad_close(leaf.grad, _shard(g_ref, group), _shard(scale, group), "ours masked gradient")


@CASES.register
def areal_empty_micro_batch(group):
    """An empty micro-batch: AReaL asserts, ours raises ValueError naming logits, on every rank
    before any collective (no hang)."""
    modules, integration = _areal()
    logits, labels = torch.randn(0, WIDTH // 2), torch.zeros(0, dtype=torch.long)
    _raises(lambda: modules[ENGINE].gather_logprobs(logits, labels, tp_group=group),
            AssertionError, "at least one element", "AReaL")
    integration.apply()
    try:
        _raises(lambda: modules[ENGINE].gather_logprobs_entropy(logits, labels, tp_group=group),
                ValueError, "logits is an empty micro-batch", "ours")
    finally:
        integration.remove()


def _raises(call, kind, text, side):
    try:
        call()
    except kind as exc:
        assert text in str(exc).lower(), str(exc)
    else:
        raise AssertionError(f"{side}: no {kind}")


if __name__ == "__main__":
    main(CASES, timeout_s=120.0)
