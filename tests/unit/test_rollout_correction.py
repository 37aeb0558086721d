"""Rollout-mismatch correction (megatron_vocabstats.rollout) and its use in policy_loss, on CPU.

References are plain-Python float64 computations written from the formulas (TIS, MIS, IcePop,
the PPO clipped surrogate, k3), token by token, sharing nothing with the vectorised code. The
inputs are small ``[3, 5]`` batches with uncounted positions that hold NaN: nothing of those
may reach a value or a gradient.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import megatron_vocabstats as mv
from megatron_vocabstats.losses import policy_loss
from megatron_vocabstats.rollout import (
    RolloutCorrection,
    correction_weights,
    mismatch_diagnostics,
)
from megatron_vocabstats.testing import forbid_host_sync

NAN = float("nan")

# old - rollout per token (before masking): ratios e^d straddle every bound used below
# (0.5, 2, 5): e^0.8 = 2.23, e^-0.9 = 0.41, e^1.7 = 5.47, e^-0.6 = 0.55, ...
DIFF = [
    [0.10, 0.80, -0.90, 0.00, 0.30],
    [1.70, -0.60, 0.05, -0.20, 0.00],
    [0.00, 0.00, 0.00, 0.00, 0.00],
]
MASK = [
    [1, 1, 1, 0, 1],
    [1, 1, 1, 1, 0],
    [0, 0, 0, 0, 0],  # an empty row
]
OLD = [
    [-1.2, -0.7, -2.3, -0.4, -1.9],
    [-0.3, -1.1, -0.8, -2.6, -1.0],
    [-0.5, -0.5, -0.5, -0.5, -0.5],
]
LP_SHIFT = [  # logprobs - old: some ratios inside, some outside the PPO clip range
    [0.05, -0.40, 0.30, 0.0, 0.15],
    [-0.10, 0.25, 0.00, -0.30, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0],
]
ADV = [
    [1.0, -0.5, 2.0, 0.3, -1.5],
    [-1.0, 0.7, 0.4, -2.0, 1.0],
    [0.2, 0.2, 0.2, 0.2, 0.2],
]


def _inputs(*, row2=False):
    """float64 (logprobs, old, rollout, adv, mask) with NaN at every uncounted position."""
    mask = torch.tensor(MASK, dtype=torch.bool)
    if row2:
        mask[2, :3] = True
    old = torch.tensor(OLD, dtype=torch.float64)
    rollout = old - torch.tensor(DIFF, dtype=torch.float64)
    lp = old + torch.tensor(LP_SHIFT, dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)
    for t in (old, rollout, lp, adv):
        t[~mask] = NAN
    return lp.requires_grad_(), old, rollout, adv, mask


def _cells(mask):
    return [(i, j) for i in range(len(mask)) for j in range(len(mask[0])) if mask[i][j]]


def ref_weights(cfg: RolloutCorrection, mask=MASK, diff=DIFF):
    """Plain-Python weights and flags, {(i, j): (w, flag)} over counted tokens."""
    out = {}
    if cfg.level == "token":
        ratios = {(i, j): math.exp(diff[i][j]) for i, j in _cells(mask)}
    else:
        row = {i: math.exp(sum(diff[i][j] for j in range(len(mask[0])) if mask[i][j]))
               for i in range(len(mask))}
        ratios = {(i, j): row[i] for i, j in _cells(mask)}
    for key, r in ratios.items():
        if cfg.mode == "tis":
            out[key] = (min(r, cfg.threshold), r > cfg.threshold)
        else:
            inside = cfg.low <= r <= cfg.high
            out[key] = (r if inside else 0.0, not inside)
    return out


def ref_pg(lp_shift, adv, eps=0.2):
    r = math.exp(lp_shift)
    return max(-adv * r, -adv * min(max(r, 1 - eps), 1 + eps))


def ref_pg_grad(lp_shift, adv, eps=0.2):
    """d pg / d logprobs."""
    r = math.exp(lp_shift)
    unclipped, clipped = -adv * r, -adv * min(max(r, 1 - eps), 1 + eps)
    return -adv * r if unclipped >= clipped else 0.0


def _assert_close(actual, expected, what, tol=1e-12):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, what
    assert torch.allclose(actual, expected, rtol=tol, atol=tol), (
        f"{what}: actual {actual} expected {expected}")


CONFIGS = [
    RolloutCorrection(mode="tis"),
    RolloutCorrection(mode="tis", threshold=1.5),
    RolloutCorrection(mode="tis", level="sequence"),
    RolloutCorrection(mode="mis"),
    RolloutCorrection(mode="mis", low=0.45, high=3.0),
    RolloutCorrection(mode="mis", level="sequence", high=2.5),
    RolloutCorrection(mode="icepop"),
]
IDS = [f"{c.mode}-{c.level}-{c.threshold}-{c.low}-{c.high}" for c in CONFIGS]


# ---------------------------------------------------------------------------------------------
# RolloutCorrection


def test_defaults_follow_the_sources():
    assert RolloutCorrection() == RolloutCorrection(mode="tis", level="token", threshold=2.0)
    mis = RolloutCorrection(mode="mis")
    assert (mis.low, mis.high, mis.threshold) == (0.5, 2.0, None)  # verl: low = 1 / high
    assert RolloutCorrection(mode="mis", high=4.0).low == 0.25
    ice = RolloutCorrection(mode="icepop")
    assert (ice.low, ice.high) == (0.5, 5.0)  # Ring-1T's band
    assert RolloutCorrection().flag_name == "truncated" and mis.flag_name == "masked"
    with pytest.raises(dataclasses.FrozenInstanceError):
        mis.high = 3.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="clip"), "mode"),
    (dict(level="batch"), "level"),
    (dict(mode="icepop", level="sequence"), "level"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=-1.0), "threshold"),
    (dict(threshold=float("inf")), "threshold"),
    (dict(threshold=True), "threshold"),
    (dict(threshold="2"), "threshold"),
    (dict(mode="tis", low=0.5), "low"),
    (dict(mode="tis", high=2.0), "high"),
    (dict(mode="mis", threshold=2.0), "threshold"),
    (dict(mode="mis", low=2.0, high=2.0), "low"),
    (dict(mode="mis", low=3.0, high=2.0), "low"),
    (dict(mode="icepop", low=0.0), "low"),
    (dict(mode="mis", high=-2.0), "high"),
    (dict(mode="mis", low=1.2, high=3.0), "low"),
    (dict(mode="mis", low=0.2, high=0.8), "high"),
])
def test_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        RolloutCorrection(**kwargs)


# ---------------------------------------------------------------------------------------------
# correction_weights


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_weights_match_reference(cfg):
    _, old, rollout, _, mask = _inputs()
    weights, flags = correction_weights(old, rollout, mask, cfg)
    assert weights.dtype == torch.float64 and flags.dtype == torch.bool
    assert not weights.requires_grad
    ref = ref_weights(cfg)
    expected_w = torch.zeros(3, 5, dtype=torch.float64)
    expected_f = torch.zeros(3, 5, dtype=torch.bool)
    for (i, j), (w, f) in ref.items():
        expected_w[i, j], expected_f[i, j] = w, f
    _assert_close(weights, expected_w, "weights")
    assert torch.equal(flags, expected_f)
    # Every configuration here flags something and keeps something.
    assert 0 < int(flags.sum()) < int(mask.sum())


def test_weight_semantics_by_mode():
    """TIS caps, MIS/IcePop keep the ratio itself inside the band and drop the rest."""
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ratios = torch.tensor([[0.3, 0.9, 1.8, 4.0]], dtype=torch.float64)
    rollout = old - ratios.log()
    mask = torch.ones_like(old, dtype=torch.bool)
    w, f = correction_weights(old, rollout, mask, RolloutCorrection(mode="tis"))
    _assert_close(w, [[0.3, 0.9, 1.8, 2.0]], "tis")
    assert f.tolist() == [[False, False, False, True]]
    w, f = correction_weights(old, rollout, mask, RolloutCorrection(mode="mis"))
    _assert_close(w, [[0.0, 0.9, 1.8, 0.0]], "mis")
    assert f.tolist() == [[True, False, False, True]]
    w, f = correction_weights(old, rollout, mask, RolloutCorrection(mode="icepop"))
    _assert_close(w, [[0.0, 0.9, 1.8, 4.0]], "icepop")
    assert f.tolist() == [[True, False, False, False]]


def test_weights_stay_finite_for_extreme_ratios():
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    rollout = torch.tensor([[-300.0, 0.0], [300.0, -300.0]])
    mask = torch.ones_like(old, dtype=torch.bool)
    for cfg in CONFIGS:
        w, _ = correction_weights(old, rollout, mask, cfg)
        assert torch.isfinite(w).all(), cfg
    w, f = correction_weights(old, rollout, mask, RolloutCorrection(mode="mis"))
    assert w[0, 0] == 0 and bool(f[0, 0]) and w[1, 0] == 0 and bool(f[1, 0])


@pytest.mark.parametrize("dtype, expected", [(torch.float32, torch.float32),
                                             (torch.bfloat16, torch.float32),
                                             (torch.float64, torch.float64)])
def test_weights_dtype(dtype, expected):
    _, old, rollout, _, mask = _inputs()
    w, _ = correction_weights(old.to(dtype), rollout.to(dtype), mask.int(),
                              RolloutCorrection())
    assert w.dtype == expected and torch.isfinite(w).all()


def test_weights_are_detached():
    _, old, rollout, _, mask = _inputs()
    old = old.clone().requires_grad_()
    rollout = rollout.clone().requires_grad_()
    for cfg in CONFIGS:
        w, _ = correction_weights(old, rollout, mask, cfg)
        assert not w.requires_grad and w.grad_fn is None


@pytest.mark.parametrize("call, name", [
    (lambda o, r, m: correction_weights(o, r, m, "tis"), "cfg"),
    (lambda o, r, m: correction_weights(o, r[:, :4], m, RolloutCorrection()), "rollout_logprobs"),
    (lambda o, r, m: correction_weights(o, r.long(), m, RolloutCorrection()), "rollout_logprobs"),
    (lambda o, r, m: correction_weights(o.tolist(), r, m, RolloutCorrection()), "old_logprobs"),
    (lambda o, r, m: correction_weights(o, r, None, RolloutCorrection()), "mask"),
    (lambda o, r, m: correction_weights(o, r, m[:2], RolloutCorrection()), "mask"),
    (lambda o, r, m: correction_weights(
        o.reshape(-1), r.reshape(-1), m.reshape(-1), RolloutCorrection(level="sequence")),
     "level"),
])
def test_weights_reject(call, name):
    _, old, rollout, _, mask = _inputs()
    with pytest.raises(ValueError, match=name):
        call(old, rollout, mask)


# ---------------------------------------------------------------------------------------------
# policy_loss with the correction


def ref_policy_loss(cfg, *, kl_coef=0.0, entropy_coef=0.0, aggregation="token-mean"):
    """(loss_sum, d loss_sum / d logprobs) in plain Python: w * pg + kl + entropy terms."""
    ref_shift = -0.25  # ref_logprobs - logprobs at every token (see test)
    weights = ref_weights(cfg) if cfg is not None else {k: (1.0, False) for k in _cells(MASK)}
    loss = 0.0
    grad = [[0.0] * 5 for _ in range(3)]
    rows = {i: sum(MASK[i]) for i in range(3)}
    for (i, j), (w, _) in weights.items():
        s, a = LP_SHIFT[i][j], ADV[i][j]
        ent = 0.5 + 0.1 * j
        kl = math.expm1(ref_shift) - ref_shift
        term = w * ref_pg(s, a) + kl_coef * kl - entropy_coef * ent
        # d kl / d lp with d = ref - lp: -(e^d - 1).
        g = w * ref_pg_grad(s, a) - kl_coef * math.expm1(ref_shift)
        scale = 1.0 / rows[i] if aggregation == "sequence-mean" else 1.0
        loss += scale * term
        grad[i][j] = scale * g
    return loss, grad


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
@pytest.mark.parametrize("cfg", CONFIGS + [None], ids=IDS + ["none"])
def test_policy_loss_matches_reference(cfg, aggregation):
    lp, old, rollout, adv, mask = _inputs()
    ref_lp = lp.detach() - 0.25
    entropy = torch.tensor([[0.5 + 0.1 * j for j in range(5)]] * 3, dtype=torch.float64)
    entropy[~mask] = NAN
    entropy.requires_grad_()
    out = policy_loss(lp, old, adv, mask, entropy=entropy, ref_logprobs=ref_lp, kl_coef=0.1,
                      entropy_coef=0.01, aggregation=aggregation, rollout_logprobs=rollout,
                      rollout_correction=cfg)
    loss, grad = ref_policy_loss(cfg, kl_coef=0.1, entropy_coef=0.01, aggregation=aggregation)
    _assert_close(out.loss_sum, loss, "loss_sum")
    assert int(out.num_tokens) == (8 if aggregation == "token-mean" else 2)
    out.loss_sum.backward()
    _assert_close(lp.grad, grad, "d loss / d logprobs")
    assert torch.isfinite(lp.grad).all() and bool((lp.grad[~mask] == 0).all())
    _assert_close(out.report["policy loss"], [loss, float(out.num_tokens)], "report", tol=1e-6)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_gradient_is_weight_times_uncorrected_gradient(cfg):
    """The weights are constants: d loss / d lp = w * (d loss / d lp without correction)."""
    lp, old, rollout, adv, mask = _inputs()
    policy_loss(lp, old, adv, mask).loss_sum.backward()
    plain = lp.grad.clone()
    lp.grad = None
    policy_loss(lp, old, adv, mask, rollout_logprobs=rollout,
                rollout_correction=cfg).loss_sum.backward()
    weights, _ = correction_weights(old, rollout, mask, cfg)
    _assert_close(lp.grad, weights * plain, "gradient", tol=1e-14)


@pytest.mark.parametrize("options", [
    {},
    dict(dual_clip=3.0, clip_eps_high=0.28),
    dict(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01, aggregation="sequence-mean"),
])
def test_unchanged_without_rollout_inputs(options):
    """Without rollout_logprobs nothing changes, bit for bit; rollout_logprobs alone (no
    correction) only adds diagnostics."""
    lp, old, rollout, adv, mask = _inputs()
    entropy = torch.full_like(old, 0.7, requires_grad=True)
    extra = dict(entropy=entropy, ref_logprobs=lp.detach() - 0.3) if options.get("kl_coef") else {}
    results = []
    for rollout_kwargs in ({}, dict(rollout_logprobs=None, rollout_correction=None,
                                    rollout_outside=None),
                           dict(rollout_logprobs=rollout)):
        lp.grad = None
        out = policy_loss(lp, old, adv, mask, **options, **extra, **rollout_kwargs)
        out.loss_sum.backward()
        results.append((out, lp.grad.clone()))
    (base, base_grad), (nones, nones_grad), (diag, diag_grad) = results
    for out, grad in ((nones, nones_grad), (diag, diag_grad)):
        assert torch.equal(out.loss_sum, base.loss_sum)
        assert torch.equal(out.num_tokens, base.num_tokens)
        assert torch.equal(grad, base_grad)
        for key, value in base.report.items():
            assert torch.equal(out.report[key], value), key
    assert nones.report.keys() == base.report.keys()
    added = [k for k in diag.report if k not in base.report]
    assert added == ["rollout |dlogprob|", "rollout k3 kl", "rollout ratio p50",
                     "rollout ratio p90", "rollout ratio p99", "rollout ratio max",
                     "rollout invalid logprobs"]


def test_report_keys_with_correction_and_outside():
    lp, old, rollout, adv, mask = _inputs()
    outside = torch.zeros_like(mask)
    outside[0, 1] = outside[1, 4] = True  # (1, 4) is not counted
    out = policy_loss(lp, old, adv, mask, rollout_logprobs=rollout,
                      rollout_correction=RolloutCorrection(mode="icepop"),
                      rollout_outside=outside)
    keys = [k for k in out.report if k.startswith("rollout")]
    assert keys == ["rollout |dlogprob|", "rollout k3 kl", "rollout ratio p50",
                    "rollout ratio p90", "rollout ratio p99", "rollout ratio max",
                    "rollout invalid logprobs", "rollout weight", "rollout masked fraction",
                    "rollout outside support"]
    assert out.report["rollout outside support"].tolist() == [1.0, 8.0]
    assert out.report["rollout masked fraction"].tolist() == [2.0, 8.0]  # e^-0.9, e^1.7
    tis = policy_loss(lp, old, adv, mask, rollout_logprobs=rollout,
                      rollout_correction=RolloutCorrection())
    assert tis.report["rollout truncated fraction"].tolist() == [2.0, 8.0]  # e^0.8, e^1.7
    alone = policy_loss(lp, old, adv, mask, rollout_outside=outside)
    assert alone.report["rollout outside support"].tolist() == [1.0, 8.0]
    assert all(r.dtype == torch.float32 and r.shape == (2,) and not r.requires_grad
               for r in out.report.values())


@pytest.mark.parametrize("make, name", [
    (lambda r, m: dict(rollout_correction=RolloutCorrection()), "rollout_logprobs"),
    (lambda r, m: dict(rollout_logprobs=r, rollout_correction="tis"), "rollout_correction"),
    (lambda r, m: dict(rollout_logprobs=r[:, :4]), "rollout_logprobs"),
    (lambda r, m: dict(rollout_logprobs=r.reshape(5, 3)), "rollout_logprobs"),
    (lambda r, m: dict(rollout_logprobs=r.long()), "rollout_logprobs"),
    (lambda r, m: dict(rollout_logprobs=r, rollout_outside=m.float()), "rollout_outside"),
    (lambda r, m: dict(rollout_logprobs=r, rollout_outside=m[:, :4]), "rollout_outside"),
    (lambda r, m: dict(rollout_outside=[True]), "rollout_outside"),
])
def test_policy_loss_rejects(make, name):
    lp, old, rollout, adv, mask = _inputs()
    with pytest.raises(ValueError, match=name):
        policy_loss(lp, old, adv, mask, **make(rollout, mask))


def test_policy_loss_sequence_level_needs_rows():
    lp, old, rollout, adv, mask = (t.reshape(-1) for t in _inputs())
    with pytest.raises(ValueError, match="level='sequence'"):
        policy_loss(lp, old, adv, mask, rollout_logprobs=rollout,
                    rollout_correction=RolloutCorrection(level="sequence"))
    # Token level works on any shape.
    out = policy_loss(lp, old, adv, mask, rollout_logprobs=rollout,
                      rollout_correction=RolloutCorrection())
    assert torch.isfinite(out.loss_sum)


# ---------------------------------------------------------------------------------------------
# mismatch_diagnostics


def test_diagnostics_match_hand_computation():
    _, old, rollout, _, mask = _inputs()
    cfg = RolloutCorrection(mode="mis")
    weights, flags = correction_weights(old, rollout, mask, cfg)
    outside = torch.zeros_like(mask)
    outside[1, 1] = outside[2, 2] = True
    report = mismatch_diagnostics(old, rollout, mask, weights, flags, flag_name="masked",
                                  outside=outside)
    cells = _cells(MASK)
    n = len(cells)
    d = [DIFF[i][j] for i, j in cells]
    ratios = sorted(math.exp(x) for x in d)

    def quantile(q):  # linear interpolation, as torch.quantile / numpy's default
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ratios[lo] + (pos - lo) * (ratios[hi] - ratios[lo])

    ref = ref_weights(cfg)
    expected = {
        "rollout |dlogprob|": [sum(abs(x) for x in d), n],
        "rollout k3 kl": [sum(math.exp(x) - 1 - x for x in d), n],
        "rollout ratio p50": [quantile(0.5), 1],
        "rollout ratio p90": [quantile(0.9), 1],
        "rollout ratio p99": [quantile(0.99), 1],
        "rollout ratio max": [max(ratios), 1],
        "rollout invalid logprobs": [0, n],
        "rollout weight": [sum(w for w, _ in ref.values()), n],
        "rollout masked fraction": [sum(f for _, f in ref.values()), n],
        "rollout outside support": [1, n],
    }
    assert list(report) == list(expected)
    for key, value in expected.items():
        assert report[key].dtype == torch.float32 and not report[key].requires_grad
        _assert_close(report[key], value, key, tol=1e-6)
    # The quantiles are torch.quantile's of the counted ratios.
    counted = torch.exp(old - rollout)[mask]
    for suffix, q in mv.rollout.RATIO_QUANTILES:
        _assert_close(report[f"rollout ratio {suffix}"][0], torch.quantile(counted, q),
                      suffix, tol=1e-6)


def test_diagnostics_average_over_microbatches():
    """Summing the pairs over microbatches and dividing (Megatron) gives token means of the
    step, and the mean of the per-microbatch quantiles."""
    _, old, rollout, _, mask = _inputs(row2=True)
    halves = [(old[:1], rollout[:1], mask[:1]), (old[1:], rollout[1:], mask[1:])]
    reports = [mismatch_diagnostics(*h) for h in halves]
    summed = {k: reports[0][k] + reports[1][k] for k in reports[0]}
    whole = mismatch_diagnostics(old, rollout, mask)
    for key in ("rollout |dlogprob|", "rollout k3 kl"):
        _assert_close(summed[key][0] / summed[key][1], whole[key][0] / whole[key][1], key,
                      tol=1e-6)
    p50 = [torch.quantile(torch.exp(o - r)[m], 0.5) for o, r, m in halves]
    _assert_close(summed["rollout ratio p50"][0] / summed["rollout ratio p50"][1],
                  (p50[0] + p50[1]) / 2, "p50", tol=1e-6)


def test_diagnostics_without_counted_tokens():
    _, old, rollout, _, mask = _inputs()
    report = mismatch_diagnostics(old, rollout, torch.zeros_like(mask))
    for key, value in report.items():
        assert value.tolist() == [0.0, 0.0], key
    # One counted token: every quantile is its ratio.
    one = torch.zeros_like(mask)
    one[0, 1] = True
    report = mismatch_diagnostics(old, rollout, one)
    for suffix, _ in mv.rollout.RATIO_QUANTILES:
        _assert_close(report[f"rollout ratio {suffix}"], [math.exp(0.8), 1.0], suffix, tol=1e-6)


@pytest.mark.parametrize("make, name", [
    (lambda w, m: dict(flag_name="clipped"), "flag_name"),
    (lambda w, m: dict(weights=w.long()), "weights"),
    (lambda w, m: dict(weights=w[:2]), "weights"),
    (lambda w, m: dict(flags=w), "flags"),
    (lambda w, m: dict(outside=m.int()), "outside"),
    (lambda w, m: dict(outside=m[:, :3]), "outside"),
    (lambda w, m: dict(rollout_logprobs=w[:, :3]), "rollout_logprobs"),
    (lambda w, m: dict(mask=None), "mask"),
])
def test_diagnostics_reject(make, name):
    _, old, rollout, _, mask = _inputs()
    weights, _ = correction_weights(old, rollout, mask, RolloutCorrection())
    args = dict(trainer_logprobs=old, rollout_logprobs=rollout, mask=mask)
    args.update(make(weights, mask))
    with pytest.raises(ValueError, match=name):
        mismatch_diagnostics(**args)


# ---------------------------------------------------------------------------------------------
# No host sync


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_no_host_sync(cfg):
    lp, old, rollout, adv, mask = _inputs()
    lp32 = lp.detach().float().requires_grad_()
    outside = torch.zeros_like(mask)
    with forbid_host_sync():
        out = policy_loss(lp32, old.float(), adv.float(), mask.float(),
                          rollout_logprobs=rollout.float(), rollout_correction=cfg,
                          rollout_outside=outside, aggregation="sequence-mean")
        out.loss_sum.backward()
        weights, flags = correction_weights(old, rollout, mask, cfg)
        mismatch_diagnostics(old, rollout, mask, weights, flags, flag_name=cfg.flag_name,
                             outside=outside)
    assert torch.isfinite(out.loss_sum) and torch.isfinite(lp32.grad).all()
    assert all(torch.isfinite(v).all() for v in out.report.values())


def test_diagnostics_stay_finite_for_an_impossible_target():
    """A -inf rollout log-prob (a target outside the sampler's kept set) is clamped at 20 nats,
    so it cannot turn the step's means into inf."""
    old = torch.tensor([[-1.0, -2.0]])
    rollout = torch.tensor([[-1.0, float("-inf")]])
    mask = torch.ones_like(old, dtype=torch.bool)
    report = mismatch_diagnostics(old, rollout, mask)
    assert all(torch.isfinite(v).all() for v in report.values())
    _assert_close(report["rollout |dlogprob|"], [20.0, 2.0], "|dlogprob|", tol=1e-6)
    _assert_close(report["rollout ratio max"], [math.exp(20.0), 1.0], "max", tol=1e-6)
