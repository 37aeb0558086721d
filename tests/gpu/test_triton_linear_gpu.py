"""The Triton backend of the fused LM head on a GPU (skipped without CUDA or triton):
float64 parity of ``linear_vocab_parallel_stats(..., kernel="triton")`` at small shapes, one row of
Qwen's vocabulary (V = 151,936, H = 1024, T = 64, bf16), a CUDA graph of forward + backward
that replays the eager bits, and the peak memory of forward (no ``[chunk, W]`` buffer) and of a
step.

The small shapes are the unit suite's own check, ``dist/fused_linear_cases.run_and_check`` (its
float64 reference of the logits rounded to the model dtype, its tolerances), with the op it calls
run on the GPU with ``kernel="triton"`` (:func:`_triton_on_cuda`): the Triton backend is held to
the op's contract, the torch path's bounds.

Run: ``python -m pytest tests/gpu/test_triton_linear_gpu.py -q`` (also the ``single`` step of
``bash tests/gpu/run.sh``).
"""

from __future__ import annotations

import pytest
import torch
from test_single_gpu import _capture

import dist.fused_linear_cases as cases
from _reference import (
    assert_within,
    linear_grad_bounds,
    linear_logits_error,
    reference_stats,
    smoothed_logprob_bound,
    stats_bounds,
    stats_grad_bound,
)
from _triton_parity import online_parts
from megatron_vocabstats import VocabStats, linear_vocab_parallel_stats
from megatron_vocabstats.ops.kernels import LINEAR_BLOCKS, triton_available
from megatron_vocabstats.ops.options import IGNORE_INDEX

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                                reason="needs a CUDA device and triton")

CUDA = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# run_and_check's options: tempered, smoothed, logprob-only with one-row chunks, gradients in
# forward, several column blocks of the kernels (2100 columns), and a first chunk all ignored.
OPTIONS = {
    "plain": {},
    "temperature_smoothing": {"temperature": 0.7, "label_smoothing": 0.1, "vocab_size": 99},
    "logprob_only_chunk1": {"entropy": "off", "chunk_size": 1},
    "forward_grad": {"forward_grad": True, "temperature": 1.3},
    "multi_block": {"vocab_size": 2100, "tokens": (9, 7), "chunk_size": 16},
    "ignored_chunk": {"ignore": (0, 1, 2, 3)},
}


def _to_cuda(x):
    return None if x is None else x.to(CUDA)


def _triton_on_cuda(hidden, weight, target, *, grad_weights=None, **options) -> VocabStats:
    """``linear_vocab_parallel_stats`` on the GPU with ``kernel="triton"`` for CPU inputs: the
    copies to the device and back are differentiable, so the CPU leaves get the gradients."""
    stats = linear_vocab_parallel_stats(_to_cuda(hidden), _to_cuda(weight), _to_cuda(target),
                                        grad_weights=_to_cuda(grad_weights), kernel="triton",
                                        **options)
    return VocabStats(*(None if x is None else x.cpu() for x in stats))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_parity_with_float64(monkeypatch, name, dtype):
    monkeypatch.setattr(cases, "linear_vocab_parallel_stats", _triton_on_cuda)
    cases.run_and_check(None, dtype=dtype, **OPTIONS[name])


def _check_against_the_exact_product(st, h_leaf, w_leaf, hidden, weight, target, *, vocab,
                                     w_lp, w_h):
    """Values and gradients of one call (tp = 1, temperature 1, no smoothing, entropy "grad",
    objective ``sum(w_lp * logprobs + w_h * entropy)``) against float64 statistics of the exact
    product ``hidden @ weight.T``, within the bounds ``tests/unit/test_properties.py`` derives
    for the fused LM head: the GEMM's fp32 accumulation and rounding to the model dtype as the
    input error ``dz`` of ``stats_bounds``, the kernels' online rescaling as merged parts
    (``_triton_parity.online_parts``), then the gradient GEMMs (``matmul_bound``).

    At H = 1024 the GEMM rounds some logits one ulp away from the rounded exact product (on CPU
    too), which moves tiny probabilities by up to 2^-4 of themselves: a reference on the
    rounded exact product (``fused_linear_cases.reference_linear``) then fails a weight-gradient
    column, this one does not. Float64 on the inputs' device (the GPU: seconds, not minutes).
    """
    hidden, weight, w_lp, w_h = hidden.detach(), weight.detach(), w_lp.double(), w_h.double()
    dtype, width = hidden.dtype, weight.shape[0]
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits64 = h64 @ w64.T
    logits64.retain_grad()
    lp, ent, lse = reference_stats(logits64, target, vocab_size=vocab)
    (lp * w_lp + ent * w_h).sum().backward()
    z, dz = linear_logits_error(hidden, weight, vocab)
    b = stats_bounds(z, dz=dz, width=width,
                     parts=online_parts(width, LINEAR_BLOCKS["BLOCK_N"]), exp2=True)
    valid = target != IGNORE_INDEX
    safe = torch.where(valid, target, 0)
    assert_within(st.logsumexp, lse, b.logsumexp, "logsumexp")
    assert_within(st.logprobs[valid], lp[valid], smoothed_logprob_bound(b, safe, 0.0)[valid],
                  "logprobs")
    assert_within(st.entropy[valid], ent[valid], b.entropy[valid], "entropy")
    g_ref = logits64.grad[:, :vocab]
    keep = valid.double()
    e_g = stats_grad_bound(b, g_ref, c_lp=w_lp * keep, c_h=w_h * keep, target=safe, eps=0.0,
                           scaled=False, dtype=dtype)
    dx_bound, dw_bound = linear_grad_bounds(e_g, g_ref, hidden, weight, h64.grad,
                                            w64.grad[:vocab])
    assert_within(h_leaf.grad, h64.grad, dx_bound, "hidden gradient")
    assert_within(w_leaf.grad[:vocab], w64.grad[:vocab], dw_bound, "weight gradient")
    assert bool((w_leaf.grad[vocab:] == 0).all()), "weight gradient at padding rows"


def test_qwen_row_parity():
    """T = 64 rows of Qwen's padded vocabulary (151,936 columns, 151,665 real) at H = 1024, bf16,
    log-probs and entropy both differentiated, two positions ignored."""
    tokens, hidden_size, width, vocab = 64, 1024, 151_936, 151_665
    gen = torch.Generator(CUDA).manual_seed(0)  # on the device: 1.6e8 numbers
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=CUDA).bfloat16()
    weight = (torch.randn(width, hidden_size, generator=gen, device=CUDA)
              * 2.5 / hidden_size**0.5).bfloat16()  # logits ~ N(0, 2.5^2), as make_problem's
    target = torch.randint(0, vocab, (tokens,), generator=gen, device=CUDA)
    target[[0, 17]] = IGNORE_INDEX
    w_lp = torch.rand(tokens, generator=gen, device=CUDA) + 0.5
    w_h = torch.randn(tokens, generator=gen, device=CUDA)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    st = linear_vocab_parallel_stats(h, w, target, vocab_size=vocab, kernel="triton")
    (st.logprobs * w_lp + st.entropy * w_h).sum().backward()
    _check_against_the_exact_product(st, h, w, hidden, weight, target, vocab=vocab, w_lp=w_lp,
                                     w_h=w_h)


def test_cuda_graph_replays_the_eager_bits():
    hidden, weight, target = cases.make_problem(1, tokens=(96,), hidden_size=64, vocab=1100,
                                                dtype=torch.bfloat16, ignore=(5,))
    target = torch.where(target < 0, target, target % 1000)
    h = hidden.to(CUDA).requires_grad_()
    w = weight.to(CUDA).requires_grad_()
    t = target.to(CUDA)

    def step():
        h.grad = w.grad = None
        st = linear_vocab_parallel_stats(h, w, t, vocab_size=1000, chunk_size=40,
                                         label_smoothing=0.1, temperature=0.9, validate=False,
                                         kernel="triton")
        (st.logprobs.sum() + st.entropy.sum()).backward()
        return st.logprobs, st.entropy, st.logsumexp, h.grad, w.grad

    eager = [x.clone() for x in step()]
    graph, outputs = _capture(step)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(("logprobs", "entropy", "logsumexp", "dX", "dW"), outputs,
                                   eager):
            assert torch.equal(got, want), f"replay: {name} differs from eager"


def test_forward_holds_no_chunk_buffer():
    """The Triton forward folds each logits tile into the statistics: its peak beyond the inputs
    is O(T) fp32 vectors (under 64 per token, and the statistics of each split of SPLIT_N
    columns with their merge's temporaries, under 10 per split), never a ``[chunk, W]`` buffer
    (the torch path's is ~256 MiB here); backward holds one bf16 ``[chunk, W]`` gradient buffer,
    no fp32 one."""
    from megatron_vocabstats import reset_workspace
    from megatron_vocabstats.profiling import peak_memory_bytes

    tokens, hidden_size, width, chunk = 8192, 1024, 151_936 // 2, 1024
    gen = torch.Generator(CUDA).manual_seed(0)
    h = torch.randn(tokens, hidden_size, generator=gen, device=CUDA).bfloat16().requires_grad_()
    w = (torch.randn(width, hidden_size, generator=gen, device=CUDA) / 32).bfloat16()
    w.requires_grad_()
    t = torch.randint(0, width, (tokens,), generator=gen, device=CUDA)
    reset_workspace()

    def forward():
        with torch.no_grad():
            linear_vocab_parallel_stats(h, w, t, entropy="off", kernel="triton", validate=False)

    def step():
        linear_vocab_parallel_stats(h, w, t, entropy="off", kernel="triton", chunk_size=chunk,
                                    validate=False).logprobs.sum().backward()
        h.grad = w.grad = None
        reset_workspace()

    inputs = torch.cuda.memory_allocated(CUDA)  # the peak below counts every allocation
    forward_peak = peak_memory_bytes(forward, device=CUDA) - inputs
    splits = -(-width // LINEAR_BLOCKS["SPLIT_N"])
    per_token = 64 + 10 * splits
    assert forward_peak <= per_token * 4 * tokens, forward_peak
    # Backward: dX (bf16 [T, H]), the fp32 dW sums, their bf16 cast, one bf16 [chunk, W] buffer.
    bound = (2 * tokens * hidden_size + 6 * width * hidden_size + 2 * chunk * width
             + per_token * 4 * tokens + 2**24)
    step_peak = peak_memory_bytes(step, device=CUDA) - inputs
    assert step_peak <= bound, (step_peak, bound)
