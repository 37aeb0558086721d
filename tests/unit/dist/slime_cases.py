"""The slime integration on 2 gloo ranks, at tp 1 and tp 2: slime's
``calculate_log_probs_and_entropy`` called through the name slime's Megatron loss binds, before
(the stand-in of ``_slime_standin``, slime's conventions) and after
``integrations.slime.apply()``, on the same inputs; values and gradients against each other and
against float64 references within the bounds of ``_reference`` (docs/numerics.md). Run by
tests/unit/test_slime_dist.py.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # dist/ and tests/unit
import _slime_standin  # noqa: E402
from _harness import Cases, main  # noqa: E402
from _reference import UNIT_ROUNDOFF, assert_within, stats_bounds, temperature_dz  # noqa: E402

CASES = Cases()
T, V = 12, 40  # tokens of the packed row, padded vocabulary W·tp (shards of 20 at tp 2)
LOSS, NAME = "slime.backends.megatron_utils.loss", "calculate_log_probs_and_entropy"
_GROUPS = {}


def _tp(world, layout):
    """This rank's tensor-parallel group: its own at tp 1, both ranks at tp 2 (every rank
    creates every group, once, as ``new_group`` requires)."""
    if not _GROUPS:
        singles = [dist.new_group([r]) for r in range(world.size())]
        _GROUPS.update(tp1=singles[world.rank()], tp2=world)
    return _GROUPS[layout]


def _both(call):
    """``call(fn)`` with slime's binding (the stand-in) and with the integration's."""
    modules = _slime_standin.install()
    import megatron_vocabstats.integrations.slime as integration

    integration.remove()
    theirs = call(getattr(modules[LOSS], NAME))
    integration.apply()
    try:
        ours_fn = getattr(modules[LOSS], NAME)
        assert ours_fn.__module__.endswith("slime_ops"), ours_fn
        ours = call(ours_fn)
    finally:
        integration.remove()
    return theirs, ours


def _shard(full, group):
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    width = full.shape[-1] // size
    return full[..., rank * width:(rank + 1) * width]


def _run(fn, full, tokens, group, *, dtype=torch.float32, keep=None, grad=True):
    """One call on this rank's shard of ``full`` and the backward of ``sum(w_lp lp + w_h H)``;
    ``(log_prob, entropy, logits grad)``."""
    leaf = _shard(full, group).to(dtype).detach().clone().requires_grad_()
    mask = None if keep is None else _shard(keep, group).contiguous()
    lp, ent = fn(leaf, tokens, group, with_entropy=True, log_prob_keep_mask=mask,
                 with_entropy_grad=grad)
    assert lp.shape == (T, 1) and lp.dtype == torch.float32, (lp.shape, lp.dtype)
    assert ent.shape == (T,) and ent.dtype == torch.float32 and ent.requires_grad == grad
    w_lp, w_h = _weights()
    ((lp[:, 0] * w_lp).sum() + (ent * w_h).sum()).backward()
    return lp[:, 0].detach(), ent.detach(), leaf.grad


def _weights():
    g = torch.Generator().manual_seed(7)
    return torch.rand(T, generator=g) + 0.5, torch.rand(T, generator=g) - 0.5


def _reference(full, tokens, *, keep=None, limit=None, grad=True, weights=None, dz=None):
    """Float64 ``(log_prob, entropy, gradient, log_prob bound, entropy bound, gradient scale)`` by
    slime's rules over the first ``limit`` columns: the log-prob over the kept columns plus the
    target's; an id outside ``[0, limit)`` gives ``max - logZ`` with gradient ``-p``."""
    limit = limit or full.shape[-1]
    leaf = full.detach().double().clone().requires_grad_()
    z = leaf[:, :limit]
    inside = (tokens >= 0) & (tokens < limit)
    safe = torch.where(inside, tokens, 0)
    zl = z
    if keep is not None:
        kept = keep[:, :limit].clone()
        kept[inside, safe[inside]] = True
        zl = z.masked_fill(~kept, float("-inf"))
    m = zl.detach().amax(-1)
    lse = torch.logsumexp(zl, -1)
    lp = torch.where(inside, zl.gather(1, safe[:, None])[:, 0], m) - lse
    logp_all = torch.log_softmax(z, -1)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1)
    w_lp, w_h = (w.double() for w in weights or _weights())
    ((lp * w_lp).sum() + ((ent * w_h).sum() if grad else 0)).backward()
    b_lp, b_h = stats_bounds(zl.detach(), dz=dz), stats_bounds(z.detach(), dz=dz)
    picked = torch.where(inside, safe, zl.detach().argmax(-1))
    lp_bound = b_lp.logp.gather(1, picked[:, None])[:, 0]
    p_lp = torch.softmax(zl.detach(), -1)
    onehot = torch.zeros_like(p_lp).scatter_(1, picked[:, None], 1.0)
    scale = (w_lp.abs()[:, None] * (p_lp + onehot)
             + w_h.abs()[:, None] * p * (logp_all.detach().abs() + ent.detach()[:, None]))
    grad_full = torch.zeros_like(full, dtype=torch.float64)
    grad_full[:, :limit] = leaf.grad[:, :limit]
    scale_full = torch.zeros_like(grad_full)
    scale_full[:, :limit] = torch.where(torch.isfinite(scale), scale, 0.0)
    return lp.detach(), ent.detach(), grad_full, lp_bound, b_h.entropy, scale_full


def _check(name, result, ref, group, dtype=torch.float32):
    lp, ent, grad = result
    lp_ref, h_ref, g_ref, lp_bound, h_bound, scale = ref
    assert_within(lp, lp_ref, lp_bound, f"{name} log_prob")
    assert_within(ent, h_ref, h_bound, f"{name} entropy")
    g_ref, scale = _shard(g_ref, group), _shard(scale, group)
    bound = 1e-5 * scale + 1e-30 + UNIT_ROUNDOFF.get(dtype, 0) * (g_ref.abs() + 1e-5 * scale)
    assert grad.dtype == dtype
    assert_within(grad, g_ref, bound, f"{name} gradient")


def _logits(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, V, generator=g, dtype=torch.float64) * 3).float().double()


def _tokens(seed=1):
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))


def _outside(tokens):
    tokens = tokens.clone()
    tokens[[1, 4, 7, 10]] = torch.tensor([-100, -1, V, V + 7])
    return tokens


def _keep():
    keep = torch.rand(T, V, generator=torch.Generator().manual_seed(3)) < 0.3
    keep[2, V // 2:] = False  # the second shard of row 2 wholly masked (its target kept)
    keep[5, :] = False        # only the target's column left
    return keep


def _layouts(fn):
    for layout in ("tp1", "tp2"):
        def case(world, layout=layout):
            fn(_tp(world, layout))
        case.__name__ = f"{fn.__name__}_{layout}"
        CASES.register(case)
    return fn


@_layouts
def slime_values_and_gradients(group):
    """fp32 and bf16 logits, entropy with a gradient: both sides within the float64 bounds, the
    same shapes and dtypes (checked in ``_run``), gradients in the logits' dtype."""
    full, tokens = _logits(), _tokens()
    for dtype in (torch.float32, torch.bfloat16):
        bf = full.to(dtype).double()
        ref = _reference(bf, tokens)
        theirs, ours = _both(
            lambda fn, bf=bf, dtype=dtype: _run(fn, bf, tokens, group, dtype=dtype))
        _check(f"slime {dtype}", theirs, ref, group, dtype)
        _check(f"ours {dtype}", ours, ref, group, dtype)


@_layouts
def slime_ids_outside_the_shards(group):
    """-100, -1, W·tp and beyond: ``max - logZ`` with gradient ``-p`` on both sides, never an
    error; the same on ours with a keep mask."""
    full, tokens = _logits(), _outside(_tokens())
    for keep in (None, _keep()):
        ref = _reference(full, tokens, keep=keep)
        theirs, ours = _both(lambda fn, keep=keep: _run(fn, full, tokens, group, keep=keep))
        _check(f"slime keep={keep is not None}", theirs, ref, group)
        _check(f"ours keep={keep is not None}", ours, ref, group)


@_layouts
def slime_keep_mask(group):
    """Top-p replay's keep mask: the log-prob over the kept columns and the target's (a row
    whose shard is wholly masked, a row with only the target left), the entropy unmasked."""
    full, tokens, keep = _logits(), _tokens(), _keep()
    ref = _reference(full, tokens, keep=keep)
    theirs, ours = _both(lambda fn: _run(fn, full, tokens, group, keep=keep))
    _check("slime", theirs, ref, group)
    _check("ours", ours, ref, group)
    assert torch.equal(ours[0][5], torch.zeros(()))


@_layouts
def slime_entropy_without_gradient(group):
    """``with_entropy_grad=False``: the entropy is a metric (no gradient, checked in ``_run``);
    the logits' gradient is the log-prob's alone."""
    full, tokens = _logits(), _tokens()
    ref = _reference(full, tokens, grad=False)
    theirs, ours = _both(lambda fn: _run(fn, full, tokens, group, grad=False))
    _check("slime", theirs, ref, group)
    _check("ours", ours, ref, group)


@_layouts
def slime_inf_masked_vocabulary(group):
    """Logits of -inf (a masked vocabulary): slime's entropy is NaN there (``0 * -inf`` in its
    ``sum p z``); ours is the float64 entropy. Log-probs and gradients agree."""
    full, tokens = _logits(), _tokens()
    full[:, 3::4] = float("-inf")
    tokens = torch.where(tokens % 4 == 3, tokens - 1, tokens)
    ref = _reference(full, tokens)
    theirs, ours = _both(lambda fn: _run(fn, full, tokens, group))
    assert torch.isnan(theirs[1]).all()
    _check("ours", ours, ref, group)
    assert_within(theirs[0], ref[0], ref[3], "slime log_prob")


@_layouts
def slime_loss_caller(group):
    """slime's caller (the stand-in's reduced ``get_log_probs_and_entropy``): the logits divided
    by temperature 0.7, chunk_size 5, two packed sequences and a padding tail; slime's and ours
    (through the loss module's binding) per response token against float64, gradients too."""
    full = _logits()
    seqs = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (6, 4)]
    args = SimpleNamespace(rollout_temperature=0.7, entropy_coef=0.01, log_probs_chunk_size=5)
    _slime_standin.TP_GROUP[0] = group

    def call(_fn):
        leaf = _shard(full, group).float().detach().clone().requires_grad_()
        loss = sys.modules[LOSS]
        res = loss.get_log_probs_and_entropy(
            leaf.unsqueeze(0), args=args, unconcat_tokens=seqs, total_lengths=[6, 4],
            response_lengths=[3, 2], with_entropy=True)
        total = sum(x.sum() for x in res["log_probs"]) + sum(x.sum() for x in res["entropy"])
        total.backward()
        return res, leaf.grad

    try:
        theirs, ours = _both(call)
    finally:
        _slime_standin.TP_GROUP[0] = None
    targets = torch.zeros(T, dtype=torch.long)
    targets[:5], targets[6:9] = seqs[0][1:], seqs[1][1:]
    picked = torch.zeros(T)
    picked[[2, 3, 4, 7, 8]] = 1.0  # each sequence's response positions (their targets)
    z = full / args.rollout_temperature
    ref = _reference(z, targets, weights=(picked, picked),
                     dz=temperature_dz(z, args.rollout_temperature))
    index = picked.nonzero()[:, 0]
    for name, (res, grad) in (("slime", theirs), ("ours", ours)):
        lp, ent = torch.cat(res["log_probs"]), torch.cat(res["entropy"])
        assert lp.shape == ent.shape == (5,), name
        assert_within(lp, ref[0][index], ref[3][index], f"{name} log_probs")
        assert_within(ent, ref[1][index], ref[4][index], f"{name} entropy")
        # d/dx = d/dz / tau: the float64 gradient's bound, divided, plus the division's rounding.
        g_ref = _shard(ref[2], group) / args.rollout_temperature
        bound = (1e-5 * _shard(ref[5], group) + 1e-30) / args.rollout_temperature
        assert_within(grad, g_ref, bound + UNIT_ROUNDOFF[torch.float32] * g_ref.abs(),
                      f"{name} gradient")


@_layouts
def slime_vocab_size_option(group):
    """``apply(vocab_size=V')``: padding columns get zero probability and an id in
    ``[V', W·tp)`` counts as outside the vocabulary (``max - logZ`` over the real columns)."""
    full, tokens = _logits(), _outside(_tokens())
    tokens[0] = V - 2
    real = V - 6
    _slime_standin.install()
    import megatron_vocabstats.integrations.slime as integration

    integration.apply(vocab_size=real)
    try:
        ours = _run(getattr(sys.modules[LOSS], NAME), full, tokens, group)
    finally:
        integration.remove()
    _check("ours", ours, _reference(full, tokens, limit=real), group)


if __name__ == "__main__":
    main(CASES, timeout_s=120.0)
