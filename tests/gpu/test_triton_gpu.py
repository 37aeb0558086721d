"""The Triton kernels of the unfused op on a GPU (skipped without CUDA or triton):
float64 parity of every CPU interpreter case (``tests/unit/_triton_parity.py``, the same bounds,
now with libdevice's exp), one row of Qwen's vocabulary (149 blocks of columns), that
``kernel="auto"`` picks the kernels on CUDA, and a CUDA graph of forward + backward that replays
the eager bits.

Run: ``python -m pytest tests/gpu/test_triton_gpu.py -q`` (also the ``single`` step of
``bash tests/gpu/run.sh``).
"""

from __future__ import annotations

import pytest
import torch
from test_single_gpu import _capture

import _triton_parity
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops.kernels import KERNEL_ENV, resolve_kernel, triton_available

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                                reason="needs a CUDA device and triton")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", _triton_parity.DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", ["grad", "metric"])
@pytest.mark.parametrize("name", sorted(_triton_parity.CASES))
def test_parity_with_float64(name, mode, dtype):
    _triton_parity.check_op_parity(name, mode, dtype, CUDA)


def test_qwen_row_parity(monkeypatch):
    monkeypatch.setitem(_triton_parity.CASES, "qwen",
                        (4, 151_936, 151_665, 1.0, 0.1, 3.0, ("ignore",)))
    _triton_parity.check_op_parity("qwen", "grad", torch.bfloat16, CUDA)


def test_auto_is_triton_on_cuda(monkeypatch):
    # What "auto" will do once this suite has passed (ops.kernels.AUTO_TRITON_ON_CUDA).
    from megatron_vocabstats.ops import kernels

    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.setattr(kernels, "AUTO_TRITON_ON_CUDA", True)
    assert resolve_kernel("auto", CUDA) == "triton"


def test_cuda_graph_replays_the_eager_bits():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(96, 1100, generator=gen) * 3).bfloat16().to(CUDA)
    target = torch.randint(0, 1000, (96,), generator=gen).to(CUDA)
    target[5] = -100
    leaf = logits.clone().requires_grad_()

    def step():
        leaf.grad = None
        st = vocab_parallel_stats(leaf, target, vocab_size=1000, label_smoothing=0.1,
                                  temperature=0.9, validate=False, kernel="triton")
        (st.logprobs.sum() + st.entropy.sum()).backward()
        return st.logprobs, st.entropy, st.logsumexp, leaf.grad

    eager = [t.clone() for t in step()]
    graph, outputs = _capture(step)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, eager):
            assert torch.equal(got, want)
