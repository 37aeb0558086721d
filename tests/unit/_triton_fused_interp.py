"""The fused LM head's Triton kernels (``linear_vocab_parallel_stats(kernel="triton")``: the
logits tiles by ``tl.dot``, never stored) under Triton's CPU interpreter.

Not collected by the suite (no ``test_`` prefix): ``test_triton_fused_kernels.py`` runs it in the
interpreter's own subprocess. Values and the gradients of hidden and
weight are checked against the float64 reference of the fused op's own tests
(``dist/fused_linear_cases.run_and_check``: logits ``round_dtype(hidden @ W.T)``, the same
tolerances, which allow a logit one model-dtype ulp off the float64 product, as another
accumulation order rounds). Every case runs with the kernels' own tiles (128 x 256 for bf16/fp16,
64 x 64 for fp32, K steps of 64/32: one tile and one split for these shapes) and with 16 x 16
tiles (many row, column and K blocks, splits of two column tiles merged, grouped launch order,
every mask at a width that is no multiple of the block).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vocabstats import linear_vocab_parallel_stats, vocab_parallel_stats
from megatron_vocabstats.ops.kernels import KERNEL_ENV, interpreting

if not interpreting():
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_triton_fused_kernels.py)",
                allow_module_level=True)

import _interp_fast

_interp_fast.install()
from dist.fused_linear_cases import run_and_check
from megatron_vocabstats.ops import kernels
from megatron_vocabstats.ops.kernels import triton_stats

# Many row, column and K tiles, two column tiles per split (several splits merged), groups of
# two row tiles in the launch order.
SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=16, GRAD_BLOCK_N=16, BLOCK_K=16, SPLIT_N=32, GROUP_M=2)


@pytest.fixture(params=["own_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    if request.param == "small_tiles":
        for key, value in SMALL_TILES.items():
            monkeypatch.setitem(kernels.LINEAR_BLOCKS, key, value)
            monkeypatch.setitem(kernels.LINEAR_BLOCKS_FP32, key, value)
    return request.param


CASES = {
    "fp32": dict(),
    "bf16": dict(dtype=torch.bfloat16),
    "fp16_temperature_smoothing_padding": dict(dtype=torch.float16, temperature=0.7,
                                               label_smoothing=0.1, vocab_size=99),
    "entropy_metric": dict(dtype=torch.bfloat16, entropy="metric"),
    "entropy_off": dict(entropy="off", label_smoothing=0.2),
    "forward_grad": dict(forward_grad=True, label_smoothing=0.05),
    "forward_grad_bf16": dict(forward_grad=True, dtype=torch.bfloat16),
    "many_rows_one_chunk": dict(dtype=torch.bfloat16, tokens=(9, 4), chunk_size=64),
    "ignored_chunk": dict(ignore=(0, 1, 2, 3)),
    "batch_invariant": dict(dtype=torch.bfloat16, batch_invariant=True),
    "batch_invariant_tp": dict(batch_invariant="tp", label_smoothing=0.1, vocab_size=300),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64(name, tiles):
    run_and_check(None, kernel="triton", **CASES[name])


def _problem(rows=40, hidden_size=23, vocab=101, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden, weight, target


@pytest.mark.parametrize("batch_invariant", [True, "tp"])
def test_rows_do_not_depend_on_the_batch(batch_invariant, tiles):
    """A row's outputs are the same bits among 40 rows, among 23 others starting at row 3 (another
    place in its tile of rows), and alone."""
    hidden, weight, target = _problem(vocab=256)
    opts = dict(kernel="triton", batch_invariant=batch_invariant, label_smoothing=0.1)
    full = linear_vocab_parallel_stats(hidden, weight, target, **opts)
    for rows in (slice(3, 26), slice(17, 18)):
        part = linear_vocab_parallel_stats(hidden[rows], weight, target[rows], **opts)
        for a, b in zip(full[:3], part[:3]):
            assert torch.equal(a[rows], b)


def _run(hidden, weight, target, **opts):
    h = hidden.detach().clone().requires_grad_() if hidden.is_contiguous() else (
        hidden.detach().requires_grad_())
    w = weight.detach().clone().requires_grad_() if weight.is_contiguous() else (
        weight.detach().requires_grad_())
    st = linear_vocab_parallel_stats(h, w, target, chunk_size=8, **opts)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    return (*st[:3], h.grad, w.grad)


def test_strided_inputs_equal_contiguous(tiles):
    """The kernels read hidden and weight through their strides: a transposed weight (a tied
    embedding stored ``[H, V]``) and a column slice of hidden give the bits of contiguous
    copies."""
    hidden, weight, target = _problem()
    wide = torch.randn(hidden.shape[0], 40).to(hidden.dtype)
    wide[:, 5:28] = hidden
    h_view, w_view = wide[:, 5:28], weight.t().contiguous().t()
    assert not (h_view.is_contiguous() or w_view.is_contiguous())
    views = _run(h_view, w_view, target, kernel="triton")
    copies = _run(hidden, weight, target, kernel="triton")
    for a, b in zip(views, copies):
        assert torch.equal(a, b)


def test_environment_variable_forces_the_fused_kernels(monkeypatch):
    hidden, weight, target = _problem(rows=6)
    explicit = _run(hidden, weight, target, kernel="triton")
    monkeypatch.setenv(KERNEL_ENV, "triton")
    forced = _run(hidden, weight, target)
    for a, b in zip(explicit, forced):
        assert torch.equal(a, b)


def test_no_tokens():
    hidden, weight, _ = _problem(rows=1)
    h = hidden[:0].clone().requires_grad_()
    st = linear_vocab_parallel_stats(h, weight, torch.zeros(0, dtype=torch.long),
                                     kernel="triton")
    st.logprobs.sum().backward()
    assert st.logprobs.shape == (0,) and h.grad.shape == (0, hidden.shape[1])


@pytest.mark.parametrize("forced", [False, True])
def test_the_kernels_run(forced, monkeypatch):
    """``kernel="triton"`` (or ``VOCABSTATS_KERNEL=triton``) launches the Triton kernels, never a
    silent torch fallback: the fused op's statistics and gradient with ``FUSED`` tiles, the
    unfused op's on its logits."""
    launched = []

    def spy(kernel, grid, *args, **consts):
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return launch(kernel, grid, *args, **consts)

    launch = triton_stats.launch
    monkeypatch.setattr(triton_stats, "launch", spy)
    if forced:
        monkeypatch.setenv(KERNEL_ENV, "triton")
    opts = {} if forced else {"kernel": "triton"}
    hidden, weight, target = _problem(rows=6)
    _run(hidden, weight, target, **opts)
    assert sorted(set(launched)) == ["_tile_grad_kernel", "_tile_stats_kernel"], launched
    launched.clear()
    logits = (hidden.float() @ weight.float().T).requires_grad_()
    vocab_parallel_stats(logits, target, **opts).logprobs.sum().backward()
    assert sorted(set(launched)) == ["_row_grad_kernel", "_row_stats_kernel"], launched
