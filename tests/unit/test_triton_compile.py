"""The Triton kernels as the GPU compiles them, without a GPU: every launched variant compiles for
sm_90 without spills, with the expected loads and wgmma (``_triton_compile.py``, in a subprocess
with its own Triton cache), and every launch sets its FP fusion itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import HERE
from test_triton_kernels import ROOT, _no_forcing, _run, needs_triton  # noqa: F401 (fixture)


@needs_triton
def test_kernels_compile_for_sm90(tmp_path):
    """Every variant the ops launch compiles for sm_90 without spills, with the expected loads
    and wgmma (``_triton_compile.py``, which captures the launches from the ops)."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_triton_compile.py")],
                          capture_output=True, text=True, cwd=ROOT, timeout=540,
                          env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore",
                               "TRITON_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert re.search(r"compiled [1-9]\d* launched variants for sm_90", proc.stdout), proc.stdout


_FP_FUSION = """
import sys, torch
sys.path.insert(0, 'benchmarks')
import gpu_capture, megatron_vocabstats as m
with gpu_capture.capturing() as cap:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(4, 40, dtype=dtype, device='cuda')
        m.vocab_parallel_stats(x, None, kernel='triton', validate=False)
        h = torch.empty(4, 16, dtype=dtype, device='cuda')
        m.linear_vocab_parallel_stats(h, torch.empty(40, 16, dtype=dtype, device='cuda'), None,
                                      kernel='triton', validate=False)
print(sorted({(l.name, gpu_capture.specialisation(l)[3].enable_fp_fusion) for l in cap.triton()}))
"""


@needs_triton
def test_fp_fusion_is_explicit():
    """Every launch sets ``enable_fp_fusion`` itself, so the compiled kernels are the
    same whatever ``TRITON_DEFAULT_FP_FUSION`` says (Triton 3.10 turns its default off)."""
    seen = {}
    for value in ("0", "1"):
        proc = _run(_FP_FUSION, PYTHONPATH=ROOT, TRITON_DEFAULT_FP_FUSION=value)
        assert proc.returncode == 0, proc.stderr[-4000:]
        seen[value] = proc.stdout.strip().splitlines()[-1]
    assert seen["0"] == seen["1"] and "False" not in seen["0"], seen
