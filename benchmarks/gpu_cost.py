"""The static time model of one kernel launch on an H200 (constants and reasons in
``docs/gpu-model.md``): occupancy, waves, and the estimated time as the largest of

* ``tensor``: the busiest SM's tensor-core FLOPs (from the SASS ``HGMMA``s times their trip
  counts) at its share of the peak; with one CTA per SM and no warp specialisation the CTA's
  own epilogue (issue slots outside its innermost loop) is added, as nothing overlaps it;
* ``issue``: the busiest SMSP's cycles, the largest of its issue slots and of its pipes'
  occupancy (``gpu_sass.COST``); ``mio``: the SM's load/store/shuffle path;
* ``hbm``: the launch's DRAM bytes at the HBM bandwidth (reads that miss the L2 in an LRU
  simulation of the launch order where tiles are re-read, see :func:`l2_misses`);
* ``l2``: the busiest SM's bytes from L2 at its share of the L2 bandwidth;
* ``latency``: rounds of CTAs per SM times the synchronous global-load round trips of a CTA;

plus a fixed launch cost. cuBLAS GEMMs (no SASS to read) are modelled at a stated fraction of
the tensor peak (:func:`cublas`), and torch's elementwise kernels at the HBM bandwidth
(:func:`torch_kernel`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

# H200 SXM (NVIDIA data sheet): 132 SMs, 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16, 50 MB L2.
SMS = 132
HBM_BPS = 4.8e12
MMA_FLOPS = 989e12
L2_BYTES = 50 * 2**20
# Assumptions (docs/gpu-model.md): the clock the tensor peak implies (989e12 / (132 SMs x 4096
# dense bf16 FLOP/clk)), L2->SM read bandwidth, usable L2 for reuse, DRAM latency under load,
# launch overhead, cuBLAS's sustained fraction of the tensor peak (8192^3 bf16 through PyTorch
# on an H200: ~790 TFLOP/s).
CLOCK_HZ = MMA_FLOPS / (SMS * 4096)
L2_BPS = 10e12
L2_USABLE = 0.8 * L2_BYTES
HBM_LATENCY_S = 0.8e-6
LAUNCH_S = 2e-6
CUBLAS_EFFICIENCY = 0.8
# Per SM: threads, CTAs, registers, shared memory (bytes; 1 KiB reserved per CTA).
MAX_THREADS, MAX_CTAS, REGS, SMEM, SMEM_RESERVED = 2048, 32, 65536, 233472, 1024


@dataclass
class Estimate:
    """The modelled time of one launch and its parts (seconds), and what drove it."""

    time: float
    bounds: dict
    floor: float  # roofline: max(FLOPs / peak, HBM bytes / bandwidth)
    flops: float
    hbm_bytes: float

    @property
    def bound(self) -> str:
        return max(self.bounds, key=self.bounds.get)


def occupancy(regs: int, shared: int, num_warps: int) -> int:
    """Resident CTAs per SM (sm_90 limits; registers allocated per warp in units of 256)."""
    threads = 32 * num_warps
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = REGS // (per_warp * num_warps)
    by_smem = SMEM // (shared + SMEM_RESERVED)
    return max(0, min(MAX_CTAS, MAX_THREADS // threads, by_regs, by_smem))


def roofline(flops: float, hbm_bytes: float) -> float:
    return max(flops / MMA_FLOPS, hbm_bytes / HBM_BPS)


def triton_kernel(counts, *, ctas: int, num_warps: int, occ: int, hbm_bytes: float,
                  l2_bytes_per_cta: float, mma_efficiency: float = 1.0) -> Estimate:
    """The estimate of a launch of ``ctas`` CTAs whose per-warp dynamic counts are ``counts``
    (:func:`gpu_sass.dynamic_counts`), ``occ`` resident per SM."""
    per_sm = math.ceil(ctas / SMS)
    rounds = math.ceil(per_sm / max(occ, 1))
    warps_per_smsp = max(per_sm * num_warps / 4, 1.0)
    smsp = max([counts.issue] + [n * c for n, c in zip(
        counts.pipes.values(), _costs(), strict=True)])
    tensor = per_sm * counts.mma_flops / (mma_efficiency * MMA_FLOPS / SMS)
    if min(occ, per_sm) == 1 and counts.mma_flops:
        tensor += per_sm * max(num_warps / 4, 1.0) * counts.outer_issue / CLOCK_HZ
    bounds = {
        "tensor": tensor,
        "issue": warps_per_smsp * smsp / CLOCK_HZ,
        "mio": per_sm * num_warps * counts.mio / CLOCK_HZ,
        "hbm": hbm_bytes / HBM_BPS,
        "l2": per_sm * l2_bytes_per_cta / (L2_BPS / SMS),
        "latency": rounds * counts.global_load_trips * HBM_LATENCY_S,
    }
    flops = ctas * counts.mma_flops
    return Estimate(max(bounds.values()) + LAUNCH_S, bounds, roofline(flops, hbm_bytes), flops,
                    hbm_bytes)


def _costs():
    from gpu_sass import COST

    return COST.values()


def cublas(m: int, n: int, k: int, in_bytes: float, out_bytes: float) -> Estimate:
    """A cuBLAS GEMM ``[m, k] x [k, n]``: its FLOPs at :data:`CUBLAS_EFFICIENCY` of the peak, or
    its operands and output once through HBM, whichever is longer."""
    flops = 2.0 * m * n * k
    hbm = in_bytes + out_bytes
    bounds = {"tensor": flops / (CUBLAS_EFFICIENCY * MMA_FLOPS), "hbm": hbm / HBM_BPS}
    return Estimate(max(bounds.values()) + LAUNCH_S, bounds, roofline(flops, hbm), flops, hbm)


def torch_kernel(hbm_bytes: float) -> Estimate:
    """A torch elementwise or reduction kernel: its bytes at the HBM bandwidth."""
    bounds = {"hbm": hbm_bytes / HBM_BPS}
    return Estimate(bounds["hbm"] + LAUNCH_S, bounds, roofline(0.0, hbm_bytes), 0.0, hbm_bytes)


def l2_misses(ctas, resident: int, capacity: float = L2_USABLE) -> float:
    """DRAM bytes of a launch whose CTAs (in launch order) each touch a sequence of steps, each
    step a list of ``(tile key, bytes)``: ``resident`` CTAs run at once in lockstep, a finished
    CTA's slot takes the next one, and the L2 keeps the most recently used ``capacity`` bytes
    (LRU). ``ctas``: an iterable of step lists."""
    cache: OrderedDict = OrderedDict()
    held = missed = 0.0
    pending = iter(ctas)
    slots = [iter(s) for s in (next(pending, None) for _ in range(resident)) if s is not None]
    while slots:
        nxt = []
        for steps in slots:
            step = next(steps, None)
            while step is None:
                new = next(pending, None)
                if new is None:
                    break
                steps = iter(new)
                step = next(steps, None)
            if step is None:
                continue
            nxt.append(steps)
            for key, size in step:
                if key in cache:
                    cache.move_to_end(key)
                    continue
                missed += size
                cache[key] = size
                held += size
                while held > capacity:
                    _, old = cache.popitem(last=False)
                    held -= old
        slots = nxt
    return missed
