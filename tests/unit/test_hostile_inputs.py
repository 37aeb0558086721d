"""Core ops (tp = 1): hostile inputs give an exact result or a clear error.

Out-of-range targets without ``validate`` (NaN, no host sync), double backward (refused), extreme
finite logits (exact against float64), argument types and values (errors naming the argument),
and odd but legal layouts (non-contiguous, expanded, empty, narrow integer targets). The
tensor-parallel variants are in ``dist/hostile_inputs_cases.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from _reference import reference_stats
from megatron_vocabstats import (
    linear_vocab_parallel_stats,
    linear_vocab_parallel_topk_logprobs,
    vocab_parallel_entropy,
    vocab_parallel_stats,
    vocab_parallel_topk,
    vocab_parallel_topk_logprobs,
)
from megatron_vocabstats.ops._checks import refuse_double_backward
from megatron_vocabstats.ops._math import Z_FLOOR
from megatron_vocabstats.ops.agreement import Field, bits_float, float_bits
from megatron_vocabstats.ops.options import ENTROPY_MODES
from megatron_vocabstats.testing import forbid_host_sync

MODES = [False, True, "tp"]
WEIGHT = torch.randn(8, 16)  # a [V, H] LM-head weight for the fused ops
FP32_MAX = torch.finfo(torch.float32).max


def _floored(logits):
    """float64 logits with the op's floor applied (logits <= -1e30 count as -inf)."""
    z = logits.double()
    return torch.where(z <= Z_FLOOR, float("-inf"), z)


def _assert_exact(actual, expected, *, rtol=1e-5, atol=1e-5, what):
    """fp32 results against float64: one fp32 rounding chain (numerics.md: 1e-5 relative),
    infinities equal."""
    expected = expected.double()
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf), f"{what}: infinities {actual} vs {expected}"
    assert torch.equal(actual[inf].double(), expected[inf]), f"{what}: {actual} vs {expected}"
    err = (actual.double() - expected)[~inf].abs()
    bound = atol + rtol * expected[~inf].abs()
    assert bool((err <= bound).all()), f"{what}: {actual} vs {expected}"


# ------------------------------------------------------------------ 1. out-of-range targets


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_out_of_range_target_without_validate_gives_nan_and_no_logprob_gradient(mode, smoothing):
    torch.manual_seed(0)
    logits = torch.randn(6, 256)
    # vocab 250 of 256 columns: 252 is a padding column, 256 and -5 lie outside the shard.
    target = torch.tensor([3, 252, 256, -5, -100, 7])
    bad = torch.tensor([False, True, True, True, False, False])
    opts = dict(vocab_size=250, label_smoothing=smoothing, batch_invariant=mode, chunk_size=4)
    leaf = logits.clone().requires_grad_()
    with forbid_host_sync():
        st = vocab_parallel_stats(leaf, target, validate=False, **opts)
        (st.logprobs.nan_to_num(0.0).sum() + st.entropy.sum()).backward()
    assert torch.isnan(st.logprobs[bad]).all()
    assert torch.isfinite(st.logprobs[~bad]).all()
    # Entropy and logsumexp do not depend on the target; the logprob gradient of the bad rows
    # is exactly 0, so their gradient is the entropy's alone.
    ref_leaf = logits.clone().requires_grad_()
    ref_lp = vocab_parallel_stats(ref_leaf, torch.where(bad, -100, target), entropy="off",
                                  **opts).logprobs
    ref = vocab_parallel_stats(ref_leaf, None, **opts)
    scored = target != -100
    (ref_lp.sum() + (ref.entropy * scored).sum()).backward()
    assert torch.equal(st.entropy[scored], ref.entropy[scored])
    assert torch.equal(st.logsumexp, ref.logsumexp)
    assert torch.equal(st.logprobs[~bad], ref_lp[~bad])
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="target holds id"):
        vocab_parallel_stats(logits, target, validate=True, **opts)


def test_out_of_range_target_gradient_of_the_logprob_alone_is_zero():
    leaf = torch.randn(2, 16, requires_grad=True)
    lp = vocab_parallel_stats(leaf, torch.tensor([16, 2]), entropy="off", validate=False).logprobs
    assert math.isnan(lp[0].item())
    lp[1].backward()
    assert torch.equal(leaf.grad[0], torch.zeros(16)) and torch.isfinite(leaf.grad).all()


def test_out_of_range_topk_ids_without_validate_give_nan_and_zero_gradient():
    leaf = torch.randn(2, 16, requires_grad=True)
    ids = torch.tensor([[1, 16], [-1, 3]])
    with forbid_host_sync():
        lp = vocab_parallel_topk_logprobs(leaf, ids, validate=False)
    assert torch.isnan(lp[0, 1]) and torch.isnan(lp[1, 0])
    assert torch.isfinite(lp[0, 0]) and torch.isfinite(lp[1, 1])
    lp.nan_to_num(0.0).sum().backward()
    assert torch.isfinite(leaf.grad).all()
    with pytest.raises(ValueError, match="indices holds id"):
        vocab_parallel_topk_logprobs(leaf, ids)


# ------------------------------------------------------------------ 2. double backward


@pytest.mark.parametrize("call", [
    lambda x: vocab_parallel_stats(x, torch.tensor([1, 2])).logprobs,
    lambda x: vocab_parallel_entropy(x),
    lambda x: vocab_parallel_topk_logprobs(x, torch.tensor([[1, 2], [3, 4]])),
    lambda x: linear_vocab_parallel_stats(x, WEIGHT, torch.tensor([1, 2])).logprobs,
    lambda x: linear_vocab_parallel_topk_logprobs(x, WEIGHT, torch.tensor([[1, 2], [3, 4]])),
], ids=["stats", "entropy", "topk_logprobs", "fused_stats", "fused_topk_logprobs"])
def test_double_backward_is_refused(call):
    x = torch.randn(2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(call(x).sum(), x, create_graph=True)
    (grad,) = torch.autograd.grad(call(x).sum(), x)  # first order still works
    assert torch.isfinite(grad).all()


def test_refuse_double_backward_only_under_grad_mode():
    with torch.no_grad():
        refuse_double_backward("op")
    with pytest.raises(RuntimeError, match="op does not support double backward"):
        refuse_double_backward("op")


# ------------------------------------------------------------------ 3. extreme finite logits


def _extreme_rows(dtype):
    big = torch.finfo(dtype).max
    return [
        torch.full((16,), 3e38),                                       # all at 3e38 (uniform)
        torch.tensor([3e38, -3e38] * 8),                               # mixed +-3e38
        torch.tensor([big] * 4 + [-9e29] * 12),                        # max next to -9e29
        torch.tensor([big, big / 2, 0.0, -big / 2] * 4),               # spread over the range
        torch.tensor([65504.0, -65504.0] * 8),                         # fp16 extremes
        torch.linspace(-1e29, 1e29, 16),
    ]


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_extreme_finite_logits_are_exact(mode, smoothing, dtype):
    rows = [r.to(dtype) for r in _extreme_rows(dtype) if r.abs().max() <= torch.finfo(dtype).max]
    logits = torch.stack(rows)
    target = torch.arange(len(rows)) % 16
    st = vocab_parallel_stats(logits, target, label_smoothing=smoothing, batch_invariant=mode)
    lp, ent, lse = reference_stats(_floored(logits), target, label_smoothing=smoothing)
    _assert_exact(st.logprobs, lp, what="logprobs")
    _assert_exact(st.entropy, ent, what="entropy")
    _assert_exact(st.logsumexp, lse, what="logsumexp")
    assert not (st.logprobs == float("inf")).any()


def test_fp16_extremes_with_smoothing_are_exact():
    logits = torch.tensor([[65504.0, -65504.0, 0.0, 1.0] * 4, [65504.0] * 16]).half()
    target = torch.tensor([1, 3])
    st = vocab_parallel_stats(logits, target, label_smoothing=0.2)
    lp, ent, lse = reference_stats(logits.double(), target, label_smoothing=0.2)
    _assert_exact(st.logprobs, lp, what="logprobs")
    _assert_exact(st.entropy, ent, what="entropy")


@pytest.mark.parametrize("mode", [True, "tp"], ids=str)
def test_batch_invariant_blocks_at_3e38_and_minus_9e29(mode):
    logits = torch.full((3, 512), -9e29)
    logits[0, 128:256] = 3e38
    logits[1, 384:] = 3e38
    logits[2, :128] = 3e38
    target = torch.tensor([5, 400, 130])
    st = vocab_parallel_stats(logits, target, batch_invariant=mode, label_smoothing=0.1)
    lp, ent, lse = reference_stats(logits.double(), target, label_smoothing=0.1)
    _assert_exact(st.entropy, ent, what="entropy")
    _assert_exact(st.logprobs, lp, what="logprobs")
    _assert_exact(st.logsumexp, lse, what="logsumexp")


def test_smoothing_sum_does_not_overflow_or_cancel():
    # Before: sum_j z_j overflowed to inf (logprob +inf) at 3e38, and cancelled at 1e37.
    logits = torch.stack([torch.full((64,), 3e38), 1e37 + torch.arange(64.0) * 1e31])
    target = torch.tensor([0, 63])
    st = vocab_parallel_stats(logits, target, label_smoothing=0.5, chunk_size=1)
    lp, _, _ = reference_stats(logits.double(), target, label_smoothing=0.5)
    _assert_exact(st.logprobs, lp, what="smoothed logprobs")


def test_real_column_at_minus_inf_makes_the_smoothed_logprob_minus_inf_whatever_the_scale():
    # Finite and very negative (sum -6.4e29, once mistaken for a column at -inf); then one at -inf.
    logits = torch.full((2, 64), -1e28)
    logits[1, 3] = float("-inf")
    st = vocab_parallel_stats(logits, torch.tensor([0, 0]), label_smoothing=0.1)
    assert math.isfinite(st.logprobs[0].item()) and st.logprobs[1].item() == float("-inf")
    lp, _, _ = reference_stats(logits.double(), torch.tensor([0, 0]), label_smoothing=0.1)
    _assert_exact(st.logprobs, lp, what="logprobs")


# ------------------------------------------------------------------ 5. clear errors


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature="2"), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(label_smoothing=None), "label_smoothing"),
    (dict(ignore_index=None), "ignore_index"),
    (dict(ignore_index=1.5), "ignore_index"),
    (dict(ignore_index=True), "ignore_index"),
    (dict(chunk_size=2.0), "chunk_size"),
    (dict(chunk_size="4"), "chunk_size"),
    (dict(vocab_size=4.0), "vocab_size"),
    (dict(validate="yes"), "validate"),
], ids=lambda v: repr(v) if isinstance(v, dict) else v)
def test_wrong_option_types_raise_type_error_naming_the_argument(kwargs, name):
    logits, target = torch.randn(2, 8), torch.tensor([1, 2])
    with pytest.raises(TypeError, match=name) as info:
        vocab_parallel_stats(logits, target, **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)
    assert isinstance(info.value, ValueError)  # still caught as the ops' input errors


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e-40), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(label_smoothing=float("nan")), "label_smoothing"),
    (dict(ignore_index=2**64), "ignore_index"),
    (dict(chunk_size=-3), "chunk_size"),
    (dict(vocab_size=9), "vocab_size"),
    (dict(vocab_size=0), "vocab_size"),
], ids=lambda v: repr(v) if isinstance(v, dict) else v)
def test_bad_option_values_raise_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vocab_parallel_stats(torch.randn(2, 8), torch.tensor([1, 2]), **kwargs)


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="logits must be a tensor"):
        vocab_parallel_stats([[1.0, 2.0]], None)
    with pytest.raises(TypeError, match="target must be"):
        vocab_parallel_stats(torch.randn(2, 8), [1, 2])
    with pytest.raises(TypeError, match="tp_group"):
        vocab_parallel_stats(torch.randn(2, 8), None, tp_group=0)


@pytest.mark.parametrize("call", [
    lambda x: vocab_parallel_stats(x, torch.zeros(3, dtype=torch.long)),
    lambda x: vocab_parallel_stats(x, None, chunk_size=None),
    lambda x: vocab_parallel_topk(x, 1),
    lambda x: vocab_parallel_topk_logprobs(x, torch.zeros(3, 1, dtype=torch.long)),
], ids=["stats", "auto_chunk", "topk", "topk_logprobs"])
def test_width_zero_shard_is_a_value_error_naming_logits(call):
    with pytest.raises(ValueError, match="logits: the vocabulary dimension .* is empty"):
        call(torch.randn(3, 0))


def test_overflowing_temperature_is_reported_as_temperature():
    logits = torch.tensor([[1e10, 0.0, -1e10]])
    with pytest.raises(ValueError, match=r"temperature=1e-30 is too small.*overflows fp32"):
        vocab_parallel_stats(logits, None, temperature=1e-30)
    with pytest.raises(ValueError, match="temperature=1e-30"):
        vocab_parallel_topk(logits, 1, temperature=1e-30)
    with pytest.raises(ValueError, match="NaN or \\+inf logits"):  # a real +inf logit
        vocab_parallel_stats(torch.tensor([[float("inf"), 0.0]]), None, temperature=0.5)


def test_agreement_fields_print_human_values():
    temp = Field("temperature", show=bits_float)
    assert "[1.0, 2.0]" in temp.difference([float_bits(1.0), float_bits(2.0)],
                                           "tp_group")
    mode = Field("entropy mode", show=ENTROPY_MODES.__getitem__)
    assert "['grad', 'off']" in mode.difference([2, 0], "g")
    crc = Field("target (token ids)", checksum=True).difference([123456, 123456, 7], "g")
    assert "ranks [2] differ from rank 0" in crc and "123456" not in crc


# ------------------------------------------------------------------ 6. odd but legal layouts


def _stats_and_grad(logits, target, **kw):
    leaf = logits.detach().clone().requires_grad_() if logits.is_leaf else logits
    st = vocab_parallel_stats(leaf, target, **kw)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    return st, leaf.grad


def test_non_contiguous_and_expanded_logits_equal_contiguous():
    torch.manual_seed(0)
    base = torch.randn(16, 5)
    target = torch.tensor([1, 2, 3, -100, 15])
    leaf_t = base.clone().requires_grad_()
    st_t = vocab_parallel_stats(leaf_t.t(), target, chunk_size=2)  # transposed view
    (st_t.logprobs.sum() + st_t.entropy.sum()).backward()
    st_c, grad_c = _stats_and_grad(base.t().contiguous(), target, chunk_size=2)
    for a, b in zip(st_t[:3], st_c[:3]):
        assert torch.equal(a, b)
    assert torch.equal(leaf_t.grad.t(), grad_c)

    row = torch.randn(1, 16, requires_grad=True)
    st_e = vocab_parallel_stats(row.expand(5, 16), target)
    (st_e.logprobs.sum() + st_e.entropy.sum()).backward()
    st_r, grad_r = _stats_and_grad(row.detach().expand(5, 16).contiguous(), target)
    assert all(torch.equal(a, b) for a, b in zip(st_e[:3], st_r[:3]))
    assert torch.allclose(row.grad, grad_r.sum(0, keepdim=True), rtol=1e-6, atol=1e-7)


def test_empty_token_dimension_forward_and_backward():
    leaf = torch.randn(0, 3, 8, requires_grad=True)
    st = vocab_parallel_stats(leaf, torch.zeros(0, 3, dtype=torch.long), label_smoothing=0.1)
    assert all(t.shape == (0, 3) for t in st[:3]) and st.argmax is None
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert leaf.grad.shape == leaf.shape


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_targets_with_far_ignore_index(dtype):
    logits = torch.randn(3, 8)
    target = torch.tensor([1, 2, 3], dtype=dtype)
    st = vocab_parallel_stats(logits, target, ignore_index=1000)
    ref = vocab_parallel_stats(logits, target.long())
    assert torch.equal(st.logprobs, ref.logprobs)


def test_target_on_another_device_and_bool_or_float_target_are_rejected():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="target is on meta"):
        vocab_parallel_stats(logits, torch.zeros(2, dtype=torch.long, device="meta"))
    for bad in (torch.tensor([True, False]), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="target must hold integer"):
            vocab_parallel_stats(logits, bad)


# ------------------------------------------------------------------ losses, distillation, packing


@pytest.mark.parametrize("dtype, kwargs, name", [
    (torch.int8, dict(pad_token_id=1000), "pad_token_id"),
    (torch.int8, dict(ignore_index=-1000), "ignore_index"),
    (torch.uint8, dict(), "ignore_index"),  # -100 would wrap to 156, a real token id
    (torch.int64, dict(pad_token_id=1.5), "pad_token_id"),
])
def test_pack_ids_that_the_token_dtype_cannot_hold_are_refused(dtype, kwargs, name):
    from megatron_vocabstats import pack_sequences, shift_packed_labels

    seq = torch.tensor([1, 2, 3], dtype=dtype)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        pack_sequences([seq], seq_params=False, **kwargs)
    if name == "ignore_index":
        with pytest.raises(ValueError, match=r"\bignore_index\b"):
            shift_packed_labels(seq, torch.tensor([0, 3], dtype=torch.int32), **kwargs)


def test_topk_divergence_and_teacher_with_k_zero_are_value_errors():
    from megatron_vocabstats import TopK, distillation_loss, topk_divergence

    empty = torch.zeros(2, 3, 0)
    with pytest.raises(ValueError, match="k = 0"):
        topk_divergence(empty, empty, torch.ones(2, 3))
    teacher = TopK(empty, torch.zeros(2, 3, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="teacher: k = 0"):
        distillation_loss(torch.randn(2, 3, 8), teacher, torch.ones(2, 3))


@pytest.mark.parametrize("values", [[0.5, -3.0], [-0.1, -0.1], [float("nan"), -1.0]])
def test_distillation_teacher_that_is_no_distribution_is_refused_with_validate(values):
    from megatron_vocabstats import TopK, distillation_loss

    indices = torch.tensor([0, 1]).expand(2, 3, 2)
    teacher = TopK(torch.tensor(values).expand(2, 3, 2), indices)
    with pytest.raises(ValueError, match=r"teacher\.logprobs holds"):
        distillation_loss(torch.randn(2, 3, 8), teacher, torch.ones(2, 3), validate=True)
    # Masked rows are not checked, and rounding of a real distribution stays within the bound.
    mask = torch.zeros(2, 3)
    distillation_loss(torch.randn(2, 3, 8), teacher, mask, validate=True)
    exact = torch.log_softmax(torch.randn(2, 3, 8) * 30, -1).topk(8)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        distillation_loss(torch.randn(2, 3, 8), TopK(exact.values.to(dtype), exact.indices),
                          torch.ones(2, 3), validate=True)


def test_numpy_vocab_size_keeps_the_topk_range_checks():
    np = pytest.importorskip("numpy")
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match=r"\bindices\b"):
        vocab_parallel_topk_logprobs(logits, torch.tensor([[1, 15], [2, 3], [4, 5]]),
                                     vocab_size=np.int64(10))
    for k in (0, 50):
        with pytest.raises(ValueError, match=r"\bk\b"):
            vocab_parallel_topk(logits, k, vocab_size=np.int64(10))


@pytest.mark.parametrize("dtype, value", [
    (torch.int64, -0.5), (torch.int8, 300), (torch.int64, None), (torch.float32, "x"),
    (torch.float16, 1e6), (torch.int64, float("nan")),
])
def test_unpack_padding_value_that_the_dtype_cannot_hold_is_refused(dtype, value):
    from megatron_vocabstats import unpack_sequences

    with pytest.raises(ValueError, match=r"\bpadding_value\b"):
        unpack_sequences(torch.arange(8).to(dtype), torch.tensor([0, 3, 5]), max_seqlen=3,
                         cu_seqlens_padded=torch.tensor([0, 4, 8]), padding_value=value)


def test_vocab_start_edge_cases():
    """Found by review: batch_invariant='tp' with vocab_start crashed at tp = 1 with label
    smoothing (now refused, as documented); a vocab_start beyond int64 escaped the checks; the
    gathered logits lost the sign of -0.0."""
    from megatron_vocabstats import vocab_parallel_gather_logits

    x, t = torch.randn(2, 300), torch.tensor([1, 299])
    with pytest.raises(ValueError, match="batch_invariant='tp' needs equal shards"):
        vocab_parallel_stats(x, t, vocab_size=300, vocab_start=0, label_smoothing=0.1,
                             batch_invariant="tp")
    for start, size in ((2**63, 6), (0, 2**64)):
        with pytest.raises(ValueError, match="vocab_start"):
            vocab_parallel_stats(torch.randn(4, 3), torch.zeros(4, dtype=torch.long),
                                 vocab_size=size, vocab_start=start)
    logits = torch.tensor([[-0.0, float("-inf"), -2e30]])
    picked = vocab_parallel_gather_logits(logits, torch.tensor([[0, 1, 2]]))
    assert bool(picked[0, 0].signbit()) and torch.equal(picked, logits)
