"""The static GPU model's pieces (``benchmarks/gpu_*.py``, ``docs/gpu-model.md``) on tiny inputs:
the LRU simulation of the L2, occupancy, loop trip counts read from SASS, and the capture of a
launch from the real op with the specialisation a GPU launch gets (no compilation here; the
compiled variants are ``test_triton_compile.py::test_kernels_compile_for_sm90``'s)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import HERE
from megatron_vocabstats.ops.kernels import triton_available

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
import gpu_cost  # noqa: E402
import gpu_sass  # noqa: E402


def test_l2_lru_counts_each_tile_once_while_it_fits():
    tile = [(("w", 0), 10.0)]
    # Two CTAs read the same tile four times each: one miss while it stays cached.
    assert gpu_cost.l2_misses([[tile] * 4, [tile] * 4], resident=2, capacity=100) == 10
    # A cyclic working set of three 10-byte tiles in a 25-byte LRU misses every time.
    steps = [[(("h", i % 3), 10.0)] for i in range(9)]
    assert gpu_cost.l2_misses([steps], resident=1, capacity=25) == 90
    # The second CTA starts when the first finishes (one slot): its tiles are new.
    assert gpu_cost.l2_misses([[[(("a", 0), 4.0)]], [[(("b", 0), 4.0)]]], 1, 100) == 8


@pytest.mark.parametrize("regs, shared, warps, occ", [
    (32, 0, 4, 16),       # threads: 2048 / 128
    (200, 0, 8, 1),       # registers: 256 threads x 200 (rounded to 256/warp units)
    (128, 73728, 4, 3),   # shared memory: 228 KiB / (72 + 1) KiB
    (16, 0, 1, 32),       # CTAs per SM
])
def test_occupancy(regs, shared, warps, occ):
    assert gpu_cost.occupancy(regs, shared, warps) == occ


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R2, R3, R4 ;
        /*0020*/                   MUFU.EX2 R5, R5 ;
        /*0030*/                   LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16].tnspB, R24 ;
        /*0050*/              @!P0 BRA 0x40 ;
        /*0060*/                   ISETP.GE.AND P0, PT, R0, 0x1, PT ;
        /*0070*/              @!P1 BRA 0x10 ;
        /*0080*/                   EXIT ;
        /*0090*/                   BRA 0x90 ;
"""


def test_dynamic_counts_apply_trip_counts_per_loop_depth():
    instrs = gpu_sass._parse(SASS)
    sass = gpu_sass.Sass(instrs, regs=40, local_bytes=0, loops=gpu_sass._loops(instrs))
    assert [(s, e, d) for s, e, d in sass.loops] == [(0x10, 0x70, 1), (0x40, 0x50, 2)]
    c = gpu_sass.dynamic_counts(sass, [3, 5], num_warps=8)
    # outer body: FFMA MUFU LDG ISETP BRA (5 x 3); inner: HGMMA BRA (2 x 15); MOV, EXIT, BRA.
    assert c.issue == 5 * 3 + 2 * 15 + 3
    assert c.pipes == {"fma": 3, "alu": 3, "xu": 3}
    assert c.mio == 3 * 4  # a 16-byte load: 4 cycles of the SM's 128 bytes per clock
    assert c.mma_flops == 15 * 2 * 64 * 128 * 16 * 2  # two warpgroups issue it
    assert c.global_load_trips == 3
    with pytest.raises(ValueError, match="depth 2"):
        gpu_sass.dynamic_counts(sass, [3], num_warps=8)


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_capture_specialises_as_a_launch():
    """The fused head's launch passes a contiguous weight's stride_wk = 1, which Triton makes
    constexpr (a runtime stride would compile scalar loads), and a row length that is a multiple
    of 16 is marked divisible."""
    import gpu_capture

    import megatron_vocabstats as m

    with gpu_capture.capturing() as cap:
        h = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(256, 64, dtype=torch.bfloat16, device="cuda")
        m.linear_vocab_parallel_stats(h, w, torch.zeros(8, dtype=torch.long, device="cuda"),
                                      kernel="triton", validate=False)
    (launch,) = cap.triton()
    assert launch.phase == "forward" and launch.arg("FUSED")
    signature, constexprs, attrs, _ = gpu_capture.specialisation(launch)
    names = launch.kernel.arg_names
    assert signature["stride_wk"] == "constexpr"
    assert constexprs[(names.index("stride_wk"),)] == 1
    assert [["tt.divisibility", 16]] == attrs[(names.index("n_cols"),)]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_captured_forward_gradient_mode_has_three_gemms_per_chunk():
    """What a GPU run of the forward-gradient mode with the Triton kernels launches:
    chunks of TILE_CHUNK_ROWS within TILE_CHUNK_BYTES (2,176 rows at V = 151,936 in bf16), each
    a statistics launch over (row tile, column split) programs that stores the logits, the
    unfused gradient kernel on them, and two cuBLAS GEMMs (dX, dW; the first dW written with
    beta = 0): no recomputing gradient kernel, no zero fill of the dW sums. The workspace cache
    is left as it was."""
    import gpu_capture

    import megatron_vocabstats as m
    from megatron_vocabstats.ops.kernels import LINEAR_BLOCKS

    from megatron_vocabstats.ops.workspace import WORKSPACE

    tokens, width, hidden = 4096, 151936, 64
    cached = WORKSPACE.cached()
    with gpu_capture.capturing() as cap:
        h = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        w = torch.empty(width, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        mask = torch.ones(tokens, device="cuda")
        m.linear_vocab_parallel_stats(h, w, torch.zeros(tokens, dtype=torch.long, device="cuda"),
                                      entropy="off", grad_weights=mask, kernel="triton",
                                      validate=False)
    names = [e.name for e in cap.triton()]
    assert names == ["_tile_stats_kernel", "_row_grad_kernel"] * 2, names
    stats = cap.triton()[0]
    splits = -(-width // LINEAR_BLOCKS["SPLIT_N"])
    assert stats.arg("STORE") and stats.grid == (17 * splits,)  # 2,176 rows: 17 tiles of 128
    assert [e.grid for e in cap.triton()[1::2]] == [(2176,), (tokens - 2176,)]
    gemms = [e for e in cap.events if getattr(e, "name", "") in ("mm", "addmm")]
    assert [(e.name, e.kwargs.get("beta", 1)) for e in gemms] == [
        ("mm", 1), ("addmm", 0.0), ("mm", 1), ("addmm", 1.0)], gemms
    assert not [e for e in cap.events if e.name == "zeros" and e.outputs[0].shape == (width,
                                                                                      hidden)]
    # The capture's fake CUDA buffers never stay in the process's workspace cache.
    assert WORKSPACE.cached() == cached
