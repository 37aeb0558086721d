"""The Triton backend of the unfused op (``ops.kernels``): its selection (``kernel=`` and
``VOCABSTATS_KERNEL``), that the package imports without triton, and the kernels themselves
under Triton's CPU interpreter: ``_triton_interp.py`` (one subprocess, ``TRITON_INTERPRET=1``
set before triton decorates the kernels, so the interpreter cannot leak into this process) and
``dist/triton_cases.py`` (tp 2 on gloo). The fused head's kernels under the interpreter:
``test_triton_fused_kernels.py``; the sm_90 compile: ``test_triton_compile.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _ranks import launch
from conftest import HERE, check_case
from dist.triton_cases import CASES
from megatron_vocabstats import vocab_parallel_entropy, vocab_parallel_stats
from megatron_vocabstats.ops import kernels
from megatron_vocabstats.ops.kernels import KERNEL_ENV, resolve_kernel, triton_available

ROOT = os.path.dirname(os.path.dirname(HERE))
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@pytest.fixture(autouse=True)
def _no_forcing(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **env})


def test_resolution():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernel("auto", cpu) == "torch"
    assert resolve_kernel("torch", cuda) == "torch"
    # Off until the kernels pass the GPU parity step (kernels.AUTO_TRITON_ON_CUDA).
    assert resolve_kernel("auto", cuda) == (
        "triton" if kernels.AUTO_TRITON_ON_CUDA and triton_available() else "torch")
    if triton_available():  # every batch-invariant mode runs on the kernels too
        assert resolve_kernel("triton", cuda) == "triton"


@pytest.mark.parametrize("bad", ["Triton", "cuda", None, 1])
def test_bad_kernel_names_the_argument(bad):
    with pytest.raises(ValueError, match="kernel must be one of"):
        vocab_parallel_stats(torch.randn(2, 5), None, kernel=bad)


@needs_triton
def test_triton_on_cpu_without_interpreter():
    with pytest.raises(ValueError, match=r"kernel='triton' needs the op.s tensors \(the logits, or hidden and weight\) on a CUDA device"):
        vocab_parallel_entropy(torch.randn(2, 5), kernel="triton")


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=f"{KERNEL_ENV} must be one of"):
        vocab_parallel_stats(torch.randn(2, 5), None)
    monkeypatch.setenv(KERNEL_ENV, "torch")
    x = torch.randn(3, 9)
    assert torch.equal(vocab_parallel_stats(x, None).entropy,
                       vocab_parallel_stats(x, None, kernel="torch").entropy)
    if triton_available():
        monkeypatch.setenv(KERNEL_ENV, "triton")
        with pytest.raises(ValueError, match=f"{KERNEL_ENV}=triton needs the op.s tensors"):
            vocab_parallel_stats(x, None)
        # An explicit kernel wins over the variable.
        vocab_parallel_stats(x, None, kernel="torch")


def _triton_call_error(setup: str) -> subprocess.CompletedProcess:
    """A fresh process: ``setup``, then ``kernel='triton'`` on CPU logits, printing the
    ``ValueError``'s message."""
    return _run(setup + "\n"
                "import torch, megatron_vocabstats as m\n"
                "print(m.vocab_parallel_stats(torch.randn(2, 5), None).entropy.shape)\n"
                "try:\n"
                "    m.vocab_parallel_stats(torch.randn(2, 5), None, kernel='triton')\n"
                "except ValueError as e:\n"
                "    print(e)\n", PYTHONPATH=ROOT)


def test_package_imports_without_triton():
    """With triton unimportable the package imports and runs, and kernel='triton' says why."""
    proc = _triton_call_error("import sys; sys.modules['triton'] = None")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "torch.Size([2])" in proc.stdout
    assert "kernel='triton' needs the triton package" in proc.stdout, proc.stdout


@needs_triton
def test_interpreter_set_after_triton_is_named():
    """``TRITON_INTERPRET=1`` set after ``import triton`` cannot take effect: the error says so."""
    proc = _triton_call_error("import os, triton\nos.environ['TRITON_INTERPRET'] = '1'")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TRITON_INTERPRET=1 was set after triton was imported" in proc.stdout, proc.stdout


def test_import_does_not_import_triton():
    proc = _run("import sys, megatron_vocabstats\nprint('triton' in sys.modules)",
                PYTHONPATH=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("False"), proc.stderr[-4000:]


def run_interpreted(script: str) -> None:
    """Run the pytest file ``script`` (in tests/unit) in its own process with
    ``TRITON_INTERPRET=1`` set before triton decorates the kernels."""
    rc, out = launch(["-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, script)],
                     1, cwd=ROOT, env={"TRITON_INTERPRET": "1"}, timeout=540)
    assert rc == 0, out[-16000:]
    assert " passed" in out and "failed" not in out, out[-4000:]


@needs_triton
def test_kernels_under_the_interpreter():
    """``_triton_interp.py``: the unfused kernels under the interpreter (the fused LM head's:
    ``test_triton_fused_kernels.py``)."""
    run_interpreted("_triton_interp.py")


@needs_triton
@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_under_the_interpreter(name):
    check_case("triton_cases.py", 2, name, env={"TRITON_INTERPRET": "1"})
