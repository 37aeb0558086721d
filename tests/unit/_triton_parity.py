"""The parity check of the Triton kernels against float64, shared by the CPU interpreter tests
(``_triton_interp.py``) and the GPU suite (``tests/gpu/test_triton_gpu.py``).

Tolerances are the bounds of ``_reference.py`` (``docs/numerics.md``, "Test tolerances") with
the kernels' online rescaling counted as merged parts (:func:`online_parts`). Imports no triton.
"""

from __future__ import annotations

import pytest
import torch

from _reference import (
    assert_within,
    reference_stats,
    smoothed_logprob_bound,
    stats_bounds,
    stats_grad_bound,
    temperature_dz,
)
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops._layout import BLOCK
from megatron_vocabstats.ops.kernels import block_columns

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def online_parts(width: int, block: int) -> int:
    """``parts`` of ``stats_bounds`` covering the online rescaling over ``width`` columns.

    Over nb steps of ``block`` columns a partial sum (a lane's, a tile row's) is rescaled at
    most nb - 1 times, then once more where partial sums merge (the lanes of a row, the splits
    of a fused row), each one exp (``LIBM_ULPS`` u), one product and one add: at most
    ``nb (LIBM_ULPS + 2) u = 4 nb u``; ``stats_bounds`` allows ``gamma_{P-1} + (LIBM_ULPS + 4) u
    ~ (P + 5) u`` for P > 1 parts, enough for ``P >= 4 nb - 5``. (The rounding of each rescaling's
    exponent adds up to the final ``x_j``'s, which ``stats_bounds`` counts with ``exp2``.) The
    sums themselves are sums of the row's terms in some order: its ``gamma_{W-1}``."""
    nb = -(-width // block)
    return max(2, 4 * nb - 5)


# name -> (rows, width, vocab, temperature, label smoothing, scale, extras)
CASES = {
    "plain": (6, 37, 37, 1.0, 0.0, 3.0, ()),
    "multi_block": (5, 2100, 2100, 1.0, 0.0, 4.0, ()),
    "padding": (5, 1100, 1030, 1.0, 0.1, 3.0, ()),
    "neg_inf": (6, 40, 40, 1.0, 0.0, 3.0, ("neg_inf",)),
    "fp16_max": (4, 1500, 1500, 1.0, 0.0, 1.0, ("huge",)),
    "ignore_rows": (7, 33, 30, 1.0, 0.0, 3.0, ("ignore",)),
    "temperature": (5, 1200, 1150, 0.7, 0.0, 3.0, ()),
    "smoothing_tau": (5, 50, 45, 1.3, 0.2, 3.0, ("ignore",)),
}


def make_case(name, dtype, gen):
    rows, width, vocab, tau, eps, scale, extras = CASES[name]
    x = torch.randn(rows, width, generator=gen) * scale
    if "huge" in extras:  # logits near fp16's largest finite value, 65504
        x = 65504.0 - x.abs() * 8
    x = x.to(dtype)
    if "neg_inf" in extras:
        x[0, 3] = x[2, 0] = x[2, 39] = float("-inf")
    target = torch.randint(0, vocab, (rows,), generator=gen)
    if "ignore" in extras:
        target[1] = target[4] = -100
    return x, target, vocab, tau, eps


def check_op_parity(name, mode, dtype, device: torch.device, batch_invariant=False):
    """``vocab_parallel_stats`` with ``kernel="triton"`` on ``device`` (CPU: the interpreter)
    against float64 (values and gradient within the bounds), and the torch path's infinities.
    ``batch_invariant="tp"``: the kernel's per-block statistics (blocks of 128 columns, merged
    as parts)."""
    if "huge" in CASES[name][-1] and dtype == torch.bfloat16:
        pytest.skip("bf16 rounds 65504 - 8 |x| into a handful of values: covered by fp16")
    gen = torch.Generator().manual_seed(len(name) * 7 + DTYPES.index(dtype))
    x, target, vocab, tau, eps = make_case(name, dtype, gen)
    valid = target != -100
    width = x.shape[1]
    w_lp = torch.randn(x.shape[0], generator=gen)
    w_h = torch.randn(x.shape[0], generator=gen)
    results = {}
    for kernel in ("torch", "triton"):
        leaf = x.to(device, copy=True).requires_grad_()
        st = vocab_parallel_stats(leaf, target.to(device), vocab_size=vocab, temperature=tau,
                                  label_smoothing=eps, entropy=mode, kernel=kernel,
                                  batch_invariant=batch_invariant)
        loss = (st.logprobs * w_lp.to(device)).sum()
        if mode == "grad":
            loss = loss + (st.entropy * w_h.to(device)).sum()
        loss.backward()
        results[kernel] = (type(st)(*(None if t is None else t.detach().cpu() for t in st)),
                           leaf.grad.cpu())
    ref_leaf = x.double().requires_grad_()
    ref = reference_stats(ref_leaf, target, vocab_size=vocab, temperature=tau,
                          label_smoothing=eps)
    ref_loss = (ref[0] * w_lp.double()).sum()
    if mode == "grad":
        ref_loss = ref_loss + (ref[1] * w_h.double()).sum()
    ref_loss.backward()

    z = x.double()[:, :vocab] / tau
    block = BLOCK if batch_invariant == "tp" else block_columns(width, dtype.itemsize)
    b = stats_bounds(z, dz=temperature_dz(z, tau), width=width,
                     parts=online_parts(width, block), exp2=True)
    st, grad = results["triton"]
    assert grad.dtype == dtype
    assert_within(st.logsumexp, ref[2], b.logsumexp, "logsumexp")
    assert_within(st.entropy[valid], ref[1][valid], b.entropy[valid], "entropy")
    assert bool((st.entropy[~valid] == 0).all()), "entropy at ignored rows"
    safe = torch.where(valid, target, 0)
    bound = smoothed_logprob_bound(b, safe, eps)
    assert_within(st.logprobs[valid], ref[0][valid], bound[valid], "logprobs")
    assert bool((st.logprobs[~valid] == 0).all()), "logprobs at ignored rows"

    keep = valid.double() / tau
    c_h = w_h.double() * keep if mode == "grad" else None
    gbound = stats_grad_bound(b, ref_leaf.grad[:, :vocab], c_lp=w_lp.double() * keep, c_h=c_h,
                              target=safe, eps=eps, scaled=tau != 1.0, dtype=dtype)
    assert_within(grad[:, :vocab][valid], ref_leaf.grad[:, :vocab][valid], gbound[valid],
                  "gradient")
    assert bool((grad[:, vocab:] == 0).all()), "gradient at padding columns"
    assert bool((grad[~valid] == 0).all()), "gradient at ignored rows"
    # The torch path meets the same bounds; both agree on where the results are infinite.
    torch_st = results["torch"][0]
    assert torch.equal(torch.isinf(torch_st.logprobs), torch.isinf(st.logprobs))


