"""The chunk-buffer cache (``ops/workspace.py``) on CPU.

Reuse across calls (same storage), no reuse while held, the capture rule (through a patched
``torch.cuda.is_current_stream_capturing``), reset, the bounds, and results that do not change.
The stream rules need CUDA: ``tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vocabstats import linear_vocab_parallel_stats, vocab_parallel_stats
from megatron_vocabstats.ops import workspace
from megatron_vocabstats.ops.workspace import Workspace


def _ptr(lease):
    return lease.tensor.untyped_storage().data_ptr()


def test_a_returned_buffer_is_reused_and_a_held_one_is_not():
    ws = Workspace()
    a = ws.take((4, 8), torch.float32, "cpu")
    b = ws.take((4, 8), torch.float32, "cpu")
    assert _ptr(a) != _ptr(b)  # both held: two buffers
    first = _ptr(a)
    ws.give(a)
    c = ws.take((4, 8), torch.float32, "cpu")
    assert _ptr(c) == first and c.tensor.shape == (4, 8)
    d = ws.take((4, 8), torch.float32, "cpu")  # c is held: d must be another buffer
    assert _ptr(d) not in (_ptr(c), _ptr(b))
    ws.give(b, c, d, None)
    assert ws.cached() == (3, 3 * 32 * 4)


def test_size_classes_and_dtypes():
    ws = Workspace()
    a = ws.take((100, 10), torch.float32, "cpu")
    ptr = _ptr(a)
    ws.give(a)
    near = ws.take((99, 10), torch.float32, "cpu")  # same size class: reused, viewed as asked
    assert _ptr(near) == ptr and near.tensor.shape == (99, 10)
    ws.give(near)
    other = ws.take((100, 10), torch.bfloat16, "cpu")
    far = ws.take((400, 10), torch.float32, "cpu")
    assert ptr not in (_ptr(other), _ptr(far))


def test_capture_neither_takes_from_nor_returns_to_the_cache(monkeypatch):
    ws = Workspace()
    eager = ws.take((4, 8), torch.float32, "cpu")
    eager_ptr = _ptr(eager)
    ws.give(eager)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = ws.take((4, 8), torch.float32, "cpu")
    assert _ptr(captured) != eager_ptr  # fresh, from the graph's pool on a GPU
    assert ws.cached()[0] == 1  # the eager buffer stayed in the cache
    ws.give(captured)
    assert ws.cached()[0] == 1  # not added
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws.give(captured)  # a lease taken during capture is never cached, even later
    assert ws.cached()[0] == 1
    again = ws.take((4, 8), torch.float32, "cpu")
    assert _ptr(again) == eager_ptr


def test_reset_and_bounds():
    ws = Workspace(max_buffers=2, max_bytes=10**6)
    leases = [ws.take((8, 16), torch.float32, "cpu") for _ in range(3)]
    ptrs = [_ptr(x) for x in leases]
    ws.give(*leases)
    assert ws.cached() == (2, 1024)  # the least recently returned one was dropped
    kept = {_ptr(ws.take((8, 16), torch.float32, "cpu")) for _ in range(2)}
    assert kept == set(ptrs[1:])
    ws.configure(max_bytes=100)
    big = ws.take((8, 16), torch.float32, "cpu")
    ws.give(big)
    assert ws.cached() == (0, 0)  # larger than max_bytes: never kept
    ws.configure(max_bytes=10**6)
    ws.give(ws.take((8, 16), torch.float32, "cpu"))
    assert ws.cached()[0] == 1
    ws.reset()
    assert ws.cached() == (0, 0)
    with pytest.raises(ValueError, match="max_buffers"):
        ws.configure(max_buffers=-1)


def test_with_workspace_reset_runs_both():
    calls = []
    workspace.WORKSPACE.give(workspace.WORKSPACE.take((3,), torch.float32, "cpu"))
    wrapped = workspace.with_workspace_reset(lambda stage=None: calls.append(stage) or "done")
    assert wrapped("training") == "done" and calls == ["training"]
    assert workspace.WORKSPACE.cached() == (0, 0)


def _storages(monkeypatch):
    """Record the storage of every buffer the ops take from the global workspace."""
    seen = []
    take = workspace.WORKSPACE.take

    def recording(*args, **kwargs):
        lease = take(*args, **kwargs)
        seen.append(_ptr(lease))
        return lease

    monkeypatch.setattr(workspace.WORKSPACE, "take", recording)
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["core", "fused"])
def test_ops_reuse_buffers_across_calls_with_unchanged_results(monkeypatch, fused):
    torch.manual_seed(0)
    workspace.reset_workspace()
    logits = torch.randn(7, 50, requires_grad=True)
    hidden = torch.randn(7, 12, requires_grad=True)
    weight = torch.randn(50, 12, requires_grad=True)
    target = torch.randint(0, 50, (7,))

    def run():
        if fused:
            st = linear_vocab_parallel_stats(hidden, weight, target, chunk_size=3)
        else:
            st = vocab_parallel_stats(logits, target, chunk_size=3)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        return st, (hidden.grad if fused else logits.grad).clone()

    seen = _storages(monkeypatch)
    first, grad1 = run()
    used_first = list(seen)
    assert workspace.WORKSPACE.cached()[0] >= 2  # kept alive, so equal pointers mean reuse
    seen.clear()
    (hidden if fused else logits).grad = None
    second, grad2 = run()
    assert used_first and set(seen) <= set(used_first)  # every buffer came back from the cache
    for a, b in zip(first[:3], second[:3]):
        assert torch.equal(a, b)
    assert torch.equal(grad1, grad2)
    workspace.configure_workspace(max_buffers=0)  # cache off: the same numbers
    try:
        (hidden if fused else logits).grad = None
        third, grad3 = run()
    finally:
        workspace.configure_workspace(max_buffers=workspace.DEFAULT_MAX_BUFFERS)
    assert all(torch.equal(a, b) for a, b in zip(first[:3], third[:3]))
    assert torch.equal(grad1, grad3)


def test_an_abandoned_chunk_loop_gives_its_buffers_back():
    from megatron_vocabstats.ops._checks import checked_config
    from megatron_vocabstats.ops.engine.chunks import logits_chunks as _chunks

    workspace.reset_workspace()
    logits = torch.randn(9, 20)
    cfg = checked_config(logits, None, None, vocab_size=None, chunk_size=4, entropy="off",
                         temperature=1.0, ignore_index=-100, label_smoothing=0.0, validate=False)
    chunks = _chunks(logits, None, None, cfg)
    next(chunks)
    assert workspace.WORKSPACE.cached() == (0, 0)  # held while the loop runs
    chunks.close()
    assert workspace.WORKSPACE.cached()[0] == 2


def test_free_buffers_lists_what_the_cache_holds():
    ws = Workspace()
    held = ws.take((4, 8), torch.float32, "cpu")
    assert ws.free_buffers() == []
    ws.give(held, ws.take((2, 8), torch.float32, "cpu"))
    listed = ws.free_buffers()
    assert len(listed) == 2 and sum(t.numel() * t.element_size() for t in listed) == ws.cached()[1]
