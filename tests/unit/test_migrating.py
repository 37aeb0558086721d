"""Single-process proofs of the rows of docs/migrating.md, and its examples run as written.

Each test implements the other framework's convention (as docs/migrating.md states it, with the
file and function of theirs it comes from) in a few lines of float64 torch, applies the doc's
mapping to our op and compares. The multi-rank conventions (tp / cp gradient sums, uneven shards,
Megatron itself) are in ``dist/migrating_cases.py`` (tests/unit/test_migrating_dist.py).
"""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch

import megatron_vocabstats as mv
from megatron_vocabstats import (
    linear_vocab_parallel_stats,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "migrating.md")
VOCAB, PADDED = 37, 40   # real vocabulary and the padded width of one tp = 1 shard
HAS_VOCAB_START = "vocab_start" in inspect.signature(vocab_parallel_stats).parameters
HAS_RAW_TOPK = hasattr(mv, "vocab_parallel_topk_logits") and hasattr(mv,
                                                                     "vocab_parallel_gather_logits")


def _close(actual, expected, *, rtol=1e-5, atol=1e-6, what="values"):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: {tuple(actual.shape)} != " \
        f"{tuple(expected.shape)}"
    err = (actual - expected).abs()
    ok = (err <= atol + rtol * expected.abs()) | (actual == expected)
    assert bool(ok.all()), f"{what}: max error {err.max().item():.3g}"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _logits(*shape, width=PADDED, seed=0):
    return torch.randn(*shape, width, generator=_gen(seed), dtype=torch.float64) * 3


def _nemo_logprobs(full, input_ids):
    """NeMo-RL / SkyRL ``from_parallel_logits_to_logprobs``: roll the ids left by one, normalise
    over every column of the shards, 0 for ids outside them, drop the last position."""
    target = input_ids.roll(-1, dims=-1)
    logp = torch.log_softmax(full, -1)
    inside = (target >= 0) & (target < full.shape[-1])
    picked = logp.gather(-1, target.clamp(0, full.shape[-1] - 1)[..., None])[..., 0]
    return torch.where(inside, picked, 0.0)[:, :-1]


def _nemo_logprob_grad(full, target, upstream):
    """NeMo-RL / SkyRL ``DistributedLogprob.backward``: (onehot(target, inside only) - p) * g,
    so a row whose target is outside the shards still gets -p * g."""
    p = torch.softmax(full, -1)
    inside = (target >= 0) & (target < full.shape[-1])
    onehot = torch.nn.functional.one_hot(target.clamp(0, full.shape[-1] - 1), full.shape[-1])
    return (onehot * inside[..., None] - p) * upstream[..., None]


# ------------------------------------------------------------------------------------ NeMo-RL


def test_nemo_rl_logprobs_shift_and_padding():
    full = _logits(2, 7)
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    leaf = full.clone().requires_grad_()
    theirs = _nemo_logprobs(leaf, input_ids)                       # [B, S-1]
    weights = torch.rand(theirs.shape, dtype=torch.float64, generator=_gen(21))
    (theirs * weights).sum().backward()

    logits = full.float().clone().requires_grad_()
    ours = vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:])   # vocab_size omitted
    _close(ours, theirs, what="logprobs (padded vocabulary)")
    (ours * weights.float()).sum().backward()
    _close(logits.grad, leaf.grad, what="logits gradient")
    assert float(logits.grad[:, -1].abs().max()) == 0.0           # the dropped last position

    real = vocab_parallel_logprobs(logits.detach()[:, :-1], input_ids[:, 1:], vocab_size=VOCAB)
    expected = torch.log_softmax(full[..., :VOCAB], -1)[:, :-1].gather(
        -1, input_ids[:, 1:, None])[..., 0]
    _close(real, expected, what="logprobs (real vocabulary)")
    assert (real.double() - theirs.detach()).abs().max() > 1e-4   # padding columns had mass


def test_nemo_rl_out_of_range_target():
    full = _logits(1, 6)
    target = torch.tensor([[3, PADDED + 2, 5, -100, 7, 36]])
    bad = (target < 0) | (target >= PADDED)
    upstream = torch.rand(1, 6, dtype=torch.float64, generator=_gen(22))
    theirs = torch.where(bad, 0.0, torch.log_softmax(full, -1).gather(
        -1, target.clamp(0, PADDED - 1)[..., None])[..., 0])
    their_grad = _nemo_logprob_grad(full, target, upstream)
    assert float(their_grad[bad].abs().max()) > 0.0                # -p * g at their 0 rows

    logits = full.float()
    no_ignore = target.masked_fill(target == -100, 0)               # only out-of-range ids left
    with pytest.raises(ValueError, match="target"):
        vocab_parallel_logprobs(logits, no_ignore)
    assert torch.isnan(vocab_parallel_logprobs(logits, no_ignore, validate=False)[0, 1])

    leaf = logits.clone().requires_grad_()
    ours = vocab_parallel_logprobs(leaf, target.masked_fill(bad, -100))   # the doc's mapping
    _close(ours, theirs, what="logprobs with out-of-range ids masked")
    (ours * upstream.float()).sum().backward()
    assert float(leaf.grad[bad].abs().max()) == 0.0                 # zero gradient there
    _close(leaf.grad[~bad], their_grad[~bad], what="gradient of the scored rows")


def test_nemo_rl_entropy_sign():
    full = _logits(2, 5)
    leaf = full.clone().requires_grad_()
    logp = torch.log_softmax(leaf, -1)
    theirs = (logp.exp() * logp).sum(-1)      # ChunkedDistributedEntropy: sum p log p = -H
    upstream = torch.rand(theirs.shape, dtype=torch.float64, generator=_gen(23))
    (theirs * upstream).sum().backward()
    logits = full.float().clone().requires_grad_()
    ours = -vocab_parallel_entropy(logits)
    _close(ours, theirs, what="negated entropy")
    assert bool((ours <= 0).all())
    (ours * upstream.float()).sum().backward()
    _close(logits.grad, leaf.grad, what="gradient of sum p log p")


@pytest.mark.skipif(not HAS_RAW_TOPK, reason="vocab_parallel_topk_logits / "
                    "vocab_parallel_gather_logits are not there yet")
def test_nemo_rl_topk_ties_and_bad_ids():
    logits = torch.zeros(1, 2, PADDED)
    logits[0, 0, [30, 4, 17, 9]] = 2.0              # a four-way tie for the top
    top = mv.vocab_parallel_topk_logits(logits, 3, vocab_size=VOCAB)
    assert top.indices[0, 0].tolist() == [4, 9, 17], "ties must come lowest id first"
    assert torch.equal(top.logits[0, 0], torch.full((3,), 2.0))
    # NeMo-RL's gather gives 0 for an id outside the shards; ours refuses it.
    idx = torch.tensor([[[1, PADDED + 1], [2, 3]]])
    with pytest.raises(ValueError):
        mv.vocab_parallel_gather_logits(logits, idx, vocab_size=VOCAB)
    masked = mv.vocab_parallel_gather_logits(logits, idx.clamp(max=VOCAB - 1),
                                             vocab_size=VOCAB)
    assert torch.equal(masked, logits.gather(-1, idx.clamp(max=VOCAB - 1)))


# ------------------------------------------------------------------------------------ SkyRL


def test_skyrl_out_of_vocab_target():
    full = _logits(2, 6)
    input_ids = torch.tensor([[3, 5, PADDED, -1, 7, 36], [1, 38, 2, PADDED + 5, 0, 11]])
    theirs = _nemo_logprobs(full, input_ids)      # SkyRL: 0 for ids outside [0, W * tp)
    target = input_ids[:, 1:]
    assert float(theirs[0, 1]) == 0.0 and float(theirs[0, 2]) == 0.0
    logits = full.float()[:, :-1]
    with pytest.raises(ValueError, match="target"):
        vocab_parallel_logprobs(logits, target)
    assert torch.isnan(vocab_parallel_logprobs(logits, target, validate=False)).any()
    # Mapping: mask the ids outside the shards with ignore_index (-100): 0, like SkyRL.
    outside = (target < 0) | (target >= PADDED)
    ours = vocab_parallel_logprobs(logits, target.masked_fill(outside, -100))
    _close(ours, theirs, what="logprobs")
    # An id in the padding [V, W * tp) (38 here) is a finite logprob for SkyRL; with
    # vocab_size=V it is out of range for us: mask [V, ...) as well.
    assert float(theirs[1, 0]) < 0.0
    with pytest.raises(ValueError, match="target"):
        vocab_parallel_logprobs(logits, target.masked_fill(outside, -100), vocab_size=VOCAB)
    real = vocab_parallel_logprobs(logits, target.masked_fill((target < 0) | (target >= VOCAB),
                                                              -100), vocab_size=VOCAB)
    assert float(real[1, 0]) == 0.0 and bool(torch.isfinite(real).all())


# ------------------------------------------------------------------------------------ verl


def _bf16_entropy(z):
    """verl / SkyRL ``vocab_parallel_entropy`` arithmetic, all in the logits' dtype."""
    m = z.max(-1, keepdim=True).values
    e = (z - m).exp()
    s = e.sum(-1, keepdim=True)
    p = e / s
    return (m + s.log() - (p * z).sum(-1, keepdim=True)).squeeze(-1)


def test_verl_skyrl_entropy_bf16():
    full = _logits(4, 9)
    logits = full.to(torch.bfloat16)
    logp_exact = torch.log_softmax(logits.double(), -1)
    exact = -(logp_exact.exp() * logp_exact).sum(-1)
    theirs = _bf16_entropy(logits)
    ours = vocab_parallel_entropy(logits)
    assert theirs.dtype == torch.bfloat16 and ours.dtype == torch.float32
    _close(ours, exact, rtol=1e-5, atol=1e-5, what="our entropy of bf16 logits")
    assert (theirs.double() - exact).abs().max() > 1e-3, "bf16 arithmetic should be visible"
    logp = torch.log_softmax(full, -1)
    _close(vocab_parallel_entropy(full.float()), -(logp.exp() * logp).sum(-1),
           what="fp32 entropy (same sign as verl / SkyRL)")


def test_verl_entropy_logits_untouched():
    logits = _logits(3, 8).float().requires_grad_()
    before = logits.detach().clone()
    ent = vocab_parallel_entropy(logits)
    ent.sum().backward()
    assert torch.equal(logits.detach(), before), "ours wrote the logits"
    # verl's backward subtracts E_p[z] in place and adds it back: not the identity in fp32.
    p = torch.softmax(before, -1)
    mean = (p * before).sum(-1, keepdim=True)
    roundtrip = (before - mean) + mean
    assert not torch.equal(roundtrip, before), "the in-place round trip happened to be exact"


def test_verl_linear_ce_outputs():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 24, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, 24, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, VOCAB, (7,), generator=gen)
    temperature = 0.7
    logp = torch.log_softmax(hidden @ weight.T / temperature, -1)   # verl: logits * (1/T)
    lp_ref = logp.gather(-1, labels[:, None])[:, 0]
    ent_ref = -(logp.exp() * logp).sum(-1)
    logprobs, entropy, *_ = linear_vocab_parallel_stats(hidden.float(), weight.float(), labels,
                                                       temperature=temperature)
    _close(logprobs, lp_ref, what="logprobs (reduction 'none')")
    _close(entropy, ent_ref, what="entropy")
    _close(logprobs.sum(), lp_ref.sum(), what="reduction 'sum'")
    _close(logprobs.mean(), lp_ref.mean(), what="reduction 'mean'")


def test_fused_head_rounds_logits_to_the_model_dtype():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, 48, generator=gen).bfloat16()
    weight = (torch.randn(PADDED, 48, generator=gen) * 0.5).bfloat16()
    labels = torch.randint(0, VOCAB, (9,), generator=gen)
    exact = hidden.double() @ weight.double().T             # verl: the unrounded accumulator
    rounded = exact.bfloat16().double()                     # ours: rounded once to bf16

    def logprobs(z):
        return torch.log_softmax(z, -1).gather(-1, labels[:, None])[:, 0]

    ours = linear_vocab_parallel_stats(hidden, weight, labels).logprobs
    _close(ours, logprobs(rounded), rtol=2e-6, atol=2e-6, what="ours vs the bf16 logits")
    gap = (logprobs(exact) - logprobs(rounded)).abs().max().item()
    assert gap > 50 * 2e-6, f"the bf16 rounding of the logits is invisible here ({gap:.2e})"
    with pytest.raises(ValueError, match="hidden must be bf16, fp16 or fp32"):
        linear_vocab_parallel_stats(hidden.double(), weight.double(), labels)


# ------------------------------------------------------------------------------------ verl: RC


def _verl_rs_keep(log_ratio, lower, upper, *, seq_sum=False):
    """verl 0.9.1 ``compute_rollout_rejection_mask`` with ``token_k1`` / ``seq_sum_k1`` and
    ``"lower_upper"``: k1 = -clamp(log rho, +-20) per token (summed over the row for seq_sum),
    kept where log(lower) <= k1 <= log(upper)."""
    import math

    k1 = -log_ratio.clamp(-20.0, 20.0)
    if seq_sum:
        k1 = k1.sum(-1, keepdim=True).expand_as(log_ratio)
    return (k1 >= math.log(lower)) & (k1 <= math.log(upper))


def test_verl_rs_token_k1_bounds_the_inverse_ratio():
    gen = torch.Generator().manual_seed(6)
    old = torch.randn(4, 50, generator=gen, dtype=torch.float64)
    rollout = old + torch.randn(4, 50, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 50)
    keep = _verl_rs_keep(old - rollout, 0.5, 5.0)           # verl "0.5_5": rho in [0.2, 2]
    ours = mv.correction_weights(old, rollout, mask, mv.RolloutCorrection(mode="mis", low=0.2,
                                                                          high=2.0))
    assert torch.equal(~ours.flags, keep) and 0 < int(keep.sum()) < keep.numel()
    rho = (old - rollout).exp()
    assert torch.equal(keep, (rho >= 0.2) & (rho <= 2.0))
    # The same string as an IS threshold (IcePop) is a band on rho itself: other tokens.
    icepop = mv.correction_weights(old, rollout, mask, mv.RolloutCorrection(mode="icepop",
                                                                            low=0.5, high=5.0))
    assert not torch.equal(~icepop.flags, keep)
    # Rejection sampling only masks (weight 1); ours weighs the kept tokens by rho.
    _close(ours.weights[keep], rho[keep], what="mis weights on kept tokens")


def test_verl_rs_seq_sum_k1_clamps_each_token():
    # Rows 0 and 2 hold no |log rho| > 20: both decide alike (sum 0.2 kept, 1.3 dropped). Row 1:
    # verl clamps to 20 - 20 + 0 = 0 and keeps it; ours sums 4.0 (rho = e^4) and drops it.
    log_ratio = torch.tensor([[0.3, -0.2, 0.1, 0.0],
                              [25.0, -21.0, 0.0, 0.0],
                              [0.9, 0.4, 0.0, 0.0]], dtype=torch.float64)
    keep = _verl_rs_keep(log_ratio, 0.5, 2.0, seq_sum=True)[:, 0]
    ours = mv.correction_weights(log_ratio, torch.zeros_like(log_ratio), torch.ones(3, 4),
                                 mv.RolloutCorrection(mode="mis", level="sequence", low=0.5,
                                                      high=2.0))
    assert keep.tolist() == [True, True, False]
    assert (~ours.flags[:, 0]).tolist() == [True, False, False]


def test_skyrl_fused_head_one_dtype():
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, 5, 24, generator=gen).bfloat16()
    weight = torch.randn(PADDED, 24, generator=gen) * 0.5            # fp32 output layer
    target = torch.randint(0, VOCAB, (2, 5), generator=gen)
    # SkyRL: logits = hidden.to(weight.dtype) @ weight.T, then fp32 log-softmax over W·tp columns.
    z = hidden.to(weight.dtype).double() @ weight.double().T
    theirs = torch.log_softmax(z, -1).gather(-1, target[..., None])[..., 0]
    with pytest.raises(ValueError, match="weight dtype torch.float32 differs from hidden dtype"):
        linear_vocab_parallel_stats(hidden, weight, target)
    ours = linear_vocab_parallel_stats(hidden.to(weight.dtype), weight, target).logprobs
    _close(ours, theirs, what="logprobs with hidden cast to the weight's dtype")


# ------------------------------------------------------------------------------------ torchtitan


def test_torchtitan_sum_reduction():
    full = _logits(9, width=VOCAB)
    labels = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4))
    labels[[1, 5]] = -100
    theirs = torch.nn.functional.cross_entropy(full, labels, reduction="sum", ignore_index=-100)
    ours = mv.vocab_parallel_cross_entropy(full.float(), labels, tp_group=None)
    _close(ours.sum(), theirs, what="summed loss")
    assert bool((ours[[1, 5]] == 0).all())


# ------------------------------------------------------------------------------------ the doc


def _doc_text():
    with open(DOC) as f:
        return f.read()


def _examples():
    text = _doc_text()
    heading = None
    out = []
    for block in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```", text, re.S | re.M):
        if block.group(1):
            heading = block.group(1).strip()
        else:
            out.append(pytest.param(block.group(2), id=heading))
    return out


@pytest.mark.parametrize("code", _examples())
def test_doc_example_runs(code):
    lines = code.strip("\n").split("\n")
    assert len(lines) == 3, f"examples are three lines, this one has {len(lines)}"
    if "vocab_start" in code and not HAS_VOCAB_START:
        pytest.skip("vocab_start is not there yet")
    if ("topk_logits" in code or "gather_logits" in code) and not HAS_RAW_TOPK:
        pytest.skip("the raw-logit ops are not there yet")
    exec(compile(code, DOC, "exec"), {})


def test_doc_names_existing_tests():
    """Every test or case the doc cites exists, and every one of ours is cited."""
    from dist.migrating_cases import CASES

    text = _doc_text()
    here = {name for name in globals() if name.startswith("test_")} - {
        "test_doc_example_runs", "test_doc_names_existing_tests"}
    cited = set(re.findall(r"`(test_\w+)`", text))
    cases = set(re.findall(r"`((?:nemo_rl|skyrl|verl|torchtitan|megatron)_\w+)`", text))
    assert cited <= here, f"the doc cites missing tests: {sorted(cited - here)}"
    assert cases <= set(CASES), f"the doc cites missing cases: {sorted(cases - set(CASES))}"
    assert here <= cited, f"tests the doc does not cite: {sorted(here - cited)}"
    assert set(CASES) <= cases, f"cases the doc does not cite: {sorted(set(CASES) - cases)}"
