"""Log-probs under the inference sampler (temperature, min-p, top-k, top-p), one process:
against the dense float64 reference of vLLM's v1 sampler (``_reference.reference_sampling``).
The tensor-parallel cases are in ``dist/sampling_cases.py``."""

from __future__ import annotations

import pytest
import torch

from _reference import reference_sampling
from megatron_vocabstats import vocab_parallel_sampling_logprobs
from megatron_vocabstats.testing import forbid_host_sync

FILTERS = [
    dict(),
    dict(top_k=5),
    dict(top_k=1),
    dict(top_p=0.8),
    dict(top_p=1e-6),  # keeps only the most likely token
    dict(min_p=0.1),
    dict(top_k=7, top_p=0.9, min_p=0.05, temperature=0.7),
    dict(top_p=0.3, min_p=0.2, temperature=1.3),
    dict(top_k=200),  # k >= V keeps everything
]


def _problem(dtype=torch.float32, tokens=(4, 6), vocab=37, width=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*tokens, width, generator=g) * 2).to(dtype)
    target = torch.randint(0, vocab, tokens, generator=g)
    target[0, 0] = logits[0, 0, :vocab].float().argmax()  # always kept
    target[1, 2] = -100
    return logits, target


def _check(logits, target, vocab, **kw):
    """Values (fp32 bound 1e-5: one fp32 subtraction chain after float64 sums) and gradients
    against the float64 reference; -inf / outside exactly where the reference is."""
    leaf = logits.clone().requires_grad_()
    out = vocab_parallel_sampling_logprobs(leaf, target, vocab_size=vocab, chunk_size=3, **kw)
    valid = target != -100
    ref, _ = reference_sampling(logits, torch.where(valid, target, 0), vocab_size=vocab, **kw)
    ref = torch.where(valid, ref, 0.0)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out.logprobs), finite), (out.logprobs, ref)
    assert torch.equal(out.outside, ~finite), (out.outside, ref)
    assert (out.logprobs[finite].double() - ref[finite]).abs().le(1e-5).all()
    w = torch.linspace(0.5, 1.5, target.numel()).view(target.shape)
    (out.logprobs.masked_fill(~finite, 0) * w).sum().backward()
    ref_leaf = logits.double().requires_grad_()
    r, _ = reference_sampling(ref_leaf, torch.where(valid, target, 0), vocab_size=vocab, **kw)
    (torch.where(valid & finite, r, 0.0) * w).sum().backward()
    err = (leaf.grad.double() - ref_leaf.grad).abs().max()
    assert err <= 1e-5 + 1e-2 * (logits.dtype != torch.float32), err
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "none")
def test_matches_the_dense_reference(kw, dtype):
    for seed in range(4):
        logits, target = _problem(dtype, seed=seed)
        _check(logits, target, 37, **kw)


def test_outside_targets_are_minus_inf_with_zero_gradient():
    logits, target = _problem()
    target[2] = logits[2, :, :37].argmin(-1)  # the least likely: outside a top-k of 3
    leaf = logits.clone().requires_grad_()
    out = vocab_parallel_sampling_logprobs(leaf, target, vocab_size=37, top_k=3)
    assert bool(out.outside[2].all()) and bool(torch.isneginf(out.logprobs[2]).all())
    out.logprobs.masked_fill(out.outside, 0).sum().backward()
    assert torch.equal(leaf.grad[2], torch.zeros_like(leaf.grad[2]))


def test_ties_at_the_boundary_follow_vllm():
    # bf16-like ties: five columns (ids 3..7) share the 2nd largest value. top-k = 3 keeps all
    # of them (vLLM masks logits < kth_value); top-p splits them as vLLM's stable ascending sort
    # does: p_max = 0.349, p_tie = 0.1285, so top_p = 0.5 keeps ceil(0.151 / 0.1285) = 2 of
    # them, the highest ids.
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 2.0
    logits[0, 3:8] = 1.0
    out = vocab_parallel_sampling_logprobs(logits, torch.tensor([7]), top_k=3)
    ref, keep = reference_sampling(logits, torch.tensor([7]), top_k=3)
    assert int(keep.sum()) == 6
    assert torch.allclose(out.logprobs.double(), ref, atol=1e-6)
    for top_p, kept_ties in ((0.3, []), (0.5, [6, 7]), (0.75, [4, 5, 6, 7]), (0.9, [3, 4, 5, 6, 7])):
        _, keep = reference_sampling(logits, torch.tensor([0]), top_p=top_p)
        assert keep[0, 3:8].nonzero().flatten().add(3).tolist() == kept_ties, top_p
        for target in (0, 3, 5, 6, 7, 9):
            out = _check(logits, torch.tensor([target]), 16, top_p=top_p)
            assert bool(out.outside[0]) == (target not in [0, *kept_ties]), (top_p, target)


@pytest.mark.parametrize("top_p", [0.85, 0.6])
def test_a_tie_of_thousands_splits_exactly(top_p):
    # Half of 65,536 columns tied at bf16 -0.75, half at 0: top-p splits the -0.75 tie by a count
    # of ceil((goal - above) / p_tie), so the masses must be summed without drift (fp32 bucket
    # sums of 32,768 equal terms are off by ~2e-4 relative, several whole tokens here).
    vocab = 65536
    logits = torch.zeros(1, vocab)
    logits[0, 1::2] = -0.75
    logits = logits.bfloat16()
    target = torch.tensor([vocab - 2])  # the highest id of the largest value: always kept
    ref, keep = reference_sampling(logits, target, top_p=top_p)
    leaf = logits.clone().requires_grad_()
    out = vocab_parallel_sampling_logprobs(leaf, target, top_p=top_p)
    out.logprobs.sum().backward()
    assert torch.equal(leaf.grad[0] != 0, keep[0]), int(keep[0].sum())
    assert (out.logprobs.double() - ref).abs().max() <= 1e-6
    kept = keep[0].nonzero().flatten()
    split = kept[logits[0, kept] == logits[0, kept].min()]  # the tie top-p splits
    lowest = int(split.min())
    assert lowest >= 2 and split.numel() < vocab // 2
    targets = torch.tensor([[lowest - 2, lowest, lowest + 2]])  # same value, ids around the cut
    outside = vocab_parallel_sampling_logprobs(logits.unsqueeze(0).expand(1, 3, vocab),
                                               targets, top_p=top_p).outside
    assert outside.tolist() == [[True, False, False]]


@pytest.mark.parametrize("kw", [dict(), dict(top_p=1.0), dict(top_k=50), dict(min_p=0.0)],
                         ids=["none", "top_p=1", "top_k>=V", "min_p=0"])
def test_a_minus_inf_target_is_outside_whatever_the_filters(kw):
    logits = torch.randn(2, 40)
    logits[:, 5] = float("-inf")
    leaf = logits.clone().requires_grad_()
    out = vocab_parallel_sampling_logprobs(leaf, torch.tensor([5, 7]), **kw)
    assert out.outside.tolist() == [True, False]
    assert bool(torch.isneginf(out.logprobs[0])) and bool(torch.isfinite(out.logprobs[1]))
    out.logprobs.masked_fill(out.outside, 0).sum().backward()
    assert torch.equal(leaf.grad[0], torch.zeros(40))


def test_chunk_size_does_not_change_the_bits():
    logits, target = _problem(tokens=(5, 7))
    outs = [vocab_parallel_sampling_logprobs(logits, target, vocab_size=37, top_k=6, top_p=0.85,
                                             chunk_size=c).logprobs for c in (1, 4, 35, None)]
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


def test_no_host_sync_without_validate():
    logits, target = _problem()
    leaf = logits.clone().requires_grad_()
    with forbid_host_sync():
        out = vocab_parallel_sampling_logprobs(leaf, target, vocab_size=37, top_k=4, top_p=0.9,
                                               min_p=0.01, validate=False)
        out.logprobs.masked_fill(out.outside, 0).sum().backward()


def test_out_of_range_target_without_validate_is_nan():
    logits, target = _problem()
    target[3, 1] = 38  # a padding column: no sampler draws it
    out = vocab_parallel_sampling_logprobs(logits, target, vocab_size=37, validate=False)
    assert bool(torch.isnan(out.logprobs[3, 1]))
    with pytest.raises(ValueError, match=r"\btarget\b"):
        vocab_parallel_sampling_logprobs(logits, target, vocab_size=37)


@pytest.mark.parametrize("kw, name", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p="0.9"), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.0), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(target=None), "target"),
])
def test_bad_inputs_raise_naming_the_argument(kw, name):
    logits, target = _problem()
    target = kw.pop("target", target)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        vocab_parallel_sampling_logprobs(logits, target, **kw)


@pytest.mark.parametrize("kw", [dict(top_k=5, top_p=0.9), dict(min_p=0.05, temperature=0.7)],
                         ids=["topk_topp", "minp"])
def test_fused_head_equals_the_op_on_the_chunk_products(kw):
    from megatron_vocabstats import linear_vocab_parallel_sampling_logprobs

    torch.manual_seed(0)
    hidden, weight = torch.randn(11, 16), torch.randn(40, 16) * 0.6
    target = torch.randint(0, 37, (11,))
    target[0] = (hidden[0] @ weight[:37].T).argmax()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = linear_vocab_parallel_sampling_logprobs(h, w, target, vocab_size=37, chunk_size=4,
                                                    **kw)
    logits = torch.cat([hidden[i:i + 4] @ weight.T for i in range(0, 11, 4)]).requires_grad_()
    ref = vocab_parallel_sampling_logprobs(logits, target, vocab_size=37, chunk_size=4, **kw)
    assert torch.equal(fused.logprobs, ref.logprobs) and torch.equal(fused.outside, ref.outside)
    fused.logprobs.masked_fill(fused.outside, 0).sum().backward()
    ref.logprobs.masked_fill(ref.outside, 0).sum().backward()
    g = logits.grad
    assert torch.allclose(h.grad, g @ weight, rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.grad, g.T @ hidden, rtol=1e-5, atol=1e-6)
