"""GPU checks of the fused LM head (skipped without CUDA): the fp32-accumulating weight-gradient
GEMM, float64 parity on the device, CUDA-graph capture of the forward, and the peak memory
against the unfused pair at the issue's size.

Run: ``python -m pytest tests/gpu/test_fused_linear_gpu.py -q`` on a machine with one GPU.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
from dist.fused_linear_cases import assert_close, make_problem, reference_linear  # noqa: E402
from megatron_vocabstats import vocab_parallel_stats  # noqa: E402
from megatron_vocabstats.ops.engine.linear import ChunkBuffers  # noqa: E402
from megatron_vocabstats.ops.engine.wgrad import accumulate_wgrad, wgrad_mode  # noqa: E402
from megatron_vocabstats.ops.stats.from_hidden import linear_vocab_parallel_stats  # noqa: E402
from megatron_vocabstats.profiling import peak_memory_bytes  # noqa: E402

CUDA = torch.device("cuda")


def test_weight_gradient_gemm_accumulates_in_fp32():
    mode = wgrad_mode("cuda")
    assert mode in ("addmm", "mm"), f"bf16 weight gradients would run as fp32 GEMMs ({mode})"
    torch.manual_seed(0)
    g = torch.randn(300, 96, device=CUDA).bfloat16()
    h = torch.randn(300, 40, device=CUDA).bfloat16()
    acc = torch.full((96, 40), 0.5, device=CUDA)
    bufs = ChunkBuffers(h, 96, 300)
    accumulate_wgrad(acc, g, h, bufs)
    exact = g.double().T @ h.double() + 0.5
    assert_close(acc.cpu(), exact.cpu(), rtol=1e-5, atol=1e-5,
                 scale=(g.double().abs().T @ h.double().abs()).cpu(), what="dW sums")


@pytest.mark.parametrize("forward_grad", [False, True])
def test_bf16_matches_float64_on_device(forward_grad):
    hidden, weight, target = make_problem(1, tokens=(64, 3), hidden_size=96, vocab=1000,
                                          dtype=torch.bfloat16)
    w_lp = torch.rand(target.shape) + 0.5
    h = hidden.to(CUDA).requires_grad_()
    w = weight.to(CUDA).requires_grad_()
    st = linear_vocab_parallel_stats(h, w, target.to(CUDA), vocab_size=1000, chunk_size=50,
                                     entropy="metric" if forward_grad else "off",
                                     grad_weights=w_lp.to(CUDA) if forward_grad else None)
    (st.logprobs * w_lp.to(CUDA)).sum().backward()
    ref = reference_linear(hidden, weight, target, dtype=torch.bfloat16, w_lp=w_lp,
                           vocab_size=1000)
    assert_close(st.logprobs.cpu(), ref["logprobs"], rtol=2e-2, atol=2e-2, what="logprobs")
    assert_close(h.grad.cpu(), ref["dx"], rtol=2**-5, atol=1e-6, scale=ref["dx_scale"],
                 what="hidden gradient")
    assert_close(w.grad.cpu(), ref["dw"], rtol=2**-5, atol=1e-6, scale=ref["dw_scale"],
                 what="weight gradient")


def test_forward_is_capturable_in_a_cuda_graph():
    hidden, weight, target = make_problem(1, tokens=(128,), hidden_size=64, vocab=512,
                                          dtype=torch.bfloat16)
    h, w, t = hidden.to(CUDA), weight.to(CUDA), target.to(CUDA)
    run = lambda: linear_vocab_parallel_stats(h, w, t, vocab_size=512, chunk_size=48,  # noqa
                                              validate=False)
    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager[:3], captured[:3]):
        assert torch.equal(a, b)


def test_peak_at_least_10x_below_the_unfused_pair():
    tokens, hidden_size, width = 8192, 1024, 151_936 // 2
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden_size, device=CUDA).bfloat16().requires_grad_()
    w = (torch.randn(width, hidden_size, device=CUDA) / 32).bfloat16().requires_grad_()
    t = torch.randint(0, width, (tokens,), device=CUDA)

    def fused():
        linear_vocab_parallel_stats(h, w, t, entropy="off").logprobs.sum().backward()
        h.grad = w.grad = None

    def unfused():
        logits = h @ w.T
        vocab_parallel_stats(logits, t, entropy="off").logprobs.sum().backward()
        h.grad = w.grad = None

    base = 2 * (h.numel() + w.numel()) * 2
    fused_peak = peak_memory_bytes(fused, device=CUDA) - base
    unfused_peak = peak_memory_bytes(unfused, device=CUDA) - base
    assert unfused_peak >= 10 * fused_peak, (fused_peak, unfused_peak)
