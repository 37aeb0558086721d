"""Single-process tests of the loss functions (megatron_vocabstats.losses) on CPU.

References: a plain-Python, token-by-token computation of the PPO / GRPO objective and of its
derivative (written from the formulas, sharing nothing with the vectorised code), explicit
single-token values for each branch, and torch's float64 ``F.cross_entropy`` for the SFT loss.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_vocabstats import VocabStats
from megatron_vocabstats.losses import (
    LossOutput,
    StatsOptions,
    StepBatch,
    logprobs_step,
    make_forward_step,
    model_tp_group,
    nll_loss,
    policy_loss,
    score_tokens,
    sft_loss,
    token_loss,
)
from megatron_vocabstats.testing import HostSyncError, forbid_host_sync


def _close(actual, expected, *, rtol=1e-5, atol=1e-5, what="value"):
    actual = torch.as_tensor(actual).double()
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.isfinite(actual).all(), f"{what}: non-finite values {actual}"
    err = (actual - expected).abs()
    assert bool((err <= atol + rtol * expected.abs()).all()), (
        f"{what}: max error {err.max().item():.3g}\nactual {actual}\nexpected {expected}"
    )


def _megatron_divide(out: LossOutput, num_microbatches: int = 1):
    """What the schedule does with the triple unless calculate_per_token_loss: divide in place."""
    loss = out.loss_sum
    loss /= torch.clamp(out.num_tokens, min=1)
    loss /= num_microbatches
    return loss


# ---------------------------------------------------------------------------------------------
# Plain-Python reference of the policy loss


def ref_policy(lp, old, adv, mask, *, ent=None, ref=None, clip_eps=0.2, clip_eps_high=None,
               dual_clip=None, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
               aggregation="token-mean"):
    """(loss_sum, num_units, report sums, count of tokens, d loss_sum/d lp, d loss_sum/d ent)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    total, units, tokens = 0.0, 0, 0
    sums = dict.fromkeys(["clip fraction", "dual clip fraction", "approx kl", "logprob",
                          "ref kl", "entropy"], 0.0)
    g_lp = [[0.0] * len(row) for row in lp]
    g_ent = [[0.0] * len(row) for row in lp]
    for i, row in enumerate(lp):
        live = [t for t in range(len(row)) if mask[i][t]]
        if not live:
            continue
        weight = 1.0 / len(live) if aggregation == "sequence-mean" else 1.0
        units += 1 if aggregation == "sequence-mean" else len(live)
        for t in live:
            tokens += 1
            a, log_ratio = adv[i][t], lp[i][t] - old[i][t]
            r = math.exp(log_ratio)
            plain, clipped = -a * r, -a * min(max(r, 1 - clip_eps), 1 + high)
            if clipped > plain:
                loss, grad = clipped, 0.0
                sums["clip fraction"] += 1
            else:
                loss, grad = plain, -a * r
            if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                loss, grad = -dual_clip * a, 0.0
                sums["dual clip fraction"] += 1
            if ref is not None:
                d = ref[i][t] - lp[i][t]
                if kl_estimator == "k1":
                    kl, dkl = -d, 1.0
                else:
                    kl, dkl = math.exp(d) - d - 1, 1.0 - math.exp(d)
                loss += kl_coef * kl
                grad += kl_coef * dkl
                sums["ref kl"] += kl
            if ent is not None:
                loss -= entropy_coef * ent[i][t]
                sums["entropy"] += ent[i][t]
                g_ent[i][t] = -entropy_coef * weight
            sums["approx kl"] += math.exp(log_ratio) - 1 - log_ratio
            sums["logprob"] += lp[i][t]
            total += weight * loss
            g_lp[i][t] = weight * grad
    return total, units, sums, tokens, g_lp, g_ent


def branch_batch(dtype=torch.float64):
    """4 rows x 5 tokens whose log-ratios hit every branch; row 3 is fully masked (with NaN)."""
    torch.manual_seed(3)
    # r = e^0.5 > 1.2 (clip high), e^-0.5 < 0.8 (clip low), e^+-0.1 inside, e^1.5 > 3 (dual).
    log_ratio = torch.tensor([[0.5, -0.5, 0.1, -0.1, 1.5]] * 4, dtype=torch.float64)
    adv = torch.tensor([[1.3, 0.7, 2.0, 0.4, 1.1],
                        [-0.7, -1.3, -0.4, -2.0, -0.9],
                        [1.0, -1.0, -0.5, 0.5, -1.5],
                        [1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    lp = -torch.rand(4, 5, dtype=torch.float64) * 3 - 0.1
    old = lp - log_ratio
    ref = lp + torch.randn(4, 5, dtype=torch.float64) * 0.3
    ent = torch.rand(4, 5, dtype=torch.float64) * 2
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 0, 1], [0, 0, 0, 0, 0]],
                        dtype=torch.float32)
    for t in (lp, old, adv, ref, ent):
        t[3] = float("nan")  # garbage where nothing counts must not leak
    old[2, 0] = float("inf")
    data = dict(lp=lp, old=old, adv=adv, ref=ref, ent=ent)
    return {k: v.to(dtype) for k, v in data.items()}, mask


def _lists(t):
    return t.double().tolist()


POLICY_OPTIONS = [
    {},
    {"clip_eps_high": 0.28},
    {"dual_clip": 3.0},
    {"kl_coef": 0.05, "kl_estimator": "k1"},
    {"kl_coef": 0.05, "kl_estimator": "k3"},
    {"entropy_coef": 0.01},
    {"aggregation": "sequence-mean"},
    {"aggregation": "sequence-mean", "dual_clip": 2.5, "kl_coef": 0.1, "entropy_coef": 0.02,
     "clip_eps": 0.1, "clip_eps_high": 0.3},
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("options", POLICY_OPTIONS, ids=lambda o: ",".join(map(str, o.items())))
def test_policy_loss_matches_hand_reference(options, dtype):
    data, mask = branch_batch(dtype)
    lp = data["lp"].clone().requires_grad_()
    ent = data["ent"].clone().requires_grad_()
    use_ref = "kl_coef" in options
    out = policy_loss(lp, data["old"], data["adv"], mask, entropy=ent,
                      ref_logprobs=data["ref"] if use_ref else None, **options)
    (out.loss_sum * 1.0).backward()
    total, units, sums, tokens, g_lp, g_ent = ref_policy(
        _lists(data["lp"]), _lists(data["old"]), _lists(data["adv"]), mask.tolist(),
        ent=_lists(data["ent"]), ref=_lists(data["ref"]) if use_ref else None, **options)

    assert out.loss_sum.dtype == torch.promote_types(dtype, torch.float32)
    assert out.loss_sum.shape == ()
    assert out.num_tokens.dtype == torch.int32 and int(out.num_tokens) == units
    _close(out.loss_sum, total, what="loss_sum")
    _close(lp.grad, g_lp, atol=1e-6, what="d loss / d logprobs")
    ent_grad = torch.zeros_like(ent) if ent.grad is None else ent.grad  # unused when coef is 0
    _close(ent_grad, g_ent, atol=1e-7, what="d loss / d entropy")

    expected_keys = {"policy loss", "clip fraction", "approx kl", "logprob", "entropy"}
    expected_keys |= {"dual clip fraction"} if options.get("dual_clip") else set()
    expected_keys |= {"ref kl"} if use_ref else set()
    assert set(out.report) == expected_keys
    _close(out.report["policy loss"], [total, units], what="report policy loss")
    for key in expected_keys - {"policy loss"}:
        pair = out.report[key]
        assert pair.shape == (2,) and pair.dtype == torch.float32 and not pair.requires_grad
        _close(pair, [sums[key], tokens], what=f"report {key}")


def test_branch_batch_hits_every_branch():
    """The batch above really exercises clip low, clip high, no clip and the dual clip."""
    data, mask = branch_batch()
    *_, sums, tokens, g_lp, _ = ref_policy(_lists(data["lp"]), _lists(data["old"]),
                                           _lists(data["adv"]), mask.tolist(), dual_clip=3.0)
    assert 0 < sums["clip fraction"] < tokens
    assert sums["dual clip fraction"] > 0
    assert any(g != 0 for row in g_lp for g in row)


def _one_token(log_ratio, adv, **options):
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0 - log_ratio]], dtype=torch.float64)
    out = policy_loss(lp, old, torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 1),
                      **options)
    out.loss_sum.backward()
    return out.loss_sum.item(), lp.grad.item(), out.report


@pytest.mark.parametrize(
    "log_ratio, adv, options, loss, grad",
    [
        # A > 0, r inside: -A r, gradient -A r.
        (0.1, 1.0, {}, -math.exp(0.1), -math.exp(0.1)),
        # A > 0, r > 1 + eps: the clipped term -A (1 + eps) is taken, gradient 0.
        (0.5, 2.0, {}, -2.0 * 1.2, 0.0),
        # clip-higher: 1.25 < 1 + 0.28, unclipped again.
        (math.log(1.25), 2.0, {"clip_eps_high": 0.28}, -2.5, -2.5),
        # A < 0, r < 1 - eps: -A (1 - eps), gradient 0.
        (-0.5, -1.0, {}, 0.8, 0.0),
        # A < 0, r > 1 + eps: -A r (the pessimistic term), gradient -A r.
        (1.5, -1.0, {}, math.exp(1.5), math.exp(1.5)),
        # ... capped by the dual clip at -c A, gradient 0.
        (1.5, -1.0, {"dual_clip": 3.0}, 3.0, 0.0),
        # dual clip never touches A > 0.
        (0.1, 1.0, {"dual_clip": 3.0}, -math.exp(0.1), -math.exp(0.1)),
    ],
)
def test_policy_single_token_branches(log_ratio, adv, options, loss, grad):
    got_loss, got_grad, _ = _one_token(log_ratio, adv, **options)
    assert got_loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
    assert got_grad == pytest.approx(grad, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("estimator, kl, dkl", [
    ("k1", 0.5, 1.0),                                          # lp - ref
    ("k3", math.exp(-0.5) + 0.5 - 1.0, 1.0 - math.exp(-0.5)),  # e^d - d - 1 with d = ref - lp
])
def test_kl_estimators_single_token(estimator, kl, dkl):
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5]], dtype=torch.float64)
    zero_adv = torch.zeros(1, 1, dtype=torch.float64)
    out = policy_loss(lp, lp.detach(), zero_adv, torch.ones(1, 1), ref_logprobs=ref,
                      kl_coef=0.5, kl_estimator=estimator)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(0.5 * kl, rel=1e-12)
    assert out.report["ref kl"][0].item() == pytest.approx(kl, rel=1e-6)
    assert lp.grad.item() == pytest.approx(0.5 * dkl, rel=1e-12)


def test_entropy_bonus_single_token():
    ent = torch.tensor([[1.7]], dtype=torch.float64, requires_grad=True)
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(lp, lp.detach(), torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1),
                      entropy=ent, entropy_coef=0.1)
    out.loss_sum.backward()
    assert out.loss_sum.item() == pytest.approx(-0.17, rel=1e-12)
    assert ent.grad.item() == pytest.approx(-0.1, rel=1e-12)


def test_token_mean_vs_sequence_mean():
    # Row 0: 1 token of loss -1 (A = 1, r = 1); row 1: 3 tokens of loss -2 (A = 2, r = 1).
    lp = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 9.0, 9.0], [2.0, 2.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    tok = policy_loss(lp, lp, adv, mask, aggregation="token-mean")
    seq = policy_loss(lp, lp, adv, mask, aggregation="sequence-mean")
    assert (tok.loss_sum.item(), int(tok.num_tokens)) == (-7.0, 4)
    assert (seq.loss_sum.item(), int(seq.num_tokens)) == (-3.0, 2)
    assert _megatron_divide(tok).item() == pytest.approx(-7.0 / 4)
    assert _megatron_divide(seq).item() == pytest.approx((-1.0 - 2.0) / 2)
    # Metrics stay token means in both modes.
    assert seq.report["logprob"].tolist() == [0.0, 4.0]


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_all_masked_rows_contribute_nothing(aggregation):
    data, mask = branch_batch()
    lp = data["lp"].clone().requires_grad_()
    ent = data["ent"].clone().requires_grad_()
    kw = dict(entropy=ent, ref_logprobs=data["ref"], kl_coef=0.1, entropy_coef=0.01,
              dual_clip=3.0, aggregation=aggregation)
    full = policy_loss(lp, data["old"], data["adv"], mask, **kw)
    full.loss_sum.backward()
    assert torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all()
    assert (lp.grad[3] == 0).all() and (ent.grad[3] == 0).all()
    assert all(torch.isfinite(v).all() for v in full.report.values())
    # Dropping the empty row changes nothing.
    kept = {k: v[:3] for k, v in data.items()}
    part = policy_loss(kept["lp"], kept["old"], kept["adv"], mask[:3], entropy=kept["ent"],
                       ref_logprobs=kept["ref"], kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0,
                       aggregation=aggregation)
    assert full.loss_sum.item() == pytest.approx(part.loss_sum.item(), rel=1e-12)
    assert int(full.num_tokens) == int(part.num_tokens)


@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean"])
def test_everything_masked_gives_zero_not_nan(aggregation):
    lp = torch.full((2, 3), float("nan"), requires_grad=True)
    nan = torch.full((2, 3), float("nan"))
    ent = torch.full((2, 3), float("nan"), requires_grad=True)
    out = policy_loss(lp, nan, nan, torch.zeros(2, 3), entropy=ent, ref_logprobs=nan,
                      kl_coef=0.1, entropy_coef=0.1, aggregation=aggregation)
    out.loss_sum.backward()
    assert out.loss_sum.item() == 0.0 and int(out.num_tokens) == 0
    assert (lp.grad == 0).all() and (ent.grad == 0).all()
    assert all(v.tolist() == [0.0, 0.0] for v in out.report.values())
    assert _megatron_divide(out).item() == 0.0


def test_huge_log_ratio_stays_finite():
    lp = torch.tensor([[200.0, -200.0]], requires_grad=True)
    out = policy_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and torch.isfinite(lp.grad).all()


# ---------------------------------------------------------------------------------------------
# SFT loss and scoring against torch's float64 cross-entropy


def _sft_case(dtype=torch.float32, vocab=37, width=37, seed=0):
    torch.manual_seed(seed)
    logits = (torch.randn(3, 5, width, dtype=torch.float64) * 3).to(dtype)
    labels = torch.randint(0, vocab, (3, 5))
    mask = torch.ones(3, 5)
    mask[0, :2] = 0
    mask[2] = 0  # an all-masked row
    labels[0, 0] = 10**6  # any label where the mask is 0
    labels[1, 3] = -100   # ignored by label
    return logits, labels, mask


def _reference_nll(logits, labels, mask, *, vocab, temperature=1.0, label_smoothing=0.0):
    keep = (mask != 0) & (labels != -100)
    z = logits.double()[..., :vocab] / temperature
    nll = F.cross_entropy(z.flatten(0, -2), torch.where(keep, labels, 0).flatten(),
                          reduction="none", label_smoothing=label_smoothing)
    return (nll * keep.flatten()).sum(), keep


@pytest.mark.parametrize("options", [
    {}, {"label_smoothing": 0.1}, {"temperature": 0.7}, {"vocab_size": 33},
], ids=["plain", "label_smoothing", "temperature", "padded_vocab"])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_sft_loss_matches_float64_cross_entropy(options, chunk_size):
    vocab = options.get("vocab_size", 37)
    logits, labels, mask = _sft_case(vocab=vocab)
    leaf = logits.clone().requires_grad_()
    out = sft_loss(leaf, labels, mask, chunk_size=chunk_size, entropy="metric", **options)
    _megatron_divide(out).backward()

    ref_leaf = logits.double().requires_grad_()
    ref_sum, keep = _reference_nll(ref_leaf, labels, mask, vocab=vocab,
                                   temperature=options.get("temperature", 1.0),
                                   label_smoothing=options.get("label_smoothing", 0.0))
    (ref_sum / keep.sum()).backward()
    assert int(out.num_tokens) == int(keep.sum()) == 7
    _close(out.loss_sum * out.num_tokens, ref_sum, what="loss_sum")  # divided in place above
    _close(out.report["lm loss"], [ref_sum.item(), 7], what="report lm loss")
    _close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6, what="d loss / d logits")
    z = logits.double()[..., :vocab] / options.get("temperature", 1.0)
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    _close(out.report["entropy"], [(ref_ent * keep).sum().item(), 7], what="report entropy")


def test_sft_loss_bf16_logits():
    logits, labels, mask = _sft_case(dtype=torch.bfloat16)
    out = sft_loss(logits, labels, mask)
    ref_sum, keep = _reference_nll(logits, labels, mask, vocab=37)
    # numerics.md: bf16 inputs give logprobs within 2e-2 absolute of float64 (on bf16 logits).
    _close(out.loss_sum, ref_sum, rtol=0, atol=2e-2 * int(keep.sum()), what="bf16 loss_sum")


def test_sft_loss_without_entropy_reports_lm_loss_only():
    logits, labels, mask = _sft_case()
    out = sft_loss(logits, labels, mask)
    assert set(out.report) == {"lm loss"}
    assert out.loss_sum.dtype == torch.float32 and out.num_tokens.dtype == torch.int32


def test_sft_loss_accepts_precomputed_stats_and_callable():
    logits, labels, mask = _sft_case()
    direct = sft_loss(logits, labels, mask, entropy="metric")
    keep = (mask != 0) & (labels != -100)
    z = logits.double()
    picked = z.log_softmax(-1).gather(-1, torch.where(keep, labels, 0)[..., None])[..., 0]
    lp = torch.where(keep, picked, 0.0)
    ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    stats = VocabStats(lp.float(), ent.float(), torch.logsumexp(z, -1).float())
    from_stats = sft_loss(stats, labels, mask, entropy="metric")
    _close(from_stats.loss_sum, direct.loss_sum.item(), what="VocabStats path")

    seen = {}

    def fused(target, **kwargs):
        seen.update(kwargs, target=target)
        return stats

    from_callable = sft_loss(fused, labels, mask, entropy="metric", chunk_size=3, vocab_size=37)
    _close(from_callable.loss_sum, direct.loss_sum.item(), what="callable path")
    assert seen["chunk_size"] == 3 and seen["vocab_size"] == 37 and seen["entropy"] == "metric"
    assert seen["ignore_index"] == -100 and seen["tp_group"] is None
    # Every option reaches the callable, the ops' defaults too (StatsOptions.op_kwargs).
    assert seen["batch_invariant"] is False and seen["kernel"] == "auto"
    assert (seen["target"][~keep] == -100).all() and (seen["target"][keep] == labels[keep]).all()


def test_sft_and_policy_loss_through_the_fused_lm_head():
    fused = pytest.importorskip("megatron_vocabstats.ops.stats.from_hidden")
    torch.manual_seed(1)
    hidden = torch.randn(3, 5, 8)
    weight = torch.randn(37, 8)
    _, labels, mask = _sft_case()
    loss_fn = functools.partial(policy_loss, entropy_coef=0.1, aggregation="sequence-mean")
    rollout = {"old_logprobs": torch.randn(3, 5) - 3, "advantages": torch.randn(3, 5)}
    results = []
    for fused_head in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        output = (functools.partial(fused.linear_vocab_parallel_stats, h, w) if fused_head
                  else h @ w.t())
        sft = sft_loss(output, labels, mask, label_smoothing=0.1, chunk_size=4)
        pol = token_loss(output, labels, mask, loss_fn=loss_fn, loss_inputs=rollout,
                         options=StatsOptions(entropy="grad", chunk_size=4))
        (sft.loss_sum + pol.loss_sum).backward()
        results.append((sft.loss_sum, pol.loss_sum, h.grad, w.grad))
    for a, b, what in zip(*results, ["sft loss", "policy loss", "d hidden", "d weight"]):
        _close(a, b.detach(), rtol=1e-5, atol=1e-5, what=what)


def test_logprobs_step_scores_tokens():
    logits, labels, mask = _sft_case()
    keep = (mask != 0) & (labels != -100)
    with torch.no_grad():
        out = logprobs_step(logits, labels, mask, temperature=0.9)
        only = logprobs_step(logits, labels, mask, temperature=0.9, non_loss_data=True)
    z = logits.double() / 0.9
    ref_lp = z.log_softmax(-1).gather(-1, torch.where(keep, labels, 0)[..., None])[..., 0]
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    loss_sum, num_tokens, scores = out
    assert loss_sum.item() == 0.0 and int(num_tokens) == 7
    assert set(scores) == set(only) == {"logprobs", "entropy"}
    _close(scores["logprobs"], torch.where(keep, ref_lp, 0.0), what="logprobs")
    _close(scores["entropy"], torch.where(keep, ref_ent, 0.0), what="entropy")
    assert torch.equal(only["logprobs"], scores["logprobs"])
    assert set(logprobs_step(logits, labels, mask, entropy=False).report) == {"logprobs"}


def test_score_tokens_zeroes_unscored_positions():
    lp = torch.tensor([[-1.0, float("nan"), -2.0]], requires_grad=True)
    ent = torch.tensor([[0.5, 7.0, float("inf")]])
    mask = torch.tensor([[1, 0, 0]])
    scores = score_tokens(lp, mask, entropy=ent).report
    assert scores["logprobs"].tolist() == [[-1.0, 0.0, 0.0]]
    assert scores["entropy"].tolist() == [[0.5, 0.0, 0.0]]
    assert not scores["logprobs"].requires_grad


# ---------------------------------------------------------------------------------------------
# Bad input


def _policy_args():
    x = torch.zeros(2, 3)
    return dict(logprobs=x, old_logprobs=x, advantages=x, loss_mask=torch.ones(2, 3))


@pytest.mark.parametrize("change, match", [
    (dict(loss_mask=None), "loss_mask is required"),
    (dict(loss_mask=torch.ones(2, 4)), "loss_mask has shape"),
    (dict(old_logprobs=torch.zeros(3, 2)), "old_logprobs has shape"),
    (dict(advantages=torch.zeros(2)), "advantages has shape"),
    (dict(ref_logprobs=torch.zeros(2, 2)), "ref_logprobs has shape"),
    (dict(entropy=torch.zeros(1, 3)), "entropy has shape"),
    (dict(logprobs=torch.zeros(2, 3, dtype=torch.long)), "logprobs must be a floating"),
    (dict(old_logprobs=None), "old_logprobs must be a tensor"),
    (dict(logprobs=torch.tensor(0.0)), "logprobs must have at least one"),
    (dict(aggregation="mean"), "aggregation must be one of"),
    (dict(kl_estimator="k2"), "kl_estimator must be one of"),
    (dict(clip_eps=0.0), "clip_eps must be a finite number in \\(0, 1\\)"),
    (dict(clip_eps=1.0), "clip_eps must be a finite number in \\(0, 1\\), got 1.0"),
    (dict(clip_eps_high=-0.1), "clip_eps_high must be a finite number > 0"),
    (dict(dual_clip=1.0), "dual_clip must be a finite number > 1"),
    (dict(kl_coef=-1.0), "kl_coef must be a finite number >= 0"),
    (dict(entropy_coef=float("nan")), "entropy_coef must be a finite number, got nan"),
    (dict(kl_coef=0.1), "kl_coef > 0 needs ref_logprobs"),
    (dict(entropy_coef=0.1), "entropy_coef != 0 needs entropy"),
    (dict(logprobs=torch.zeros(6), old_logprobs=torch.zeros(6), advantages=torch.zeros(6),
          loss_mask=torch.ones(6), aggregation="sequence-mean"), "needs \\[b, s\\] logprobs"),
])
def test_policy_loss_rejects_bad_input(change, match):
    kwargs = {**_policy_args(), **change}
    with pytest.raises(ValueError, match=match):
        policy_loss(**kwargs)


def test_policy_loss_rejects_entropy_without_gradient():
    args = _policy_args()
    args["logprobs"] = args["logprobs"].clone().requires_grad_()
    with pytest.raises(ValueError, match="entropy has no gradient"):
        policy_loss(**args, entropy=torch.zeros(2, 3), entropy_coef=0.1)


@pytest.mark.parametrize("fn", [nll_loss, score_tokens])
def test_per_token_losses_need_a_mask(fn):
    with pytest.raises(ValueError, match="loss_mask is required"):
        fn(torch.zeros(2, 3), None)
    with pytest.raises(ValueError, match="entropy has shape"):
        fn(torch.zeros(2, 3), torch.ones(2, 3), entropy=torch.zeros(3))


@pytest.mark.parametrize("change, match", [
    (dict(loss_mask=None), "loss_mask is required"),
    (dict(loss_mask=torch.ones(3, 4)), "loss_mask has shape"),
    (dict(labels=torch.zeros(3, 5)), "labels must hold integer"),
    (dict(logits=[1.0]), "output must be logits"),
    (dict(logits=torch.zeros(3, 4, 37)), "target shape"),
    (dict(entropy="maybe"), "entropy must be one of"),
    (dict(label_smoothing=1.5), "label_smoothing"),
])
def test_sft_loss_rejects_bad_input(change, match):
    logits, labels, mask = _sft_case()
    kwargs = {"logits": logits, "labels": labels, "loss_mask": mask, **change}
    with pytest.raises(ValueError, match=match):
        sft_loss(**kwargs)


def test_stats_without_requested_entropy_are_rejected():
    logits, labels, mask = _sft_case()
    stats = VocabStats(torch.zeros(3, 5), None, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="carry no entropy"):
        sft_loss(stats, labels, mask, entropy="metric")
    with pytest.raises(ValueError, match="logprobs shaped like labels"):
        sft_loss(VocabStats(torch.zeros(3, 4), None, torch.zeros(3, 4)), labels, mask)


# ---------------------------------------------------------------------------------------------
# No host synchronisation


def test_forbid_host_sync_catches_a_sync_on_this_path():
    logits, labels, mask = _sft_case()
    with forbid_host_sync(), pytest.raises(HostSyncError):
        sft_loss(logits, labels, mask, validate=True)  # the op's validation reads the host


def test_losses_never_sync_with_the_host():
    logits, labels, mask = _sft_case()
    data, pmask = branch_batch(torch.float32)
    with forbid_host_sync():
        leaf = logits.clone().requires_grad_()
        out = sft_loss(leaf, labels, mask, label_smoothing=0.1, entropy="metric", chunk_size=4)
        _megatron_divide(out).backward()

        leaf2 = logits.clone().requires_grad_()
        step_loss = functools.partial(policy_loss, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01,
                                      aggregation="sequence-mean")
        out = token_loss(leaf2, labels, mask, loss_fn=step_loss,
                         loss_inputs=dict(old_logprobs=torch.randn(3, 5),
                                          advantages=torch.randn(3, 5),
                                          ref_logprobs=torch.randn(3, 5)),
                         options=StatsOptions(entropy="grad"))
        _megatron_divide(out).backward()

        lp = data["lp"].clone().requires_grad_()
        policy_loss(lp, data["old"], data["adv"], pmask).loss_sum.backward()
        with torch.no_grad():
            logprobs_step(logits, labels, mask)
    assert leaf.grad is not None and leaf2.grad is not None and lp.grad is not None


# ---------------------------------------------------------------------------------------------
# forward_step factory with a tiny fake model (no Megatron)


class TinyLM(torch.nn.Module):
    """Embedding + output layer; like GPTModel, returns logits [b, s, V] when labels is None."""

    def __init__(self, vocab=37, hidden=8, tp_group=None):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.output_layer = torch.nn.Linear(hidden, vocab, bias=False)
        self.tp_group = tp_group
        self.plans = 0

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None):
        assert labels is None
        return self.output_layer(self.embedding(input_ids))

    def build_schedule_plan(self, **inputs):
        self.plans += 1
        return self(**inputs)


class HalfWrapper(torch.nn.Module):
    """Like Megatron's Float16Module: an ``fp32_output`` keyword, ``.module`` inside."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.fp32_output_seen = []

    def forward(self, *inputs, fp32_output=True, **kwargs):
        self.fp32_output_seen.append(fp32_output)
        out = self.module(*inputs, **kwargs)
        return out.float() if fp32_output else out


class DDPWrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def _batches(n=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, 37, (2, 6), generator=gen)
        mask = torch.ones(2, 6)
        mask[1, 4:] = 0
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "mask": mask[:, 1:],
               "old": torch.randn(2, 5, generator=gen) - 3.0,
               "adv": torch.randn(2, 5, generator=gen)}


def _sft_batch(it):
    b = next(it)
    return StepBatch({"input_ids": b["tokens"]}, b["labels"], b["mask"])


def _policy_batch(it):
    b = next(it)
    return StepBatch({"input_ids": b["tokens"]}, b["labels"], b["mask"],
                     {"old_logprobs": b["old"], "advantages": b["adv"]})


def _run_schedule(forward_step, model, num_microbatches, *extra, **kwargs):
    """A minimal no-pipelining schedule: forward, loss, in-place division, backward."""
    it = _batches(num_microbatches)
    reports = []
    for _ in range(num_microbatches):
        output, loss_func = forward_step(it, model, *extra, **kwargs)
        out = loss_func(output)
        assert len(out) == 3
        _megatron_divide(out, num_microbatches).backward()
        reports.append(out.report)
    return reports


def test_forward_step_sft_matches_direct_loss():
    torch.manual_seed(0)
    inner = TinyLM()
    model = DDPWrapper(HalfWrapper(inner))
    step = make_forward_step(_sft_batch, nll_loss)
    reports = _run_schedule(step, model, 2, None)  # checkpoint_activations_microbatch, positional
    assert model.module.fp32_output_seen == [False, False]
    grads = [p.grad.clone() for p in inner.parameters()]

    inner.zero_grad()
    total = 0.0
    for b in _batches(2):
        logits = inner(b["tokens"]).double()
        ref_sum, keep = _reference_nll(logits, b["labels"], b["mask"], vocab=37)
        total = total + ref_sum / keep.sum() / 2
    total.backward()
    for got, ref in zip(grads, inner.parameters()):
        _close(got, ref.grad, rtol=1e-5, atol=1e-6, what="parameter gradient")
    assert [set(r) for r in reports] == [{"lm loss"}] * 2


def test_forward_step_policy_and_schedule_plan():
    torch.manual_seed(0)
    inner = TinyLM()
    loss_fn = functools.partial(policy_loss, clip_eps=0.2, entropy_coef=0.01, dual_clip=3.0,
                                aggregation="sequence-mean")
    step = make_forward_step(_policy_batch, loss_fn, stats=StatsOptions(entropy="grad"))
    reports = _run_schedule(step, inner, 2, return_schedule_plan=True)
    assert inner.plans == 2
    grads = [p.grad.clone() for p in inner.parameters()]

    inner.zero_grad()
    total = 0.0
    for b in _batches(2):
        logits = inner(b["tokens"]).double()
        logp = logits.log_softmax(-1)
        lp = logp.gather(-1, b["labels"][..., None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        out = policy_loss(lp, b["old"].double(), b["adv"].double(), b["mask"], entropy=ent,
                          clip_eps=0.2, entropy_coef=0.01, dual_clip=3.0,
                          aggregation="sequence-mean")
        total = total + out.loss_sum / out.num_tokens.clamp(min=1) / 2
    total.backward()
    for got, ref in zip(grads, inner.parameters()):
        _close(got, ref.grad, rtol=1e-5, atol=1e-6, what="parameter gradient")
    assert "entropy" in reports[0] and "clip fraction" in reports[0]


def test_forward_step_scoring_non_loss_data():
    inner = TinyLM()
    step = make_forward_step(_sft_batch, score_tokens, tp_group=None,
                             stats=StatsOptions(entropy="metric"))
    with torch.no_grad():
        output, loss_func = step(_batches(1), inner)
        scores = loss_func(output, non_loss_data=True)
    assert set(scores) == {"logprobs", "entropy"} and scores["logprobs"].shape == (2, 5)


def test_forward_step_reads_the_models_tp_group():
    marker = object()
    assert model_tp_group(DDPWrapper(HalfWrapper(TinyLM(tp_group=marker)))) is marker

    class PgCollection:
        tp = marker

    inner = TinyLM()
    del inner.tp_group
    inner.pg_collection = PgCollection()
    assert model_tp_group(HalfWrapper(inner)) is marker
    seen = []
    step = make_forward_step(_sft_batch, nll_loss)
    _, loss_func = step(_batches(1), HalfWrapper(inner))
    seen.append(loss_func.keywords["tp_group"])
    _, loss_func = make_forward_step(_sft_batch, nll_loss, tp_group=None)(_batches(1), inner)
    seen.append(loss_func.keywords["tp_group"])
    assert seen == [marker, None]


def test_forward_step_rejects_bad_setup():
    with pytest.raises(ValueError, match="batch_fn must be callable"):
        make_forward_step(None, nll_loss)
    with pytest.raises(ValueError, match="loss_fn must be callable"):
        make_forward_step(_sft_batch, "nll")
    with pytest.raises(ValueError, match="tp_group must be"):
        make_forward_step(_sft_batch, nll_loss, tp_group="tp")

    def with_labels(it):
        b = next(it)
        return StepBatch({"input_ids": b["tokens"], "labels": b["labels"]}, b["labels"], b["mask"])

    with pytest.raises(ValueError, match="must not contain labels"):
        make_forward_step(with_labels, nll_loss, tp_group=None)(_batches(1), TinyLM())
    with pytest.raises(ValueError, match="must return a StepBatch"):
        make_forward_step(lambda it: next(it), nll_loss, tp_group=None)(_batches(1), TinyLM())

    def clashing(it):
        b = next(it)
        return StepBatch({"input_ids": b["tokens"]}, b["labels"], b["mask"],
                         {"loss_mask": b["mask"]})

    output, loss_func = make_forward_step(clashing, nll_loss, tp_group=None)(_batches(1), TinyLM())
    with pytest.raises(ValueError, match="loss_inputs must not set"):
        loss_func(output)
