"""Top-k distillation losses (distill.py) against float64 references, single process; the
tensor-parallel cases are in test_topk_dist.py."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from megatron_vocabstats import (
    TopK,
    distillation_loss,
    linear_vocab_parallel_topk_logprobs,
    topk_divergence,
    vocab_parallel_topk,
)
from megatron_vocabstats.distill import bregman_kl, log1mexp
from megatron_vocabstats.testing import forbid_host_sync

DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.1), ("jsd", 0.5), ("jsd", 0.9)]
MODES = [dict(), dict(tail_bucket=True), dict(renormalize=True)]
MODE_IDS = ["topk", "tail", "renormalized"]


def reference_divergence(lq, lp, divergence, beta=0.5, tail_bucket=False, renormalize=False):
    """float64 per-token divergence from student/teacher log-probs [..., k] (the docstring's
    definition: generalised KL sum a log(a/b) - a + b over the buckets)."""
    q, p = lq.double().exp(), lp.double().exp()
    if renormalize:
        q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
    if tail_bucket:
        q = torch.cat([q, (1 - q.sum(-1, keepdim=True)).clamp(min=0)], -1)
        p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp(min=0)], -1)

    def kl(a, b):
        return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b) - a + b).sum(-1)

    if divergence == "forward_kl":
        return kl(p, q)
    if divergence == "reverse_kl":
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def _case(dtype=torch.float32, tokens=(3, 6), vocab=50, width=56, k=5, seed=0):
    torch.manual_seed(seed)
    teacher_logits = (torch.randn(*tokens, width) * 2.5).to(dtype)
    student_logits = (torch.randn(*tokens, width) * 2.5).to(dtype)
    teacher = vocab_parallel_topk(teacher_logits, k, vocab_size=vocab)
    mask = torch.rand(tokens) > 0.25
    mask.view(-1)[0] = False
    return student_logits, teacher, mask


def _reference_loss(student_logits, teacher, mask, vocab, temperature=1.0, **options):
    leaf = student_logits.detach().double().requires_grad_()
    lq = torch.log_softmax(leaf[..., :vocab] / temperature, -1).gather(-1, teacher.indices)
    per = reference_divergence(lq, teacher.logprobs, **options)
    loss = torch.where(mask, per, 0.0).sum()
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_loss_and_grad_match_float64(divergence, beta, mode):
    student_logits, teacher, mask = _case()
    leaf = student_logits.clone().requires_grad_()
    out = distillation_loss(leaf, teacher, mask, vocab_size=50, divergence=divergence, beta=beta,
                            temperature=0.8, chunk_size=4, **mode)
    out.loss_sum.backward()
    ref, ref_grad = _reference_loss(student_logits, teacher, mask, 50, temperature=0.8,
                                    divergence=divergence, beta=beta, **mode)
    assert out.num_tokens.dtype == torch.int32 and int(out.num_tokens) == int(mask.sum())
    assert abs(out.loss_sum.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item()))
    err = (leaf.grad.double() - ref_grad).abs().max().item()
    assert err <= 1e-5, f"gradient off by {err}"
    assert bool((leaf.grad[~mask] == 0).all())


def test_bf16_student_matches_float64():
    student_logits, teacher, mask = _case(torch.bfloat16)
    leaf = student_logits.clone().requires_grad_()
    out = distillation_loss(leaf, teacher, mask, vocab_size=50, tail_bucket=True)
    out.loss_sum.backward()
    ref, ref_grad = _reference_loss(student_logits, teacher, mask, 50, divergence="forward_kl",
                                    tail_bucket=True)
    assert abs(out.loss_sum.item() - ref.item()) <= 2e-2 * (1 + abs(ref.item()))
    assert leaf.grad.dtype == torch.bfloat16
    err = (leaf.grad.double() - ref_grad).abs()
    assert bool((err <= 2**-8 * ref_grad.abs() + 1e-6).all()), err.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_student_equal_to_teacher_gives_exact_zero(dtype, divergence, beta, mode):
    torch.manual_seed(1)
    logits = (torch.randn(4, 7, 64) * 3).to(dtype)
    teacher = vocab_parallel_topk(logits, 6, vocab_size=60, temperature=0.9)
    leaf = logits.clone().requires_grad_()
    out = distillation_loss(leaf, teacher, torch.ones(4, 7), vocab_size=60, temperature=0.9,
                            divergence=divergence, beta=beta, **mode)
    assert out.loss_sum.item() == 0.0
    out.loss_sum.backward()
    assert torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_divergence_nonnegative_on_random_inputs(divergence, beta, mode):
    torch.manual_seed(2)
    lp = torch.log_softmax(torch.randn(2000, 8) * 3, -1)[:, :6]
    for noise in (0.0, 1e-7, 1e-4, 1.0, 10.0):
        lq = (lp + noise * torch.randn_like(lp)).clamp(max=0)
        lq = torch.where(lq.exp().sum(-1, keepdim=True) < 1, lq, lq - 0.01)
        per = topk_divergence(lq, lp, torch.ones(2000), divergence=divergence, beta=beta, **mode)
        assert bool((per >= 0).all()), f"noise {noise}: min {per.min().item()}"
        if noise == 0.0:
            assert bool((per == 0).all())


def test_bregman_kl_edges():
    lp = torch.tensor([0.0, -1.0, float("-inf"), float("-inf"), -2.0, -30.0, -1e-3])
    lq = torch.tensor([0.0, -3.0, -2.0, float("-inf"), float("-inf"), -1.0, -20.0])
    got = bregman_kl(lp.requires_grad_(), lq.requires_grad_())
    p, q = lp.detach().double().exp(), lq.detach().double().exp()
    want = torch.special.xlogy(p, p) - torch.special.xlogy(p, q) - p + q
    assert got[4].item() == float("inf") and got[0].item() == 0.0 and got[3].item() == 0.0
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite].double(), want[finite], rtol=1e-6, atol=1e-12)
    got[finite].sum().backward()
    assert torch.isfinite(lp.grad).all() and torch.isfinite(lq.grad).all()


def test_log1mexp_is_stable_at_both_ends():
    x = torch.tensor([-1e-12, -1e-7, -0.5, -0.7, -1.0, -30.0, -800.0, 0.0, 1e-6],
                     dtype=torch.float64)
    # Each side of the reference uses the formula that is accurate there (switching at -0.5).
    want = [float("-inf") if v >= 0 else math.log(-math.expm1(v)) if v > -0.5
            else math.log1p(-math.exp(v)) for v in x.tolist()]
    got = log1mexp(x)
    for g, w, v in zip(got.tolist(), want, x.tolist()):
        assert (g == w) if math.isinf(w) else abs(g - w) <= 1e-12 * abs(w) + 1e-300, (v, g, w)
    assert log1mexp(torch.tensor([-1e-6], dtype=torch.float32)).item() == pytest.approx(
        math.log(1e-6), rel=1e-5)


@pytest.mark.parametrize("tail_mass", [1e-9, 0.5, 1 - 1e-9])
@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_tail_bucket_against_float64(tail_mass, divergence, beta):
    torch.manual_seed(3)
    w = torch.softmax(torch.randn(64, 4, dtype=torch.float64), -1)
    lp = torch.log(w * (1 - tail_mass))
    ws = torch.softmax(torch.randn(64, 4, dtype=torch.float64), -1)
    lq = torch.log(ws * torch.rand(64, 1, dtype=torch.float64).clamp(min=0.05))
    for dtype in (torch.float64, torch.float32):
        if dtype == torch.float32 and tail_mass < 1e-6 and divergence == "reverse_kl":
            # log p_tail of a 1e-9 tail is not defined by fp32 log-probs (their sum is known to
            # ~6e-8): reverse KL's q_tail log(q_tail / p_tail) is then ill-conditioned.
            continue
        got = topk_divergence(lq.to(dtype), lp.to(dtype), torch.ones(64), divergence=divergence,
                              beta=beta, tail_bucket=True)
        want = reference_divergence(lq.to(dtype), lp.to(dtype), divergence, beta, tail_bucket=True)
        # float64: the inputs fix a 1e-9 tail only to ~1e-16 / 1e-9 = 1e-7 relative.
        tol = 1e-6 if dtype == torch.float64 else 1e-5
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol), \
            (dtype, (got.double() - want).abs().max().item())


def test_reverse_kl_with_minus_inf_teacher_at_masked_positions():
    student_logits, teacher, mask = _case(k=4)
    lp = teacher.logprobs.clone()
    lp[~mask] = float("-inf")
    idx = teacher.indices.clone()
    idx[~mask] = 0  # padded positions: k copies of id 0
    leaf = student_logits.clone().requires_grad_()
    out = distillation_loss(leaf, TopK(lp, idx), mask, vocab_size=50, divergence="reverse_kl",
                            tail_bucket=True)
    assert math.isfinite(out.loss_sum.item())
    out.loss_sum.backward()
    assert torch.isfinite(leaf.grad).all()
    assert bool((leaf.grad[~mask] == 0).all())
    ref, _ = _reference_loss(student_logits, TopK(torch.where(mask[..., None], lp, 0.0), idx),
                             mask, 50, divergence="reverse_kl", tail_bucket=True)
    assert abs(out.loss_sum.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item()))


def test_masked_positions_hold_anything():
    lq = torch.randn(3, 4).clamp(max=-0.5)
    lq[1, :2] = float("nan")
    lq[1, 2:] = float("-inf")
    lq.requires_grad_()
    lp = torch.randn(3, 4).clamp(max=-0.5)
    lp[1] = float("nan")
    mask = torch.tensor([1, 0, 1])
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        per = topk_divergence(lq, lp, mask, divergence=divergence, tail_bucket=True)
        assert per[1].item() == 0.0 and torch.isfinite(per).all()
        lq.grad = None
        per.sum().backward()
        assert bool((lq.grad[1] == 0).all()) and torch.isfinite(lq.grad).all()


def test_missing_or_bad_mask_raises():
    student_logits, teacher, _ = _case()
    with pytest.raises(ValueError, match="loss_mask is required"):
        distillation_loss(student_logits, teacher, None, vocab_size=50)
    with pytest.raises(ValueError, match="loss_mask is required"):
        topk_divergence(teacher.logprobs, teacher.logprobs, None)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        distillation_loss(student_logits, teacher, torch.ones(3), vocab_size=50)


def test_vocab_mismatch_raises():
    student_logits, teacher, mask = _case()
    with pytest.raises(ValueError, match="teacher_vocab_size"):
        distillation_loss(student_logits, teacher, mask, vocab_size=50, teacher_vocab_size=64)
    with pytest.raises(ValueError, match="teacher_vocab_size"):
        distillation_loss(student_logits, teacher, mask, teacher_vocab_size=50)  # student: 56
    far = TopK(teacher.logprobs, teacher.indices.clone())
    far.indices[mask] = 52  # ids of a larger teacher vocabulary
    with pytest.raises(ValueError, match="outside"):
        distillation_loss(student_logits, far, mask, vocab_size=50, validate=True)
    out = distillation_loss(student_logits, far, mask, vocab_size=50)  # no host check: NaN
    assert math.isnan(out.loss_sum.item())


@pytest.mark.parametrize("kwargs, match", [
    (dict(divergence="kl"), "divergence"), (dict(divergence="jsd", beta=1.0), "beta"),
    (dict(tail_bucket=True, renormalize=True), "exclude"), (dict(temperature=0.0), "temperature"),
])
def test_bad_options_raise(kwargs, match):
    student_logits, teacher, mask = _case()
    with pytest.raises(ValueError, match=match):
        distillation_loss(student_logits, teacher, mask, vocab_size=50, **kwargs)


def test_bad_teacher_raises():
    student_logits, teacher, mask = _case()
    with pytest.raises(ValueError, match="teacher"):
        distillation_loss(student_logits, teacher.logprobs, mask, vocab_size=50)
    with pytest.raises(ValueError, match="teacher.indices"):
        distillation_loss(student_logits, TopK(teacher.logprobs, teacher.logprobs), mask)


def test_report_and_megatron_contract():
    student_logits, teacher, mask = _case()
    out = distillation_loss(student_logits, teacher, mask, vocab_size=50, tail_bucket=True)
    loss_sum, num_tokens, report = out
    assert set(report) == {"distill loss", "teacher topk mass", "student topk mass"}
    assert torch.equal(report["distill loss"], torch.stack([loss_sum.detach(),
                                                            num_tokens.float()]))
    mass = report["teacher topk mass"]
    want = (teacher.logprobs.exp().sum(-1) * mask).sum()
    assert abs(mass[0].item() - want.item()) <= 1e-5 and mass[1].item() == mask.sum().item()


def test_fused_student_equals_unfused():
    torch.manual_seed(4)
    hidden = torch.randn(2, 5, 16).to(torch.bfloat16)
    weight = torch.randn(56, 16).to(torch.bfloat16)
    logits = torch.cat([hidden.view(-1, 16)[i:i + 4] @ weight.t() for i in range(0, 10, 4)])
    teacher = vocab_parallel_topk(torch.randn(2, 5, 56), 4, vocab_size=50)
    mask = torch.ones(2, 5)
    unfused = distillation_loss(logits.view(2, 5, 56), teacher, mask, vocab_size=50, chunk_size=4,
                                divergence="jsd")
    fused = distillation_loss(functools.partial(linear_vocab_parallel_topk_logprobs, hidden,
                                                weight), teacher, mask, vocab_size=50,
                              chunk_size=4, divergence="jsd")
    assert torch.equal(unfused.loss_sum, fused.loss_sum)


def test_losses_never_sync_with_the_host():
    student_logits, teacher, mask = _case(torch.bfloat16)
    with forbid_host_sync():
        for divergence, beta in DIVERGENCES:
            for mode in MODES:
                leaf = student_logits.clone().requires_grad_()
                out = distillation_loss(leaf, teacher, mask, vocab_size=50, divergence=divergence,
                                        beta=beta, **mode)
                (out.loss_sum / out.num_tokens.clamp(min=1)).backward()


def test_guard_sees_the_loss():
    from megatron_vocabstats.testing import HostSyncError

    student_logits, teacher, mask = _case()
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            distillation_loss(student_logits, teacher, mask, vocab_size=50, validate=True)
