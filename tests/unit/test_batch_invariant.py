"""Batch-invariant mode on CPU.

A probe row's logprob, entropy and logsumexp must be bitwise equal whether it is scored alone,
among 8 or among 37 rows, at any position, next to any other rows and with any chunk size,
in fp32 and bf16, and still match the float64 reference within ``docs/numerics.md``. The sizes
(2 threads, a vocabulary of 40,000 columns for the core op) are ones where torch's own sums are
NOT invariant (a lone row is split over threads), which each test asserts for the default mode,
so a stubbed mode fails. tp = 1 vs 2 vs 4 is in ``dist/batch_invariant_cases.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _reference import reference_stats
from megatron_vocabstats import linear_vocab_parallel_stats, vocab_parallel_stats
from megatron_vocabstats.ops._layout import BLOCK
from megatron_vocabstats.ops._math import tree_sum_
from megatron_vocabstats.testing import forbid_host_sync

CHUNKS = [1, 3, 16, None]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def _batches(probes: torch.Tensor, make_rows, seed: int):
    """``(batch, positions of the probes)`` of 1 (each probe alone), 8 and 37 rows; the other
    rows random, the probes at varying positions."""
    gen = torch.Generator().manual_seed(seed)
    out = [(probes[i:i + 1], [0]) for i in range(len(probes))]
    for size in (8, 37):
        rows = make_rows(size, gen)
        positions = torch.randperm(size, generator=gen)[:len(probes)].tolist()
        rows[positions] = probes
        out.append((rows, positions))
    return out


def _targets(probes, probe_targets, vocab):
    """``targets_of(batch, positions)``: random targets, the probes' own at their positions."""

    def targets_of(batch, positions):
        t = torch.randint(0, vocab, (batch.shape[0],))
        t[positions] = probe_targets if len(positions) > 1 else probe_targets[
            int((batch[0] == probes).all(-1).float().argmax())]
        return t

    return targets_of


def _differs(results, key):
    first = results[0]
    return any(not torch.equal(key(first), key(r)) for r in results[1:])


def _collect(run, probes, make_rows, targets_of):
    """Per probe, the ``(logprob, entropy, logsumexp)`` of every batch and chunk size."""
    per_probe = [[] for _ in range(len(probes))]
    for seed, chunk in enumerate(CHUNKS):
        for batch, positions in _batches(probes, make_rows, seed):
            st = run(batch, targets_of(batch, positions), chunk)
            for k, pos in enumerate(positions if len(positions) > 1 else [0]):
                probe = k if len(positions) > 1 else int((batch == probes).all(-1).float().argmax())
                per_probe[probe].append(torch.stack([st.logprobs[pos], st.entropy[pos],
                                                     st.logsumexp[pos]]))
    return per_probe


def _check(per_probe, reference, tol, *, invariant: bool):
    if invariant:
        for results in per_probe:
            for r in results[1:]:
                assert torch.equal(r, results[0]), (r - results[0]).abs().max()
    for k, results in enumerate(per_probe):
        err = (torch.stack(results).double() - reference[k]).abs().max()
        assert err <= tol, f"probe {k}: {err:.3g} from float64"
    return any(_differs(results, lambda t: t) for results in per_probe)


def _check_modes(op, modes, probes, make_rows, targets_of, reference, tol, dtype):
    """``op(batch, target, chunk_size=, batch_invariant=)`` is invariant in each of ``modes``
    and close to ``reference``; in fp32 the default mode must vary (or the test proves
    nothing at these sizes)."""
    for mode in (*modes, False):
        per_probe = _collect(lambda b, t, c: op(b, t, chunk_size=c, batch_invariant=mode),
                             probes, make_rows, targets_of)
        varies = _check(per_probe, reference, tol, invariant=mode is not False)
    if dtype == torch.float32:
        assert varies, "the default mode was batch-invariant at these sizes"


VOCAB = 40_000


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_core_op_rows_are_bitwise_invariant(dtype):
    torch.manual_seed(0)
    probes = (torch.randn(3, VOCAB, dtype=torch.float64) * 4).to(dtype)
    probe_targets = torch.tensor([5, 39_999, 17_000])

    def make_rows(n, gen):
        return (torch.randn(n, VOCAB, generator=gen, dtype=torch.float64) * 4).to(dtype)

    targets_of = _targets(probes, probe_targets, VOCAB)
    lp, ent, lse = reference_stats(probes.double(), probe_targets)
    reference = torch.stack([lp, ent, lse], dim=1)
    tol = TOL[dtype] if dtype != torch.float32 else 1e-5 * 20  # logsumexp ~ 15: relative 1e-5
    _check_modes(vocab_parallel_stats, (True, "tp"), probes, make_rows, targets_of, reference,
                 tol, dtype)


def test_gradient_rows_are_bitwise_invariant():
    torch.manual_seed(1)
    rows = torch.randn(37, VOCAB) * 4
    target = torch.randint(0, VOCAB, (37,))
    grads = []
    for sl in (slice(20, 21), slice(15, 23), slice(0, 37)):
        leaf = rows[sl].clone().requires_grad_()
        st = vocab_parallel_stats(leaf, target[sl], chunk_size=3, batch_invariant=True)
        (st.logprobs * 0.7 - st.entropy * 0.3).sum().backward()
        grads.append(leaf.grad[20 - sl.start])
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


def test_tp1_modes_agree_and_label_smoothing_is_invariant():
    torch.manual_seed(2)
    rows = torch.randn(9, 1000) * 3
    target = torch.randint(0, 1000, (9,))
    a = vocab_parallel_stats(rows, target, batch_invariant=True, label_smoothing=0.1,
                             vocab_size=990)
    b = vocab_parallel_stats(rows, target, batch_invariant="tp", label_smoothing=0.1,
                             vocab_size=990)
    one = vocab_parallel_stats(rows[4:5], target[4:5], batch_invariant=True,
                               label_smoothing=0.1, vocab_size=990, chunk_size=1)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert torch.equal(one.logprobs[0], a.logprobs[4])
    lp, ent, _ = reference_stats(rows.double(), target, vocab_size=990, label_smoothing=0.1)
    assert (a.logprobs.double() - lp).abs().max() <= 1e-5
    assert (a.entropy.double() - ent).abs().max() <= 1e-5


def test_tree_sum_order_and_trailing_zeros():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0, 3.0]])
    # ((1e8 + 3) + -1e8) + (1 + 1), the halving tree over 8 with 3 zero pads.
    expected = ((torch.tensor(1e8) + 3.0) + -1e8) + (torch.tensor(1.0) + 1.0)
    assert torch.equal(tree_sum_(x.clone(), 1), expected.view(1))
    padded = torch.cat([x, torch.zeros(1, 11)], dim=1)
    assert torch.equal(tree_sum_(padded, 1), expected.view(1))
    assert BLOCK == 128


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="batch_invariant"):
        vocab_parallel_stats(torch.randn(2, 8), None, batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant"):
        linear_vocab_parallel_stats(torch.randn(2, 4), torch.randn(8, 4), None, batch_invariant=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_op_rows_are_bitwise_invariant(dtype):
    hidden_size, vocab = 48, 1000
    torch.manual_seed(3)
    weight = (torch.randn(vocab, hidden_size, dtype=torch.float64) * 0.4).to(dtype)
    probes = torch.randn(3, hidden_size, dtype=torch.float64).to(dtype)
    probe_targets = torch.tensor([0, 999, 500])

    def make_rows(n, gen):
        return torch.randn(n, hidden_size, generator=gen, dtype=torch.float64).to(dtype)

    targets_of = _targets(probes, probe_targets, vocab)
    logits = (probes @ weight.t()).double()  # the model-dtype logits of the reference
    lp, ent, lse = reference_stats(logits, probe_targets)
    reference = torch.stack([lp, ent, lse], dim=1)
    tol = TOL[dtype] * (1.0 if dtype == torch.bfloat16 else 10)
    fused = functools.partial(linear_vocab_parallel_stats, weight=weight)
    _check_modes(lambda b, t, **kw: fused(b, target=t, **kw), (True,), probes, make_rows,
                 targets_of, reference, tol, dtype)


def _recorded_takes(monkeypatch):
    """Element counts of every buffer the ops take from the workspace."""
    from megatron_vocabstats.ops import workspace

    sizes = []
    take = workspace.WORKSPACE.take

    def recording(shape, *args, **kwargs):
        sizes.append(tuple(shape))
        return take(shape, *args, **kwargs)

    monkeypatch.setattr(workspace.WORKSPACE, "take", recording)
    return sizes


def test_fused_op_buffers_follow_the_token_count_not_the_chunk_size(monkeypatch):
    # A few tokens with the auto chunk size (16k rows on CPU at W = 1000) must get buffers of
    # one 64-row block, as in the default mode they get the token count.
    sizes = _recorded_takes(monkeypatch)
    hidden, weight = torch.randn(4, 16), torch.randn(1000, 16)
    target = torch.randint(0, 1000, (4,))
    one_block = 64 * 1024  # INVARIANT_ROWS rows of the padded width
    for mode in (True, "tp"):
        sizes.clear()
        h = hidden.clone().requires_grad_()
        st = linear_vocab_parallel_stats(h, weight, target, batch_invariant=mode)
        st.logprobs.sum().backward()
        assert sizes and max(torch.Size(s).numel() for s in sizes) <= one_block, sizes


def test_tp_mode_merges_in_bounded_passes_with_the_same_bits(monkeypatch):
    # "tp" merges tp * nb parts per token: in passes whose [parts, tokens] temporaries stay
    # near one [chunk, W] buffer, not [parts, T] for the whole sequence.
    from megatron_vocabstats.ops import _math

    shapes = []
    combine = _math._combine

    def recording(parts, **kwargs):
        shapes.append(tuple(parts.shape))
        return combine(parts, **kwargs)

    monkeypatch.setattr(_math, "_combine", recording)
    torch.manual_seed(4)
    logits, target = torch.randn(300, 1000) * 3, torch.randint(0, 1000, (300,))
    with forbid_host_sync():
        st = vocab_parallel_stats(logits, target, batch_invariant="tp", chunk_size=8,
                                  label_smoothing=0.1, validate=False)
    merges = [s for s in shapes if s[0] == 1024 // BLOCK]
    assert merges and max(s[0] * s[-1] for s in merges) <= 8 * 1024 // 8 + 8 * 1024 // BLOCK
    assert sum(s[-1] for s in merges) == 300
    one_pass = vocab_parallel_stats(logits, target, batch_invariant="tp", chunk_size=300,
                                    label_smoothing=0.1)
    for a, b in zip(st[:3], one_pass[:3]):
        assert torch.equal(a, b)


def test_merge_passes_give_the_same_bits():
    from megatron_vocabstats.ops._math import NUM_STATS, STAT_MAX, merge_stats

    torch.manual_seed(5)
    parts = torch.rand(6, NUM_STATS, 37) * 3
    parts[:, STAT_MAX] = torch.randn(6, 37) * 4
    valid = torch.rand(37) > 0.2
    opts = dict(vocab_size=700, label_smoothing=0.1, entropy=True, has_target=True,
                batch_invariant=True)
    whole = merge_stats(parts, valid, **opts)
    for per_pass in (1, 5, 36, 37, 100):
        split = merge_stats(parts, valid, tokens_per_pass=per_pass, **opts)
        for name in ("logsumexp", "logprobs", "entropy"):
            assert torch.equal(getattr(split, name), getattr(whole, name)), (per_pass, name)


@pytest.mark.parametrize("mode", [True, "tp"])
def test_empty_batch(mode):
    # No tokens (an empty microbatch or context-parallel shard) works as in the default mode.
    logits = torch.randn(0, 300, requires_grad=True)
    hidden, weight = torch.randn(0, 8, requires_grad=True), torch.randn(300, 8)
    target = torch.zeros(0, dtype=torch.long)
    for st in (vocab_parallel_stats(logits, target, batch_invariant=mode),
               linear_vocab_parallel_stats(hidden, weight, target, batch_invariant=mode)):
        assert all(t.shape == (0,) for t in st[:3])
        (st.logprobs.sum() + st.entropy.sum()).backward()
    assert logits.grad.shape == (0, 300) and hidden.grad.shape == (0, 8)


def test_the_flag_spellings_are_accepted():
    x, t = torch.randn(3, 300), torch.tensor([1, 2, 3])
    for name, mode in (("off", False), ("batch", True), ("tp", "tp")):
        assert torch.equal(vocab_parallel_stats(x, t, batch_invariant=name).logprobs,
                           vocab_parallel_stats(x, t, batch_invariant=mode).logprobs)
