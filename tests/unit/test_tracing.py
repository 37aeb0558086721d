"""Every op traces under ``make_fx(tracing_mode="symbolic")`` (what ``torch.compile``
with dynamic shapes does) and under ``torch.compile(dynamic=True)`` with its default arguments
(``validate=True``, ``chunk_size=None``), forward and backward, and the traced program gives the
eager bits. Before: the automatic chunk size became a ``SymInt`` that the op's own check refused
("chunk_size must be an int, got (1048576//s75)"), and ``validate=True`` stopped on a
data-dependent guard in the host-side checks. Under a tracer the host-side checks are skipped (as
under CUDA graph capture: the tensors hold no values), and the workspace caches nothing.
"""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version
from torch.fx.experimental.proxy_tensor import make_fx

import megatron_vocabstats as mv
from megatron_vocabstats.ops.workspace import WORKSPACE

T, V, H = 6, 40, 8

OPS = {
    "stats": lambda x, h, w, t, i: mv.vocab_parallel_stats(x, t).logprobs.sum(),
    "entropy": lambda x, h, w, t, i: mv.vocab_parallel_entropy(x).sum(),
    "cross_entropy": lambda x, h, w, t, i: mv.vocab_parallel_cross_entropy(x, t).sum(),
    "topk_logprobs": lambda x, h, w, t, i: mv.vocab_parallel_topk_logprobs(x, i).sum(),
    "gather_logits": lambda x, h, w, t, i: mv.vocab_parallel_gather_logits(x, i).sum(),
    "sampling": lambda x, h, w, t, i: mv.vocab_parallel_sampling_logprobs(
        x, t, top_k=5, top_p=0.9, min_p=0.01).logprobs.clamp(min=-30).sum(),
    "topk": lambda x, h, w, t, i: mv.vocab_parallel_topk(x, 3).logprobs.sum(),
    "linear_stats": lambda x, h, w, t, i: mv.linear_vocab_parallel_stats(h, w, t).logprobs.sum(),
    "linear_forward_grad": lambda x, h, w, t, i: mv.linear_vocab_parallel_cross_entropy(
        h, w, t, loss_weights=torch.ones(t.shape)).sum(),
    "linear_topk_logprobs": lambda x, h, w, t, i: mv.linear_vocab_parallel_topk_logprobs(
        h, w, i).sum(),
    "linear_sampling": lambda x, h, w, t, i: mv.linear_vocab_parallel_sampling_logprobs(
        h, w, t, top_k=5).logprobs.clamp(min=-30).sum(),
    "linear_topk": lambda x, h, w, t, i: mv.linear_vocab_parallel_topk(h, w, 3).logprobs.sum(),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    x, h, w = torch.randn(T, V, generator=g), torch.randn(T, H, generator=g), torch.randn(
        V, H, generator=g)
    t = torch.randint(0, V, (T,), generator=g)
    t[0] = x[0].argmax()
    return x, h, w, t, torch.randint(0, V, (T, 3), generator=g)


def _with_grads(op):
    """``op``'s value and its gradients w.r.t. the logits, hidden states and weight."""
    def run(x, h, w, t, i):
        leaves = [a.detach().requires_grad_() for a in (x, h, w)]
        out = OPS[op](*leaves, t, i)
        if not out.requires_grad:  # the teacher's top-k: no gradient
            return (out,)
        grads = torch.autograd.grad(out, leaves, allow_unused=True)
        return (out, *(torch.zeros(()) if g is None else g for g in grads))
    return run


@pytest.mark.parametrize("op", sorted(OPS))
def test_make_fx_symbolic_traces_with_the_defaults(op):
    cached = WORKSPACE.cached()
    inputs = _inputs()
    graph = make_fx(_with_grads(op), tracing_mode="symbolic")(*inputs)
    assert WORKSPACE.cached() == cached, "the trace left its tensors in the workspace cache"
    eager = _with_grads(op)(*inputs)
    traced = graph(*inputs)
    assert len(traced) == len(eager)
    for a, b in zip(traced, eager):
        assert torch.equal(a, b), (op, a, b)


@pytest.mark.parametrize("op", sorted(OPS))
def test_traced_graph_replays_with_grad_requiring_inputs(op):
    """(As torchtitan's ``test_symbolic_seq_len_traces_chunking``): the loss traced with
    ``make_fx(tracing_mode="symbolic")`` from inputs that require grad, then the traced graph
    called on fresh inputs that require grad gives the eager value. Before: ``RuntimeError: a
    leaf Variable that requires grad is being used in an in-place operation`` at ``clamp_`` of
    a workspace view (the Function's forward, no-grad in eager, replayed with grad on)."""
    def loss(x, h, w, t, i):
        return OPS[op](x, h, w, t, i)

    def fresh(seed):
        g = torch.Generator().manual_seed(seed)
        x, h, w, t, i = _inputs()
        x, h, w = (torch.randn(a.shape, generator=g).requires_grad_() for a in (x, h, w))
        return x, h, w, t, i

    graph = make_fx(loss, tracing_mode="symbolic")(*fresh(1))
    inputs = fresh(2)
    with torch.no_grad():
        eager = loss(*inputs)
    assert torch.equal(graph(*inputs).detach(), eager), op


# torch 2.11's dynamo asserts (higher_order_ops: "subgraph_vt.is_tensor()") on an
# autograd.Function whose forward returns None (the entropy that was not asked for): it raises,
# it never computes a wrong number. Strict: a torch 2.11 that passes must drop the mark.
@pytest.mark.xfail(Version(torch.__version__).release < (2, 12), strict=True,
                   raises=AssertionError,
                   reason="torch 2.11's dynamo cannot capture an autograd.Function with a None "
                          "output (docs/checks.md)")
def test_torch_compile_dynamic_with_the_defaults():
    """torch.compile(dynamic=True) of the core op at two token counts (the second reuses the
    dynamic graph). Backend "eager" (dynamo's capture with dynamic shapes, which is what failed;
    "aot_eager" passes too, at 4x the time: the op, the sampler and the fused head were checked
    with it by hand)."""
    torch._dynamo.reset()
    compiled = torch.compile(_with_grads("cross_entropy"), backend="eager", dynamic=True)
    for rows in (T, T - 2):
        x, h, w, t, i = _inputs()
        inputs = (x[:rows], h[:rows], w, t[:rows], i[:rows])
        for a, b in zip(compiled(*inputs), _with_grads("cross_entropy")(*inputs)):
            assert torch.equal(a, b)
