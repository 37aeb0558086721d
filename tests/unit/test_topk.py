"""Single-process tests of the top-k ops (ops/topk/from_logits.py, ops/topk/from_hidden.py) against float64
references; the tp = 1, 2, 4 cases are in test_topk_dist.py."""

from __future__ import annotations

import pytest
import torch

from megatron_vocabstats import (
    TopK,
    linear_vocab_parallel_topk,
    linear_vocab_parallel_topk_logprobs,
    vocab_parallel_logprobs,
    vocab_parallel_topk,
    vocab_parallel_topk_logprobs,
)
from megatron_vocabstats.ops.topk.math import rank_keys
from megatron_vocabstats.testing import forbid_host_sync
from test_vocab_parallel import TOLERANCES as TOL  # numerics.md's
from test_vocab_parallel import _assert_close as _close


def reference_topk(logits, k, vocab, temperature=1.0):
    """float64 top-k by (log-prob descending, id ascending), with a stable sort over the ids."""
    logp = torch.log_softmax(logits.double()[..., :vocab] / temperature, -1)
    order = torch.sort(-logp, dim=-1, stable=True).indices[..., :k]
    return logp.gather(-1, order), order


def reference_logprobs(logits, indices, vocab, temperature=1.0, mask=None):
    leaf = logits.detach().double().requires_grad_()
    lp = torch.log_softmax(leaf[..., :vocab] / temperature, -1).gather(-1, indices)
    if mask is not None:
        lp = torch.where(mask.unsqueeze(-1) != 0, lp, 0.0)
    return leaf, lp


# ------------------------------------------------------------------------------------ top-k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_matches_float64(dtype, temperature):
    torch.manual_seed(0)
    vocab = 97
    logits = (torch.randn(3, 11, 104) * 3).to(dtype)  # 7 padding columns
    top = vocab_parallel_topk(logits, 9, vocab_size=vocab, temperature=temperature, chunk_size=4)
    ref_lp, ref_ids = reference_topk(logits, 9, vocab, temperature)
    assert top.indices.dtype == torch.int64 and top.logprobs.dtype == torch.float32
    assert torch.equal(top.indices, ref_ids)
    _close(top.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="top-k logprobs")
    assert not top.logprobs.requires_grad


def test_padding_columns_never_selected():
    # Real columns all -inf but three: the top-5 must still be real ids (-inf log-prob), never
    # the padding columns, which hold the largest stored values.
    logits = torch.full((2, 16), float("-inf"))
    logits[:, :3] = torch.tensor([1.0, 2.0, 0.5])
    logits[:, 10:] = 50.0
    top = vocab_parallel_topk(logits, 5, vocab_size=10)
    assert bool((top.indices < 10).all())
    assert top.indices[0].tolist() == [1, 0, 2, 3, 4]
    assert torch.isneginf(top.logprobs[:, 3:]).all() and torch.isfinite(top.logprobs[:, :3]).all()


def test_ties_straddling_kth_place_take_lowest_ids():
    logits = torch.zeros(1, 40)
    logits[0, [5, 17, 3, 30, 11]] = 2.0  # five-way tie, k=3 takes 3, 5, 11
    logits[0, 21] = 3.0
    logits[0, 0] = -0.0  # -0.0 and +0.0 tie too
    top = vocab_parallel_topk(logits, 4, chunk_size=1)
    assert top.indices[0].tolist() == [21, 3, 5, 11]
    flat = vocab_parallel_topk(torch.zeros(2, 40), 6)  # all equal: ids 0..5
    assert flat.indices.tolist() == [list(range(6))] * 2
    signed = vocab_parallel_topk(torch.tensor([[0.0, -0.0, 0.0, -1.0]]), 3)
    assert signed.indices[0].tolist() == [0, 1, 2]


def test_rank_keys_order_values_then_ids():
    values = torch.tensor([-3.5, -0.0, 0.0, 1e-40, 7.0, -1e30, float("inf")])
    ids = torch.arange(7)
    order = rank_keys(values, ids).argsort(descending=True).tolist()
    assert order == [6, 4, 3, 1, 2, 0, 5]


def test_topk_chunk_size_invariant_and_k_equals_vocab():
    torch.manual_seed(1)
    logits = torch.randn(13, 50).to(torch.bfloat16)
    runs = [vocab_parallel_topk(logits, 50, vocab_size=50, chunk_size=c) for c in (1, 4, 13, None)]
    for other in runs[1:]:
        assert torch.equal(runs[0].logprobs, other.logprobs)
        assert torch.equal(runs[0].indices, other.indices)
    assert torch.allclose(runs[0].logprobs.exp().sum(-1), torch.ones(13), atol=1e-5)


@pytest.mark.parametrize("k", [0, 51, 2.0, True])
def test_bad_k_raises(k):
    with pytest.raises(ValueError, match="k must be"):
        vocab_parallel_topk(torch.randn(2, 64), k, vocab_size=50)


# ------------------------------------------------------------------------- top-k log-probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_topk_logprobs_values_and_grads(dtype, temperature):
    torch.manual_seed(2)
    vocab = 120
    logits = (torch.randn(4, 6, 128) * 3).to(dtype)
    indices = torch.randint(0, vocab, (4, 6, 5))
    mask = torch.rand(4, 6) > 0.2
    g = torch.randn(4, 6, 5)
    leaf = logits.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, indices, mask=mask, vocab_size=vocab,
                                      temperature=temperature, chunk_size=5)
    (lp * g).sum().backward()
    ref_leaf, ref = reference_logprobs(logits, indices, vocab, temperature, mask)
    (ref * g.double()).sum().backward()
    tol = TOL[dtype]
    _close(lp, ref, rtol=tol["value"], atol=tol["value"], what="logprobs")
    assert leaf.grad.dtype == dtype
    _close(leaf.grad, ref_leaf.grad, rtol=tol["grad_rtol"], atol=tol["grad_atol"], what="grad")


def test_k1_is_bitwise_vocab_parallel_logprobs():
    torch.manual_seed(3)
    logits = (torch.randn(5, 7, 64) * 4).to(torch.bfloat16)
    target = torch.randint(0, 60, (5, 7))
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(a, target.unsqueeze(-1), vocab_size=60, temperature=0.8)
    ref = vocab_parallel_logprobs(b, target, vocab_size=60, temperature=0.8)
    assert torch.equal(lp[..., 0], ref)
    w = torch.randn(5, 7)
    (lp[..., 0] * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_teacher_topk_equals_student_logprobs_at_its_ids_bitwise():
    torch.manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(9, 70) * 5).to(dtype)
        top = vocab_parallel_topk(logits, 8, vocab_size=66, temperature=1.3, chunk_size=2)
        lp = vocab_parallel_topk_logprobs(logits, top.indices, vocab_size=66, temperature=1.3)
        assert torch.equal(top.logprobs, lp), dtype


def test_duplicate_indices_masked_rows_exact_zero_grad():
    torch.manual_seed(5)
    logits = torch.randn(4, 32)
    logits[3] = float("-inf")  # a padded row whose logits are garbage
    indices = torch.randint(0, 32, (4, 6))
    indices[2:] = 0  # padded rows: k copies of id 0
    mask = torch.tensor([1, 1, 0, 0])
    leaf = logits.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, indices, mask=mask, validate=False)
    (lp * torch.randn(4, 6)).sum().backward()
    assert torch.isfinite(lp).all() and bool((lp[2:] == 0).all())
    assert bool((leaf.grad[2:] == 0).all()) and torch.isfinite(leaf.grad).all()


def test_duplicate_indices_accumulate_at_unmasked_rows():
    torch.manual_seed(6)
    logits = torch.randn(3, 20)
    indices = torch.tensor([[4, 4, 4, 1], [0, 0, 0, 0], [7, 19, 7, 2]])
    g = torch.randn(3, 4)
    leaf = logits.clone().requires_grad_()
    (vocab_parallel_topk_logprobs(leaf, indices) * g).sum().backward()
    ref_leaf, ref = reference_logprobs(logits, indices, 20)
    (ref * g.double()).sum().backward()
    _close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-6, what="grad with duplicates")


def test_chunk_size_invariance_bitwise():
    torch.manual_seed(7)
    logits = torch.randn(17, 40).to(torch.bfloat16)
    indices = torch.randint(0, 40, (17, 3))
    g = torch.randn(17, 3)
    out = []
    for chunk in (1, 5, 17):
        leaf = logits.clone().requires_grad_()
        lp = vocab_parallel_topk_logprobs(leaf, indices, chunk_size=chunk)
        (lp * g).sum().backward()
        out.append((lp, leaf.grad))
    for lp, grad in out[1:]:
        assert torch.equal(lp, out[0][0]) and torch.equal(grad, out[0][1])


def test_out_of_range_indices():
    logits, idx = torch.randn(2, 3, 16), torch.zeros(2, 3, 4, dtype=torch.long)
    idx[1, 2, 3] = 14
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_topk_logprobs(logits, idx, vocab_size=14)
    idx[1, 2, 3] = -1
    with pytest.raises(ValueError, match="outside"):
        vocab_parallel_topk_logprobs(logits, idx)
    mask = torch.ones(2, 3)
    mask[1, 2] = 0  # a bad id at a masked row is allowed
    assert torch.isfinite(vocab_parallel_topk_logprobs(logits, idx, mask=mask)).all()
    # Without validate (no host read), an unmasked bad id gives NaN, never a plausible number.
    lp = vocab_parallel_topk_logprobs(logits, idx, validate=False)
    assert torch.isnan(lp[1, 2, 3]) and torch.isfinite(lp[0]).all()


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(2, 3, 4), "integer"),
    (torch.zeros(2, 4, 4, dtype=torch.long), "leading shape"),
    (torch.zeros(2, 3, 0, dtype=torch.long), "k >= 1"),
])
def test_bad_indices_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        vocab_parallel_topk_logprobs(torch.randn(2, 3, 16), bad)


def test_bad_mask_raises():
    with pytest.raises(ValueError, match="mask"):
        vocab_parallel_topk_logprobs(torch.randn(2, 3, 16), torch.zeros(2, 3, 2, dtype=torch.long),
                                     mask=torch.ones(3, 2))


# ------------------------------------------------------------------------------------ fused


def _chunk_products(hidden, weight, chunk):
    h2 = hidden.reshape(-1, hidden.shape[-1])
    parts = [h2[i:i + chunk] @ weight.t() for i in range(0, h2.shape[0], chunk)]
    return torch.cat(parts).view(*hidden.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_equals_unfused(dtype):
    torch.manual_seed(8)
    vocab, chunk = 45, 4
    hidden = torch.randn(2, 7, 24).to(dtype)
    weight = (torch.randn(48, 24) * 0.5).to(dtype)
    logits = _chunk_products(hidden, weight, chunk)
    top = vocab_parallel_topk(logits, 6, vocab_size=vocab, temperature=0.9)
    fused_top = linear_vocab_parallel_topk(hidden, weight, 6, vocab_size=vocab, temperature=0.9,
                                           chunk_size=chunk)
    assert torch.equal(top.indices, fused_top.indices)
    assert torch.equal(top.logprobs, fused_top.logprobs)

    indices = top.indices.clone()
    indices[1, 3] = 0
    mask = torch.ones(2, 7)
    mask[1, 3] = 0
    g = torch.randn(2, 7, 6)
    leaf = logits.clone().requires_grad_()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, indices, mask=mask, vocab_size=vocab, temperature=0.9)
    lp_f = linear_vocab_parallel_topk_logprobs(h, w, indices, mask=mask, vocab_size=vocab,
                                               temperature=0.9, chunk_size=chunk)
    assert torch.equal(lp, lp_f)
    (lp * g).sum().backward()
    (lp_f * g).sum().backward()
    grad = leaf.grad.reshape(-1, 48)
    exp_dx = (grad @ weight).view(hidden.shape)
    exp_dw = (grad.t().double() @ hidden.reshape(-1, 24).double())
    tol = TOL[dtype]
    _close(h.grad, exp_dx, rtol=tol["grad_rtol"], atol=1e-5, what="dX")
    _close(w.grad, exp_dw, rtol=tol["grad_rtol"] * 2, atol=1e-4, what="dW")


def test_fused_bad_input_raises():
    h, w = torch.randn(3, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="k must be"):
        linear_vocab_parallel_topk(h, w, 11)
    with pytest.raises(ValueError, match="outside"):
        linear_vocab_parallel_topk_logprobs(h, w, torch.full((3, 2), 9), vocab_size=9)
    with pytest.raises(ValueError, match="hidden size"):
        linear_vocab_parallel_topk_logprobs(h, torch.randn(10, 7),
                                            torch.zeros(3, 2, dtype=torch.long))


# ----------------------------------------------------------------------------- host syncs


def test_ops_never_sync_with_the_host():
    torch.manual_seed(9)
    logits = torch.randn(3, 5, 32).to(torch.bfloat16)
    hidden, weight = torch.randn(3, 5, 8), torch.randn(32, 8)
    mask = torch.ones(3, 5)
    with forbid_host_sync():
        top = vocab_parallel_topk(logits, 4, vocab_size=30, validate=False)
        leaf = logits.clone().requires_grad_()
        lp = vocab_parallel_topk_logprobs(leaf, top.indices, mask=mask, vocab_size=30,
                                          validate=False)
        lp.sum().backward()
        ftop = linear_vocab_parallel_topk(hidden, weight, 4, validate=False)
        h = hidden.clone().requires_grad_()
        linear_vocab_parallel_topk_logprobs(h, weight, ftop.indices, mask=mask,
                                            validate=False).sum().backward()
    assert isinstance(top, TopK)


def test_peak_memory_has_no_full_upcast():
    # Fails if the op upcasts the whole shard to fp32 (+2x the bf16 logits) or gathers it.
    from megatron_vocabstats.profiling import peak_memory_bytes

    tokens, width, chunk, k = 512, 2048, 32, 16
    logits = torch.randn(tokens, width).to(torch.bfloat16).requires_grad_()
    indices = torch.randint(0, width, (tokens, k))
    g = torch.randn(tokens, k)

    def step():
        (vocab_parallel_topk_logprobs(logits, indices, chunk_size=chunk) * g).sum().backward()

    logits_bytes = logits.numel() * logits.element_size()
    bound = 1.05 * (2 * logits_bytes + 2 * chunk * width * 4 + 64 * k * tokens * 4)
    peak = peak_memory_bytes(step, logits, indices, g)
    assert peak <= bound, f"peak {peak} B over {bound:.0f} B ({peak / logits_bytes:.2f}x logits)"


def test_guard_sees_the_ops():
    # validate=True reads the host: the guard must catch it, so it does watch these paths.
    from megatron_vocabstats.testing import HostSyncError

    logits = torch.randn(3, 32)
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            vocab_parallel_topk(logits, 4, validate=True)
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            vocab_parallel_topk_logprobs(logits, torch.zeros(3, 2, dtype=torch.long))


# ------------------------------------------------------------------- review: edge cases


@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf")])
def test_nan_or_inf_logits(bad):
    logits = torch.randn(3, 40)
    logits[1, 17] = bad
    with pytest.raises(ValueError, match="no finite logsumexp"):
        vocab_parallel_topk(logits, 4)
    with pytest.raises(ValueError, match="no finite logsumexp"):
        vocab_parallel_topk_logprobs(logits, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="no finite logsumexp"):
        linear_vocab_parallel_topk(torch.eye(40)[:3] * 0 + logits, torch.eye(40), 4)
    # Without validate (no host read) the row is NaN, never a plausible top-k; others are exact.
    top = vocab_parallel_topk(logits, 4, validate=False)
    assert bool(torch.isnan(top.logprobs[1]).all()), top.logprobs[1]
    ref_lp, ref_ids = reference_topk(logits[[0, 2]], 4, 40)
    assert torch.equal(top.indices[[0, 2]], ref_ids)
    _close(top.logprobs[[0, 2]], ref_lp, rtol=1e-5, atol=1e-5, what="other rows")


def test_k_equals_vocab_with_padding_and_dead_columns():
    # k = V: every real id once, none of the padding (stored as the largest values), and real
    # columns at -inf still come before the padding, in id order.
    logits = torch.randn(4, 56)
    logits[:, 50:] = 1e4
    logits[2, [3, 7, 40]] = float("-inf")
    top = vocab_parallel_topk(logits, 50, vocab_size=50, chunk_size=3)
    assert bool((top.indices.sort(-1).values == torch.arange(50)).all())
    ref_lp, ref_ids = reference_topk(logits, 50, 50)
    assert torch.equal(top.indices, ref_ids)
    assert top.indices[2, -3:].tolist() == [3, 7, 40]
    dead = torch.isneginf(ref_lp)
    assert torch.equal(torch.isneginf(top.logprobs), dead) and int(dead.sum()) == 3
    _close(top.logprobs[~dead], ref_lp[~dead], rtol=1e-5, atol=1e-5, what="k = V")


def test_k1_is_argmax_with_lowest_id_on_ties():
    logits = torch.randn(5, 30).to(torch.bfloat16)
    logits[1, [4, 9, 21]] = 8.0  # a three-way tie for the maximum
    top = vocab_parallel_topk(logits, 1)
    ref_lp, ref_ids = reference_topk(logits, 1, 30)
    assert top.indices[1, 0].item() == 4 and torch.equal(top.indices, ref_ids)
    _close(top.logprobs, ref_lp, rtol=1e-5, atol=1e-5, what="k = 1")


def test_fused_accumulate_into_main_grad():
    torch.manual_seed(14)
    hidden = torch.randn(2, 5, 16).to(torch.bfloat16)
    weight = torch.randn(40, 16).to(torch.bfloat16)
    indices = torch.randint(0, 40, (2, 5, 3))
    g = torch.randn(2, 5, 3)
    plain = weight.clone().requires_grad_()
    (linear_vocab_parallel_topk_logprobs(hidden, plain, indices, chunk_size=4) * g).sum().backward()
    fused = weight.clone().requires_grad_()
    fused.main_grad = torch.ones(40, 16)
    fused.grad_added_to_main_grad = False
    lp = linear_vocab_parallel_topk_logprobs(hidden, fused, indices, chunk_size=4,
                                             accumulate_into_main_grad=True)
    (lp * g).sum().backward()
    assert fused.grad_added_to_main_grad is True
    # main_grad holds 1 + the fp32 sums, which round to the bf16 gradient of the plain call.
    assert torch.equal((fused.main_grad - 1).to(torch.bfloat16), plain.grad) or \
        (fused.main_grad - 1 - plain.grad.float()).abs().max().item() <= \
        2**-8 * plain.grad.float().abs().max().item()
    with pytest.raises(ValueError, match="main_grad"):
        linear_vocab_parallel_topk_logprobs(hidden, weight, indices,
                                            accumulate_into_main_grad=True)
