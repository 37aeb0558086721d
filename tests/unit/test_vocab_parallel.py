"""Single-process tests of vocab_parallel_stats and its wrappers against float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from _reference import reference_stats
from megatron_vocabstats import (
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)
from megatron_vocabstats.profiling import peak_memory_bytes

# numerics.md: fp32 1e-5; bf16 values 2e-2 and gradients one bf16 rounding; fp16 likewise.
TOLERANCES = {
    torch.float32: dict(value=1e-5, grad_rtol=1e-5, grad_atol=1e-6),
    torch.bfloat16: dict(value=2e-2, grad_rtol=2**-8, grad_atol=1e-6),
    torch.float16: dict(value=1e-3, grad_rtol=2**-10, grad_atol=1e-7),
}


def _assert_close(actual, expected, *, rtol, atol, what):
    assert torch.isfinite(actual).all(), f"{what} has non-finite values"
    err = (actual.double() - expected.double()).abs()
    bound = atol + rtol * expected.double().abs()
    assert bool((err <= bound).all()), f"{what}: max error {err.max().item():.3g}"


def _run_both(logits, target, weights_lp, weights_h, **options):
    """Our stats and gradient next to the float64 reference's, for one leaf ``logits``."""
    leaf = logits.detach().clone().requires_grad_()
    st = vocab_parallel_stats(leaf, target, entropy="grad", **options)
    (st.logprobs * weights_lp + st.entropy * weights_h).sum().backward()
    ref_leaf = logits.detach().double().requires_grad_()
    keys = ("vocab_size", "temperature", "ignore_index", "label_smoothing")
    ref = reference_stats(ref_leaf, target, **{k: v for k, v in options.items() if k in keys})
    (ref[0] * weights_lp.double() + ref[1] * weights_h.double()).sum().backward()
    return st, leaf.grad, ref, ref_leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 0.6}, {"label_smoothing": 0.1}, {"vocab_size": 250}],
    ids=["plain", "temperature", "label_smoothing", "padded_vocab"],
)
def test_matches_float64_reference(dtype, options):
    torch.manual_seed(0)
    logits = (torch.randn(4, 9, 256) * 4).to(dtype)
    target = torch.randint(0, options.get("vocab_size", 256), (4, 9))
    target[0, 0] = -100
    w_lp = torch.rand(4, 9) + 0.5
    w_h = torch.randn(4, 9)
    st, grad, ref, ref_grad = _run_both(logits, target, w_lp, w_h, chunk_size=7, **options)
    tol = TOLERANCES[dtype]
    for ours, theirs, what in zip(st, ref, ("logprobs", "entropy", "logsumexp")):
        assert ours.dtype == torch.float32 and ours.shape == target.shape
        _assert_close(ours, theirs, rtol=tol["value"], atol=tol["value"], what=what)
    assert grad.dtype == dtype
    _assert_close(grad, ref_grad, rtol=tol["grad_rtol"], atol=tol["grad_atol"], what="gradient")


@pytest.mark.parametrize("shape", [(17,), (1,), (3, 1, 17)], ids=str)
def test_chunked_equals_unchunked_bitwise(shape):
    torch.manual_seed(1)
    logits = (torch.randn(*shape, 300) * 3).to(torch.bfloat16)
    target = torch.randint(0, 300, shape)
    target.view(-1)[0] = -100
    results = []
    for chunk in (5, 1, 64):
        leaf = logits.clone().requires_grad_()
        st = vocab_parallel_stats(leaf, target, chunk_size=chunk, label_smoothing=0.05)
        (st.logprobs * 2.0 - st.entropy).sum().backward()
        results.append((*st[:3], leaf.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "row, expected",
    [
        ([0.0, float("-inf")], 0.0),
        ([0.0, 0.0, float("-inf")], math.log(2.0)),
        ([1.5] * 1000, math.log(1000.0)),
    ],
    ids=["one_live_column", "two_live_columns", "uniform"],
)
def test_entropy_special_rows(row, expected):
    logits = torch.tensor([row]).requires_grad_()
    ent = vocab_parallel_entropy(logits)
    assert abs(ent.item() - expected) <= 1e-6
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    masked = torch.isinf(logits.detach())
    assert torch.equal(logits.grad[masked], torch.zeros_like(logits.grad[masked]))


def test_entropy_fp16_extremes_is_zero():
    logits = torch.tensor([[65504.0, -65504.0]], dtype=torch.float16).requires_grad_()
    ent = vocab_parallel_entropy(logits)
    assert ent.item() == 0.0
    ent.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_logprobs_and_entropy_from_same_logits_both_backpropagate():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 64, requires_grad=True)
    target = torch.randint(0, 64, (2, 5))
    lp = vocab_parallel_logprobs(logits, target, chunk_size=3)
    ent = vocab_parallel_entropy(logits, chunk_size=4)
    (lp.sum() + 0.3 * ent.sum()).backward()
    ref_leaf = logits.detach().double().requires_grad_()
    ref_lp, ref_h, _ = reference_stats(ref_leaf, target)
    (ref_lp.sum() + 0.3 * ref_h.sum()).backward()
    _assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5, what="logprobs")
    _assert_close(ent, ref_h, rtol=1e-5, atol=1e-5, what="entropy")
    _assert_close(logits.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6, what="gradient")


def test_per_token_upstream_weights_with_first_token_ignored():
    torch.manual_seed(3)
    logits = torch.randn(8, 40)
    target = torch.randint(0, 40, (8,))
    target[0] = -100
    weights = torch.arange(8, dtype=torch.float32)  # reduction='none'-style: 0, 1, 2, ...
    leaf = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(leaf, target, chunk_size=3)
    (loss * weights).sum().backward()
    ref_leaf = logits.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_leaf, target, reduction="none", ignore_index=-100)
    (ref * weights.double()).sum().backward()
    _assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6, what="gradient")
    _assert_close(loss, ref, rtol=1e-5, atol=1e-5, what="loss")
    zero_rows = (leaf.grad == 0).all(dim=-1)
    assert zero_rows.tolist() == [True] + [False] * 7


def test_ignored_rows_are_zero_and_finite_even_when_fully_masked():
    logits = torch.randn(3, 10)
    logits[1] = float("-inf")
    target = torch.tensor([2, -100, 7])
    leaf = logits.clone().requires_grad_()
    st = vocab_parallel_stats(leaf, target)
    assert st.logprobs[1].item() == 0.0 and st.entropy[1].item() == 0.0
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert torch.equal(leaf.grad[1], torch.zeros(10))
    assert torch.isfinite(leaf.grad).all()


def test_nan_logits_in_an_ignored_row_give_zero_gradient():
    logits = torch.randn(3, 8)
    logits[1, 2] = float("nan")
    logits[1, 5] = float("inf")
    leaf = logits.clone().requires_grad_()
    st = vocab_parallel_stats(leaf, torch.tensor([1, -100, 3]))
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert torch.equal(leaf.grad[1], torch.zeros(8)) and torch.isfinite(leaf.grad).all()


def test_large_entropy_gradient_stays_finite_with_padding_columns():
    # log p of a padding column is ~-1e30: a large upstream gradient must not turn 0 * inf into NaN.
    # (Megatron's fp16 loss scale starts at 2**32.)
    logits = torch.randn(2, 8).requires_grad_()
    st = vocab_parallel_stats(logits, torch.tensor([0, 1]), vocab_size=7)
    (st.entropy.sum() * 2.0**32).backward()
    assert torch.isfinite(logits.grad).all() and torch.equal(logits.grad[:, 7], torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8], ids=str)
def test_narrow_integer_targets(dtype):
    logits = torch.randn(4, 10)
    target = torch.tensor([1, 2, 3, 9])
    expected = vocab_parallel_stats(logits, target).logprobs
    assert torch.equal(vocab_parallel_stats(logits, target.to(dtype)).logprobs, expected)


def test_fully_masked_scored_row_raises_or_gives_nan():
    logits = torch.randn(2, 6)
    logits[0] = float("-inf")
    target = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="logits: the row at flat position 0"):
        vocab_parallel_stats(logits, target)
    st = vocab_parallel_stats(logits, target, validate=False)
    assert math.isnan(st.logprobs[0].item()) and math.isfinite(st.logprobs[1].item())


def test_padding_columns_get_zero_probability_and_gradient():
    torch.manual_seed(4)
    logits = torch.randn(5, 32) * 2
    logits[:, 30:] = 50.0  # huge logits in the padding must not count
    leaf = logits.clone().requires_grad_()
    target = torch.randint(0, 30, (5,))
    st = vocab_parallel_stats(leaf, target, vocab_size=30)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    ref_lp, ref_h, ref_lse = reference_stats(logits, target, vocab_size=30)
    _assert_close(st.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="logprobs")
    _assert_close(st.logsumexp, ref_lse, rtol=1e-5, atol=1e-5, what="logsumexp")
    assert torch.equal(leaf.grad[:, 30:], torch.zeros(5, 2))


def test_label_smoothing_uses_global_vocab_size():
    torch.manual_seed(5)
    logits = torch.randn(6, 20)
    target = torch.randint(0, 20, (6,))
    ours = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.2)
    ref = torch.nn.functional.cross_entropy(logits.double(), target, reduction="none",
                                            label_smoothing=0.2)
    _assert_close(ours, ref, rtol=1e-5, atol=1e-5, what="smoothed loss")


def test_does_not_mutate_logits_and_metric_entropy_has_no_grad():
    logits = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    before = logits.detach().clone()
    st = vocab_parallel_stats(logits, torch.randint(0, 16, (4,)), entropy="metric",
                              temperature=0.5)
    assert not st.entropy.requires_grad and not st.logsumexp.requires_grad
    st.logprobs.sum().backward()
    assert torch.equal(logits.detach(), before)
    off = vocab_parallel_stats(logits, torch.randint(0, 16, (4,)), entropy="off")
    assert off.entropy is None


def _step(logits, target, **options):
    def run():
        st = vocab_parallel_stats(logits, target, chunk_size=32, **options)
        st.logprobs.sum().backward()
        logits.grad = None

    return run


def test_metric_entropy_costs_no_memory_over_off():
    tokens = 512
    logits = torch.randn(tokens, 2048).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 2048, (tokens,))
    off = peak_memory_bytes(_step(logits, target, entropy="off"), logits, target)
    metric = peak_memory_bytes(_step(logits, target, entropy="metric"), logits, target)
    # The only extra bytes are the returned [T] fp32 entropy itself.
    assert metric == off + tokens * 4, (metric, off)


def test_peak_memory_has_no_full_fp32_copy():
    tokens, width, chunk = 512, 2048, 32
    logits = torch.randn(tokens, width).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, width, (tokens,))
    peak = peak_memory_bytes(_step(logits, target, entropy="grad"), logits, target)
    shard = logits.numel() * logits.element_size()
    bound = 1.05 * (2 * shard + 2 * chunk * width * 4 + 64 * tokens * 4)
    assert peak <= bound, f"peak {peak} B > bound {bound:.0f} B ({peak / shard:.2f}x the shard)"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x, t: vocab_parallel_stats(x, t.float()), "target must hold integer"),
        (lambda x, t: vocab_parallel_stats(x, t[:, :2]), "target shape"),
        (lambda x, t: vocab_parallel_stats(x, t, chunk_size=0), "chunk_size"),
        (lambda x, t: vocab_parallel_stats(x, t, entropy="yes"), "entropy"),
        (lambda x, t: vocab_parallel_stats(x, t, temperature=0.0), "temperature"),
        (lambda x, t: vocab_parallel_stats(x, t, label_smoothing=1.0), "label_smoothing"),
        (lambda x, t: vocab_parallel_stats(x, t, vocab_size=17), "vocab_size"),
        (lambda x, t: vocab_parallel_stats(x.double(), t), "logits must be bf16"),
        (lambda x, t: vocab_parallel_stats(x, t + 16), "target holds id"),
        (lambda x, t: vocab_parallel_stats(x, t - 5), "target holds id"),
        (lambda x, t: vocab_parallel_stats(x.numpy(), t), "logits must be a tensor"),
    ],
    ids=["float_target", "shape", "chunk", "entropy_mode", "temperature", "smoothing",
         "vocab_size", "dtype", "id_too_large", "id_negative", "not_tensor"],
)
def test_bad_input_raises_value_error(call, match):
    logits = torch.randn(2, 3, 16)
    target = torch.randint(0, 11, (2, 3))
    with pytest.raises(ValueError, match=match):
        call(logits, target)


def test_validate_false_skips_value_checks_but_not_shape_checks():
    logits = torch.randn(2, 16)
    vocab_parallel_stats(logits, torch.tensor([0, 3]), validate=False)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_stats(logits, torch.tensor([0]), validate=False)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_nan_logit_away_from_the_target_gives_nan_without_validate(batch_invariant):
    logits = torch.randn(3, 50)
    logits[1, 7] = float("nan")
    st = vocab_parallel_stats(logits, torch.tensor([0, 3, 5]), validate=False,
                              batch_invariant=batch_invariant)
    for value in st[:3]:
        assert math.isnan(value[1].item()) and torch.isfinite(value[[0, 2]]).all()
    with pytest.raises(ValueError, match="logits"):
        vocab_parallel_stats(logits, torch.tensor([0, 3, 5]), batch_invariant=batch_invariant)
