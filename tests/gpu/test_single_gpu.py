"""Single-GPU checks of the ops (skipped without CUDA): float64 parity on the device, CUDA-graph
capture of forward + backward with exact replays under allocation pressure, peak memory
(``torch.cuda.max_memory_allocated``) against the bounds of the CPU benchmarks, and batch
invariance where the ops offer it.

Run: ``python -m pytest tests/gpu/test_single_gpu.py -q`` on a machine with a GPU, or
``bash tests/gpu/run.sh`` for the whole GPU suite.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _suite import (
    GPU_ALLOWANCE_BYTES,
    WORKSPACE_ROUNDING,
    fused_peak_bound,
    vocab_parallel_peak_bound,
)

from dist.vocab_parallel_cases import assert_close, reference_grads
from megatron_vocabstats import linear_vocab_parallel_stats, vocab_parallel_stats
from megatron_vocabstats.ops.engine.linear import auto_linear_chunk_size
from megatron_vocabstats.ops.engine.wgrad import wgrad_mode
from megatron_vocabstats.ops.options import auto_chunk_size
from megatron_vocabstats.profiling import peak_memory_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
VOCAB = 1000  # real vocabulary of the small cases; shards are 1024 wide (Megatron-style padding)
WIDTH = 1024
QWEN_VOCAB = 151_936
# numerics.md: fp32 1e-5; bf16 values 2e-2, gradients one bf16 rounding of the fp32 result.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5, grad_rtol=1e-5, grad_atol=1e-6),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2, grad_rtol=2**-8, grad_atol=1e-6),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_core_op_matches_float64_on_device(dtype):
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(37, 3, WIDTH, generator=gen, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, VOCAB, (37, 3), generator=gen)
    target[0, :2] = -100
    w_lp = torch.rand(37, 3, generator=gen, dtype=torch.float64) + 0.5
    w_h = torch.randn(37, 3, generator=gen, dtype=torch.float64)
    options = dict(temperature=0.9, label_smoothing=0.1)
    leaf = full.to(CUDA).requires_grad_()
    st = vocab_parallel_stats(leaf, target.to(CUDA), vocab_size=VOCAB, chunk_size=16, **options)
    (st.logprobs * w_lp.float().to(CUDA) + st.entropy * w_h.float().to(CUDA)).sum().backward()
    ref_lp, ref_h, ref_lse, ref_grad = reference_grads(full, target, VOCAB, w_lp, w_h, **options)
    tol = TOLERANCES[dtype]
    for name, ref in (("logprobs", ref_lp), ("entropy", ref_h), ("logsumexp", ref_lse)):
        assert_close(getattr(st, name).cpu(), ref, rtol=tol["rtol"], atol=tol["atol"], what=name)
    assert_close(leaf.grad.cpu(), ref_grad, rtol=tol["grad_rtol"], atol=tol["grad_atol"],
                 what="gradient")


# ---------------------------------------------------------------------------------------------
# CUDA graphs: capture forward + backward once, replay on new inputs copied into the static ones.

GRAPH_TOKENS, GRAPH_HIDDEN, GRAPH_CHUNK = (96, 2), 64, 40  # 192 tokens: 4 chunks of 40 + 32
REPLAYS = 10


def _graph_inputs(op: str, seed: int) -> list[torch.Tensor]:
    """CPU inputs of one replay: (hidden, weight) or (logits,), then target and the weights of
    logprobs and entropy in the objective."""
    gen = torch.Generator().manual_seed(seed)
    tokens = GRAPH_TOKENS
    if op == "fused":
        dense = [torch.randn(*tokens, GRAPH_HIDDEN, generator=gen),
                 torch.randn(WIDTH, GRAPH_HIDDEN, generator=gen) * 2.5 / GRAPH_HIDDEN**0.5]
    else:
        dense = [torch.randn(*tokens, WIDTH, generator=gen) * 3]
    target = torch.randint(0, VOCAB, tokens, generator=gen)
    target.view(-1)[seed % 7::11] = -100
    return [*(x.bfloat16() for x in dense), target, torch.rand(tokens, generator=gen) + 0.5,
            torch.randn(tokens, generator=gen)]


def _graph_step(op: str, *inputs):
    """Forward + backward: ``(logprobs, entropy, logsumexp, *input gradients)``."""
    *dense, target, w_lp, w_h = inputs
    options = dict(vocab_size=VOCAB, chunk_size=GRAPH_CHUNK, temperature=0.9)
    if op == "fused":
        st = linear_vocab_parallel_stats(*dense, target, **options)
    else:
        st = vocab_parallel_stats(*dense, target, **options)
    objective = (st.logprobs * w_lp + st.entropy * w_h).sum()
    return (*st[:3], *torch.autograd.grad(objective, dense))


def _to_device(inputs):
    return [x.to(CUDA).requires_grad_() if x.dtype == torch.bfloat16 else x.to(CUDA)
            for x in inputs]


def _capture(step, warmup: int = 3):
    """``(graph, static outputs)`` of ``step()`` captured on a side stream after ``warmup``
    eager runs there (torch.cuda.graph's recipe: warm-up on the capture stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def _pressure(tag: int) -> list[torch.Tensor]:
    """NaN-filled tensors the size of the ops' buffers (fp32 and bf16 chunks, an fp32 [W, H]
    sum, activations) and one of 64 MiB, taken from the caching allocator between replays."""
    sizes = [GRAPH_CHUNK * WIDTH * 4, GRAPH_CHUNK * WIDTH * 2, WIDTH * GRAPH_HIDDEN * 4,
             192 * GRAPH_HIDDEN * 2, 192 * WIDTH * 2, 64 * 2**20]
    return [torch.full((n // 4 + tag,), float("nan"), device=CUDA) for n in sizes]


@pytest.mark.parametrize("op", ["core", "fused"])
def test_cuda_graph_of_forward_and_backward_replays_exactly(op):
    static = _to_device(_graph_inputs(op, seed=0))
    graph, outputs = _capture(lambda: _graph_step(op, *static))
    held = []
    for replay in range(1, REPLAYS + 1):
        fresh = _graph_inputs(op, seed=replay)
        with torch.no_grad():
            for s, x in zip(static, fresh):
                s.copy_(x)
        # Allocation pressure: blocks freed and handed out again between replays, the cache
        # emptied every other replay; none of it may alias the graph's private pool.
        held = held[len(held) // 2:] + _pressure(replay)
        if replay % 2 == 0:
            torch.cuda.empty_cache()
        graph.replay()
        replayed = [o.clone() for o in outputs]
        expected = _graph_step(op, *_to_device(fresh))
        torch.cuda.synchronize()
        names = ("logprobs", "entropy", "logsumexp") + (
            ("hidden grad", "weight grad") if op == "fused" else ("logits grad",))
        for name, got, want in zip(names, replayed, expected):
            assert torch.equal(got, want), f"replay {replay}: {name} differs from eager"
        assert all(bool(torch.isnan(p).all()) for p in held), \
            f"replay {replay} wrote into memory the allocator had handed out"


# ---------------------------------------------------------------------------------------------
# Peak memory against the CPU benchmarks' bounds (benchmarks/results/*.md).

def _drop_cached_workspace() -> None:
    try:
        from megatron_vocabstats.ops.workspace import reset_workspace
    except ImportError:  # releases without the workspace cache
        return
    reset_workspace()


def _peak_with_inputs(step, inputs) -> int:
    """Peak bytes of one ``step()`` counted as the CPU benchmark's MemTracker does: the inputs
    plus everything allocated while it runs. A warm-up run makes the library workspaces
    (cuBLAS); the ops' cached chunk buffers are then dropped, so that the measured run
    allocates, and counts, its own."""
    step()
    _drop_cached_workspace()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    return peak_memory_bytes(step, device=CUDA) - base + sum(x.nbytes for x in inputs)


def test_core_op_peak_within_the_cpu_benchmark_bound():
    tokens = 8192
    torch.manual_seed(0)
    logits = (torch.randn(tokens, QWEN_VOCAB, device=CUDA) * 2).bfloat16().requires_grad_()
    target = torch.randint(0, QWEN_VOCAB, (tokens,), device=CUDA)

    def step():
        st = vocab_parallel_stats(logits, target)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        logits.grad = None

    used = _peak_with_inputs(step, (logits, target))
    bound = vocab_parallel_peak_bound(tokens, QWEN_VOCAB, auto_chunk_size(QWEN_VOCAB, CUDA),
                                      rounding=WORKSPACE_ROUNDING)
    assert used <= bound + GPU_ALLOWANCE_BYTES, (used, bound)


def test_fused_op_peak_within_the_cpu_benchmark_bound():
    tokens, hidden_size = 8192, 4096
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden_size, device=CUDA).bfloat16().requires_grad_()
    w = (torch.randn(QWEN_VOCAB, hidden_size, device=CUDA) * hidden_size**-0.5).bfloat16()
    w.requires_grad_()
    target = torch.randint(0, QWEN_VOCAB, (tokens,), device=CUDA)
    mask = (torch.rand(tokens, device=CUDA) > 0.1).float()

    def step():
        st = linear_vocab_parallel_stats(h, w, target, entropy="off")
        (-(st.logprobs * mask).sum()).backward()
        h.grad = w.grad = None

    used = _peak_with_inputs(step, (h, w, target, mask))
    chunk = auto_linear_chunk_size(QWEN_VOCAB, CUDA)
    bound = fused_peak_bound(tokens, QWEN_VOCAB, hidden_size, chunk,
                             wgrad_mode("cuda"), rounding=WORKSPACE_ROUNDING)
    assert used <= bound + GPU_ALLOWANCE_BYTES, (used, bound)


# ---------------------------------------------------------------------------------------------
# Batch invariance (the batch_invariant argument, where present).

@pytest.mark.parametrize("op", ["core", "fused"])
def test_rows_do_not_depend_on_the_batch(op):
    fn = linear_vocab_parallel_stats if op == "fused" else vocab_parallel_stats
    if "batch_invariant" not in inspect.signature(fn).parameters:
        pytest.skip(f"{fn.__name__} has no batch_invariant argument")
    gen = torch.Generator().manual_seed(3)
    tokens = 300
    if op == "fused":
        dense = [torch.randn(tokens, 256, generator=gen).bfloat16(),
                 (torch.randn(QWEN_VOCAB, 256, generator=gen) / 16).bfloat16()]
    else:
        dense = [(torch.randn(tokens, QWEN_VOCAB, generator=gen) * 2).bfloat16()]
    dense = [x.to(CUDA) for x in dense]
    target = torch.randint(0, QWEN_VOCAB, (tokens,), generator=gen).to(CUDA)

    def rows(n):
        first = dense[0][:n]
        return fn(first, *dense[1:], target[:n], batch_invariant=True)

    whole = rows(tokens)
    for n in (1, 7, 128):
        part = rows(n)
        for name, a, b in zip(whole._fields, whole, part):
            if a is not None:
                assert torch.equal(a[:n], b), f"{name} of the first {n} rows depends on the batch"
