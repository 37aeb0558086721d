"""The collectives' choice of device and fallback by the backend that runs them
(``ops._comm``): a per-device backend string (torch's multi-device form, also the opt-in
TorchComms backend of torch 2.15: ``"cpu:gloo,cuda:nccl"``) is read per device type, never as
"contains gloo". ``dist.get_backend`` is faked: no process group is needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_vocabstats.ops import _comm

MIXED = "cpu:gloo,cuda:nccl"


@pytest.fixture
def backend(monkeypatch):
    def use(name: str, cuda: bool = True):
        monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return use


@pytest.mark.parametrize("name, device_type, want", [
    ("gloo", "cpu", "gloo"), ("gloo", "cuda", "gloo"), ("nccl", "cuda", "nccl"),
    (MIXED, "cpu", "gloo"), (MIXED, "cuda", "nccl"), ("CPU:GLOO, CUDA:NCCL", "cuda", "nccl"),
    ("cuda:nccl", "cpu", ""),
])
def test_backend_for_each_device_type(backend, name, device_type, want):
    backend(name)
    assert _comm.backend_for(object(), device_type) == want


@pytest.mark.parametrize("name, cuda, want", [
    ("gloo", True, "cpu"), ("nccl", True, "cuda"), ("nccl", False, "cpu"),
    (MIXED, True, "cuda"), (MIXED, False, "cpu"), ("cpu:gloo", True, "cpu"),
])
def test_exchange_device(backend, name, cuda, want):
    """The mixed string runs its CUDA collectives on NCCL: the exchange goes to the GPU, as for
    an NCCL group (a substring test took it for gloo and put it on the CPU)."""
    backend(name, cuda)
    assert _comm.exchange_device(object()).type == want


@pytest.mark.parametrize("name, falls_back", [("gloo", True), (MIXED, True), ("nccl", False)])
def test_reduce_scatter_fallback_by_the_tensors_backend(backend, monkeypatch, name, falls_back):
    """CPU tensors on the mixed string run on gloo: a missing reduce-scatter falls back to the
    all-reduce (the sums of two ranks holding the same rows, this rank's half kept)."""
    backend(name)

    def no_reduce_scatter(out, full, group=None):
        raise RuntimeError("reduce_scatter is not supported")

    for attr in ("reduce_scatter_single", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, attr, no_reduce_scatter, raising=False)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: t.mul_(2))
    full = torch.arange(8.0).view(4, 2)
    if not falls_back:
        with pytest.raises(RuntimeError, match="not supported"):
            _comm.reduce_scatter_sequence(full.clone(), object())
        return
    assert torch.equal(_comm.reduce_scatter_sequence(full.clone(), object()), 2 * full[2:])
