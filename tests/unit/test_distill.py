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


def reference_divergence(lq, lp, divergence, beta=0.5, tail_bucket=False, renormalize=False,
                         tail_floor=0.0):
    """float64 per-token divergence from student/teacher log-probs [..., k] (the docstring's
    definition: generalised KL sum a log(a/b) - a + b over the buckets; tail masses floored at
    ``tail_floor``)."""
    q, p = lq.double().exp(), lp.double().exp()
    if renormalize:
        q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
    if tail_bucket:
        q = torch.cat([q, (1 - q.sum(-1, keepdim=True)).clamp(min=tail_floor)], -1)
        p = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp(min=tail_floor)], -1)

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
    fused = functools.partial(linear_vocab_parallel_topk_logprobs, torch.randn(3, 6, 8),
                              torch.randn(56, 8))
    with pytest.raises(ValueError, match="pass the student's vocab_size"):
        distillation_loss(fused, teacher, mask, teacher_vocab_size=50)
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


# ------------------------------------------------------------------- review: edge cases


@pytest.mark.parametrize("scale", [False, True])
def test_temperature_scale_multiplies_loss_and_grad_by_t_squared(scale):
    student_logits, teacher, mask = _case()
    leaf = student_logits.clone().requires_grad_()
    out = distillation_loss(leaf, teacher, mask, vocab_size=50, temperature=2.5,
                            temperature_scale=scale, tail_bucket=True)
    out.loss_sum.backward()
    ref, ref_grad = _reference_loss(student_logits, teacher, mask, 50, temperature=2.5,
                                    divergence="forward_kl", tail_bucket=True)
    factor = 2.5 ** 2 if scale else 1.0
    assert abs(out.loss_sum.item() - factor * ref.item()) <= 1e-5 * (1 + factor * abs(ref.item()))
    err = (leaf.grad.double() - factor * ref_grad).abs().max().item()
    assert err <= 1e-5 * factor, err
    assert torch.equal(out.report["distill loss"][0], out.loss_sum.detach())
    with pytest.raises(ValueError, match="temperature_scale"):
        distillation_loss(student_logits, teacher, mask, vocab_size=50, temperature_scale=1)


@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_tail_rounding_to_zero_in_fp32_stays_finite(divergence, beta):
    # A confident model: its top-4 fp32 probabilities sum to 1 (or a hair above) after rounding,
    # so 1 - sum_k p is 0 in fp32. Unfloored, reverse KL (teacher tail) and forward KL (student
    # tail) are +inf and their gradients NaN; floored at 2**-23 both sides, they are finite and
    # match the float64 reference with the same floor.
    torch.manual_seed(11)
    peaked = torch.randn(6, 64) * 0.1
    peaked[:, 0] += 40.0
    flat = torch.randn(6, 64)
    flat[:, 0] += 3.0  # id 0 in the flat model's top-4 too
    for teacher_logits, student_logits in ((peaked, flat), (flat, peaked)):
        teacher = vocab_parallel_topk(teacher_logits, 4)
        leaf = student_logits.clone().requires_grad_()
        out = distillation_loss(leaf, teacher, torch.ones(6), divergence=divergence, beta=beta,
                                tail_bucket=True)
        out.loss_sum.backward()
        assert math.isfinite(out.loss_sum.item()) and torch.isfinite(leaf.grad).all()
        lq = torch.log_softmax(student_logits.double(), -1).gather(-1, teacher.indices)
        ref = reference_divergence(lq.float(), teacher.logprobs, divergence, beta,
                                   tail_bucket=True, tail_floor=2.0**-23).sum()
        assert abs(out.loss_sum.item() - ref.item()) <= 1e-5 * (1 + abs(ref.item())), \
            (out.loss_sum.item(), ref.item())


@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_renormalize_row_where_the_student_has_no_topk_mass(divergence, beta):
    # The student's logits are -inf at every teacher id of one row: 0/0 under renormalize.
    logits = torch.randn(2, 16)
    logits[1, [1, 2, 3]] = float("-inf")
    teacher = TopK(torch.log(torch.tensor([[0.3, 0.2, 0.1]] * 2)), torch.tensor([[1, 2, 3]] * 2))
    leaf = logits.clone().requires_grad_()
    out = distillation_loss(leaf, teacher, torch.ones(2), divergence=divergence, beta=beta,
                            renormalize=True)
    out.loss_sum.backward()
    assert not math.isnan(out.loss_sum.item()) and torch.isfinite(leaf.grad).all()
    if divergence == "forward_kl":
        assert out.loss_sum.item() == float("inf")  # teacher mass where the student has none


@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_tail_of_a_student_within_fp32_rounding_of_one(divergence, beta):
    # A confident student whose top-k log-probs sum to a log-mass within
    # 3e-8 of 0: exp of it rounds to 1 in fp32, and log1mexp's unchosen branch
    # log1p(-exp(x)) = -inf made the gradient NaN (0 / 0 in its derivative), though the loss
    # was finite; through distillation_loss the NaN reaches every logit of the row.
    lq = torch.tensor([[-1e-8, -19.0], [-0.4, -2.0]])
    lp = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.2]]))
    leaf = lq.clone().requires_grad_()
    got = topk_divergence(leaf, lp, torch.ones(2), divergence=divergence, beta=beta,
                          tail_bucket=True)
    got.sum().backward()
    ref_leaf = lq.double().requires_grad_()
    ref = reference_divergence(ref_leaf, lp.double(), divergence, beta, tail_bucket=True,
                               tail_floor=2.0**-23)
    ref.sum().backward()
    assert torch.isfinite(leaf.grad).all(), leaf.grad
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6), (got, ref)
    assert torch.allclose(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-6), \
        (leaf.grad, ref_leaf.grad)


@pytest.mark.parametrize("divergence, beta", DIVERGENCES)
def test_tail_of_a_row_where_the_student_has_no_topk_mass(divergence, beta):
    # With tail_bucket (as with renormalize, above) a row whose student
    # logits are -inf at every teacher id: logsumexp's gradient over -inf only is NaN, and it
    # reached every logit of the row. The student's top-k mass is 0, its tail 1: the gradient
    # is 0 (float64 reference), the loss +inf for forward KL (teacher mass the student lacks).
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(4))
    logits[1, [1, 2]] = float("-inf")
    teacher = TopK(torch.log(torch.tensor([[0.3, 0.2]] * 2)), torch.tensor([[1, 2]] * 2))
    leaf = logits.clone().requires_grad_()
    out = distillation_loss(leaf, teacher, torch.ones(2), divergence=divergence, beta=beta,
                            tail_bucket=True)
    out.loss_sum.backward()
    assert torch.isfinite(leaf.grad).all(), leaf.grad
    assert bool((leaf.grad[1] == 0).all())
    ref_leaf = logits[:1].double().requires_grad_()
    lq = torch.log_softmax(ref_leaf, -1).gather(-1, teacher.indices[:1])
    reference_divergence(lq, teacher.logprobs[:1].double(), divergence, beta,
                         tail_bucket=True).sum().backward()
    assert torch.allclose(leaf.grad[:1].double(), ref_leaf.grad, rtol=1e-4, atol=1e-6)
    if divergence == "forward_kl":
        assert out.loss_sum.item() == float("inf")
    else:
        assert math.isfinite(out.loss_sum.item())


def test_duplicate_ids_at_counted_positions():
    student_logits, teacher, mask = _case(k=4)
    idx = teacher.indices.clone()
    idx[~mask] = 0  # padded: k copies of id 0, allowed
    assert torch.isfinite(distillation_loss(student_logits, TopK(teacher.logprobs, idx), mask,
                                            vocab_size=50, validate=True).loss_sum)
    row = mask.nonzero()[0].tolist()
    idx[row[0], row[1], 3] = idx[row[0], row[1], 1]
    with pytest.raises(ValueError, match=f"id {int(idx[row[0], row[1], 1])} twice"):
        distillation_loss(student_logits, TopK(teacher.logprobs, idx), mask, vocab_size=50,
                          validate=True)
    # Without validate (no host read): each copy is a bucket of its own, as documented.
    out = distillation_loss(student_logits, TopK(teacher.logprobs, idx), mask, vocab_size=50)
    assert math.isfinite(out.loss_sum.item())


@pytest.mark.parametrize("beta", [1e-4, 1 - 1e-4])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_jsd_accurate_up_to_the_beta_limits(beta, mode):
    torch.manual_seed(12)
    lp = torch.log_softmax(torch.randn(64, 9, dtype=torch.float64) * 2, -1)[:, :5]
    lq = torch.log_softmax(torch.randn(64, 9, dtype=torch.float64) * 2, -1)[:, :5]
    want = reference_divergence(lq, lp, "jsd", beta, **mode)
    got = topk_divergence(lq.float(), lp.float(), torch.ones(64), divergence="jsd", beta=beta,
                          **mode)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-9), \
        ((got.double() - want).abs() / want).max().item()
    for edge in (0.0, 1.0):
        with pytest.raises(ValueError, match="forward_kl"):
            topk_divergence(lq, lp, torch.ones(64), divergence="jsd", beta=edge)


@pytest.mark.parametrize("fused", [False, True])
def test_fully_masked_batch_gives_zero_not_nan(fused):
    torch.manual_seed(13)
    hidden = torch.randn(2, 5, 16).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(56, 16).to(torch.bfloat16).requires_grad_()
    logits = (hidden.detach() @ weight.detach().t()).requires_grad_()
    teacher = vocab_parallel_topk(torch.randn(2, 5, 56), 4, vocab_size=50)
    student = (functools.partial(linear_vocab_parallel_topk_logprobs, hidden, weight) if fused
               else logits)
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        out = distillation_loss(student, teacher, torch.zeros(2, 5), vocab_size=50,
                                divergence=divergence, tail_bucket=True, validate=True)
        assert out.loss_sum.item() == 0.0 and int(out.num_tokens) == 0
        assert all(bool((v == 0).all()) for v in out.report.values())
        # Megatron divides by max(num_tokens, 1) in that case; the gradient is exactly 0.
        (out.loss_sum / out.num_tokens.clamp(min=1)).backward()
    grads = (hidden.grad, weight.grad) if fused else (logits.grad,)
    assert all(bool((g == 0).all()) for g in grads)
