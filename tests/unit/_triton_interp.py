"""The Triton kernels of the unfused op (``ops.kernels.triton_stats``) under Triton's CPU
interpreter, against the float64 reference and the torch path.

Not collected by the suite (no ``test_`` prefix): ``test_triton_kernels.py`` runs this file in a
subprocess with ``TRITON_INTERPRET=1`` set before triton decorates the kernels, so the
interpreter never leaks into other tests. Run by hand with::

    TRITON_INTERPRET=1 python -m pytest -q tests/unit/_triton_interp.py

Tolerances are the bounds of ``_reference.py`` (``docs/numerics.md``, "Test tolerances"), the
online rescaling counted as in ``_triton_parity.online_parts``; the op-level parity check is
``_triton_parity.check_op_parity`` (shared with the GPU suite).
"""

from __future__ import annotations

import pytest
import torch

from _reference import (
    LIBM_ULPS,
    U32,
    assert_within,
    gamma,
)
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops import _layout, _math
from megatron_vocabstats.ops.kernels import interpreting

if not interpreting():
    pytest.skip("needs TRITON_INTERPRET=1 (run through test_triton_kernels.py)",
                allow_module_level=True)

import _interp_fast

_interp_fast.install()
import triton
import triton.language as tl

import _triton_parity
from megatron_vocabstats.ops.kernels import triton_stats
from megatron_vocabstats.ops.kernels.triton_tiles import round_bf16


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, round_bf16(tl.load(x_ptr + i)))


DTYPES = _triton_parity.DTYPES
online_parts = _triton_parity.online_parts


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", ["grad", "metric"])
@pytest.mark.parametrize("name", sorted(_triton_parity.CASES))
def test_op_parity(name, mode, dtype):
    _triton_parity.check_op_parity(name, mode, dtype, torch.device("cpu"))


def _pair_bounds(z64: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds ``[n]`` of the difference of two fp32 evaluations (the kernel's, the torch path's)
    of a row's ``S = sum_j e^x_j``/``U = sum_j e^x_j x_j`` and of ``A = sum_j x_j`` (``x = z -
    max z``, before the scale ``c``), first order in u.

    Per term: ``x_j`` is rounded once (relative u, which moves ``e^x_j`` by ``u |x_j|``), the
    kernel's ``exp2(x log2 e)`` two more (``2 u |x_j|``, the exponents of its rescalings add up to
    the same), exp costs ``LIBM_ULPS`` u, the product ``e^x x`` one u; the W terms are summed
    (``gamma_W``) and the kernel rescales a lane's partial sums up to nb - 1 times and once more
    as the lanes merge, each an exp, a product and an add (and for U the ``d s`` correction, whose
    terms are bounded by ``e^x_j |x_j|``), ``nb (LIBM_ULPS + 4) u`` relative. The terms of S and
    U are bounded together by ``e^x (1 + |x|)``; every term of A has one sign, so ``A`` gets
    ``sum |x| (u + gamma_(W + 2nb))``. Both evaluations meet the bound, so their difference is
    within twice it.
    """
    u = U32
    width = z64.shape[-1]
    x = z64 - z64.amax(-1, keepdim=True)
    weight = x.exp() * (1 + x.abs())
    rescale = gamma(width + 3 * nb) + nb * (LIBM_ULPS + 4) * u
    d_su = (weight * (3 * u * x.abs() + (LIBM_ULPS + 1) * u)).sum(-1) + rescale * weight.sum(-1)
    d_a = x.abs().sum(-1) * (u + gamma(width + 2 * nb))
    return 2 * d_su, 2 * d_a


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_shard_stats_columns(dtype, block):
    """The five statistics rows against ``_math.chunk_stats`` of the same chunk, many blocks:
    the max and the target logit bitwise, the sums within their rounding bounds."""
    gen = torch.Generator().manual_seed(block + DTYPES.index(dtype))
    n, width, real = 6, 75, 70
    x = (torch.randn(n, width, generator=gen) * 4).to(dtype)
    x[1, 5] = float("-inf")
    x[3, :] = float("-inf")  # a dead row: max -inf, sums 0
    layout = _layout.ShardLayout(vocab_start=0, width=width, real_width=real, vocab_size=real)
    target = torch.randint(0, real, (n,), generator=gen)
    valid = torch.ones(n, dtype=torch.bool)
    valid[4] = False
    index, owned = _layout.local_target_index(target, valid, layout)
    ours = torch.zeros(_math.NUM_STATS, n)
    theirs = torch.zeros(_math.NUM_STATS, n)
    triton_stats.shard_stats(x, index, owned, ours, layout=layout, temperature=1.0,
                             entropy=True, zsum=True, block_n=block)
    z = _math.load_chunk(x, torch.empty(n, width), layout, 1.0)
    _math.chunk_stats(z, torch.empty(n, width), index, owned, theirs, layout=layout,
                      entropy=True, zsum=True)
    for row in (_math.STAT_MAX, _math.STAT_TARGET):
        assert torch.equal(ours[row], theirs[row]), f"stat row {row}"
    assert bool((ours[_math.STAT_SUMEXP, 3] == 0) & (ours[_math.STAT_ENT, 3] == 0))
    live = [r for r in range(n) if r not in (1, 3)]  # row 1: the smoothing sum is -inf
    z64 = x.double()[live, :real].clamp(min=_math.Z_FLOOR)
    d_su, d_a = _pair_bounds(z64, -(-width // block))
    for row in (_math.STAT_SUMEXP, _math.STAT_ENT):
        assert_within(ours[row, live], theirs[row, live], d_su, f"stat row {row}")
    assert_within(ours[_math.STAT_ZSUM, live], theirs[_math.STAT_ZSUM, live],
                  d_a * _math.zsum_scale(real), "smoothing sum")
    assert ours[_math.STAT_ZSUM, 1] == float("-inf")


def test_bf16_rounding_keeps_every_nan():
    """``round_bf16`` on NaNs with low payload bits (a GPU's arithmetic makes ``0x7FFFFFFF``):
    NaN, never the zero or infinity the rounding bias would carry them into."""
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001,
                         0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001], dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    y = torch.empty(16, dtype=torch.bfloat16)
    _round_kernel[(1,)](torch.cat([x, torch.zeros(6)]), y, N=16)
    want = x.to(torch.bfloat16)
    assert bool(y[:6].isnan().all())
    assert torch.equal(y[6:10], want[6:]), (y[6:10], want[6:])  # ties to even, overflow, tiny


def test_nan_row_stays_nan():
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    out = vocab_parallel_stats(x, None, validate=False, kernel="triton")
    assert bool(torch.isnan(out.logsumexp[1])) and bool(torch.isfinite(out.logsumexp[[0, 2]]).all())


@pytest.mark.parametrize("batch_invariant", [True, "tp"])
@pytest.mark.parametrize("name", ["padding", "multi_block", "smoothing_tau", "neg_inf"])
def test_batch_invariant_parity(name, batch_invariant):
    """Batch-invariant modes run the kernels (per-row pass, or "tp"'s per-block statistics)
    within the float64 bounds."""
    _triton_parity.check_op_parity(name, "grad", torch.bfloat16, torch.device("cpu"),
                                   batch_invariant=batch_invariant)


@pytest.mark.parametrize("batch_invariant", [True, "tp"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(batch_invariant):
    """A row's outputs are the same bits alone, among other rows, at another position and with
    another chunk size."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(12, 300, generator=gen) * 3).bfloat16()
    target = torch.randint(0, 290, (12,), generator=gen)
    opts = dict(vocab_size=290, label_smoothing=0.1, batch_invariant=batch_invariant,
                kernel="triton")
    full = vocab_parallel_stats(x, target, **opts)
    for rows, chunk in ((slice(5, 9), 3), (slice(7, 8), 1)):
        part = vocab_parallel_stats(x[rows], target[rows], chunk_size=chunk, **opts)
        for a, b in zip(full[:3], part[:3]):
            assert torch.equal(a[rows], b)


def test_env_forces_triton(monkeypatch):
    """``VOCABSTATS_KERNEL=triton`` makes ``kernel="auto"`` run the kernels on CPU here: the
    results equal an explicit ``kernel="triton"`` bitwise (and differ from torch's bits)."""
    x = torch.randn(5, 1100) * 3
    monkeypatch.setenv("VOCABSTATS_KERNEL", "triton")
    forced = vocab_parallel_stats(x, None)
    monkeypatch.delenv("VOCABSTATS_KERNEL")
    explicit = vocab_parallel_stats(x, None, kernel="triton")
    assert torch.equal(forced.entropy, explicit.entropy)
    assert torch.equal(forced.logsumexp, explicit.logsumexp)


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_strided_logits_equal_contiguous(layout):
    """Any strides: the kernels read the view itself (same arithmetic, so the same bits as on a
    contiguous copy), forward and backward."""
    gen = torch.Generator().manual_seed(11)
    if layout == "row_slice":  # [7, 37] with row stride 90
        view = torch.randn(7, 90, generator=gen).bfloat16()[:, 5:42]
    else:  # [7, 37] with column stride 7
        view = torch.randn(37, 7, generator=gen).bfloat16().t()
    target = torch.randint(0, 37, (7,), generator=gen)
    results = []
    for x in (view, view.contiguous()):
        leaf = x.detach().clone() if x.is_contiguous() else x.detach()
        leaf.requires_grad_()
        st = vocab_parallel_stats(leaf, target, label_smoothing=0.1, kernel="triton")
        (st.logprobs.sum() + st.entropy.sum()).backward()
        results.append((*st[:3], leaf.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_no_tokens():
    st = vocab_parallel_stats(torch.randn(0, 40, requires_grad=True),
                              torch.zeros(0, dtype=torch.long), kernel="triton")
    assert st.logprobs.shape == (0,) and st.entropy.shape == (0,)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_large_logits_keep_their_digits(fused):
    """The kernel's gradient forms ``log p = (z - lse) - lse_lo`` (the logsumexp as an
    fp32 pair): at logits near 1e7 p = (0.644, 0.237, 0.087, 0.032), not exp(z - 1e7)."""
    from megatron_vocabstats import linear_vocab_parallel_stats

    x = torch.tensor([[1e7, 1e7 - 1, 1e7 - 2, 1e7 - 3]] * 3)
    target = torch.tensor([1, 0, 3])
    ref = torch.softmax(x.double(), -1)
    expected = torch.nn.functional.one_hot(target, 4).double() - ref
    if fused:
        hidden = torch.ones(3, 1, requires_grad=True)
        weight = x[0].reshape(-1, 1).clone().requires_grad_()
        linear_vocab_parallel_stats(hidden, weight, target, entropy="off",
                                    kernel="triton").logprobs.sum().backward()
        got, expected = weight.grad.reshape(-1), expected.sum(0)
    else:
        leaf = x.clone().requires_grad_()
        vocab_parallel_stats(leaf, target, entropy="off", kernel="triton").logprobs.sum().backward()
        got = leaf.grad
    assert_within(got, expected, 8 * U32 * 3, "gradient at logits of 1e7")


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_logits_near_the_top_of_fp32_keep_finite_logprobs(fused):
    """bf16 logits near 3e38 with label smoothing: the smoothing sum scales each term
    before summing (as the torch path does), so the log-probs are the torch path's -2.9e38, not
    the -inf of an overflowed sum; and the gradient is the torch path's too."""
    from megatron_vocabstats import linear_vocab_parallel_stats

    x = torch.tensor([[3e38, 0.0, -1.0, 2.0] * 8, [1.0, 3e38, 2.9e38, 0.0] * 8]).bfloat16()
    target = torch.tensor([1, 0])
    outs = {}
    for kernel in ("torch", "triton"):
        if fused:
            hidden = torch.ones(2, 1, dtype=torch.bfloat16, requires_grad=True)
            leaf = x[0].reshape(-1, 1).clone().requires_grad_()
            st = linear_vocab_parallel_stats(hidden, leaf, target, label_smoothing=0.1,
                                             entropy="off", kernel=kernel, validate=False)
        else:
            leaf = x.clone().requires_grad_()
            st = vocab_parallel_stats(leaf, target, label_smoothing=0.1, entropy="off",
                                      kernel=kernel, validate=False)
        st.logprobs.sum().backward()
        outs[kernel] = (st.logprobs, leaf.grad.float())
    assert bool(torch.isfinite(outs["triton"][0]).all()), outs["triton"][0]
    assert torch.allclose(outs["triton"][0], outs["torch"][0], rtol=1e-6, atol=0)
    assert torch.allclose(outs["triton"][1], outs["torch"][1], rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("per_block", [False, True], ids=["rows", "blocks"])
def test_nan_statistics_are_the_torch_paths(per_block):
    """A NaN logit makes the part's maximum NaN (torch's ``amax``), not the maximum of
    the other columns, whatever this Triton's ``tl.maximum`` does with NaN (it skips NaN in
    compiled code and from Triton 3.8 in the interpreter, propagated it before); -inf rows and
    rows without NaN as the torch path. Statistics bitwise where they are exact (max, target),
    NaN exactly where the torch path's are."""
    gen = torch.Generator().manual_seed(3)
    n, width = 5, 300
    x = torch.randn(n, width, generator=gen) * 3
    x[0, 7] = float("nan")
    x[1, :] = float("nan")
    x[2, :] = float("-inf")
    x[3, 299] = float("nan")
    layout = _layout.ShardLayout(vocab_start=0, width=width, real_width=width, vocab_size=width)
    index, owned = _layout.local_target_index(torch.tensor([7, 1, 2, 3, 4]),
                                            torch.ones(n, dtype=torch.bool), layout)
    nb = -(-width // _layout.BLOCK)
    shape = (_math.NUM_STATS, n, nb) if per_block else (_math.NUM_STATS, n)
    ours, theirs = torch.zeros(shape), torch.zeros(shape)
    triton_stats.shard_stats(x, index, owned, ours, layout=layout, temperature=1.0,
                             entropy=True, zsum=True, per_block=per_block)
    z = _math.load_chunk(x, torch.empty(n, nb * _layout.BLOCK), layout, 1.0)
    stats = _math.block_stats if per_block else _math.chunk_stats
    stats(z, torch.empty(n, nb * _layout.BLOCK), index, owned, theirs, layout=layout,
          entropy=True, zsum=True)
    for row in range(_math.NUM_STATS):
        assert torch.equal(ours[row].isnan(), theirs[row].isnan()), f"NaN of stat row {row}"
    for row in (_math.STAT_MAX, _math.STAT_TARGET):
        assert torch.equal(ours[row].nan_to_num(), theirs[row].nan_to_num()), f"stat row {row}"
    assert bool(ours[_math.STAT_MAX, [0, 1, 3]].isnan().any(-1).all())
    st = vocab_parallel_stats(x, torch.tensor([7, 1, 2, 3, 4]), validate=False, kernel="triton")
    ref = vocab_parallel_stats(x, torch.tensor([7, 1, 2, 3, 4]), validate=False, kernel="torch")
    for a, b in zip(st[:3], ref[:3]):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), (a, b)


def test_strided_row_vectors_equal_contiguous():
    """The per-row vectors a launch reads (lse, coefficients, targets, flags) may come
    with any strides (torch 2.15: a gradient reaching ``backward`` may have any); the kernels
    give the bits of contiguous copies, statistics and gradient."""
    gen = torch.Generator().manual_seed(13)
    n, width = 6, 40
    x = (torch.randn(n, width, generator=gen) * 3).bfloat16()
    layout = _layout.ShardLayout(vocab_start=0, width=width, real_width=width, vocab_size=width)

    def strided(v):  # the same values at stride 2
        wide = torch.zeros(2 * n, dtype=v.dtype)
        wide[::2] = v
        return wide[::2]

    target = torch.randint(0, width, (n,), generator=gen)
    valid = torch.tensor([True, True, False, True, True, True])
    index, owned = _layout.local_target_index(target, valid, layout)
    vec = dict(lse=torch.randn(n, generator=gen) + 5, lse_lo=torch.zeros(n),
               ent=torch.rand(n, generator=gen), coef_lp=torch.randn(n, generator=gen),
               coef_h=torch.randn(n, generator=gen), index=index, owned=owned, valid=valid)
    results = []
    for make in (lambda v: v, strided):
        kw = {k: make(v) for k, v in vec.items()}
        assert make is not strided or not kw["coef_lp"].is_contiguous()
        grad = torch.empty_like(x)
        triton_stats.stats_grad(x, grad, layout=layout, label_smoothing=0.1, temperature=1.0,
                                **kw)
        stats = torch.zeros(_math.NUM_STATS, n)
        triton_stats.shard_stats(x, kw["index"], kw["owned"], stats, layout=layout,
                                 temperature=1.0, entropy=True, zsum=True)
        results.append((grad, stats))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad_layout", ["expanded", "transposed", "sliced"])
def test_strided_upstream_gradients(grad_layout):
    """Upstream gradients with any strides (``loss = logprobs.sum()``'s expanded one, a
    transposed or sliced view): the same gradient bits as from contiguous copies, and the torch
    path's within its bounds."""
    gen = torch.Generator().manual_seed(17)
    x = (torch.randn(3, 2, 50, generator=gen) * 2).bfloat16()
    target = torch.randint(0, 50, (3, 2), generator=gen)
    if grad_layout == "expanded":
        g = torch.full((1, 1), 0.5).expand(3, 2)
    elif grad_layout == "transposed":
        g = torch.randn(2, 3, generator=gen).t()
    else:
        g = torch.randn(3, 4, generator=gen)[:, ::2]
    assert not g.is_contiguous()
    grads = {}
    for kernel, gl in (("triton", g), ("triton_dense", g.contiguous()), ("torch", g)):
        leaf = x.clone().requires_grad_()
        st = vocab_parallel_stats(leaf, target, label_smoothing=0.1,
                                  kernel=kernel.split("_")[0])
        torch.autograd.backward((st.logprobs, st.entropy), (gl, gl))
        grads[kernel] = leaf.grad
    assert torch.equal(grads["triton"], grads["triton_dense"])
    torch.testing.assert_close(grads["triton"].float(), grads["torch"].float(), rtol=0.02,
                               atol=1e-3)
