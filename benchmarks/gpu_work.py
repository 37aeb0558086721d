"""What each modelled Triton kernel does per launch, from the launch's own arguments: the trip
count of each loop depth of its SASS, its DRAM bytes (tile re-reads through an LRU simulation of
the L2 in launch order, :func:`gpu_cost.l2_misses`) and each CTA's bytes from L2. One function
per kernel (ours and Liger's); a kernel without one is an error, so a new kernel cannot go
unmodelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import gpu_cost
from gpu_capture import TensorSpec

NUM_STATS = 5


@dataclass
class Work:
    trips: list
    hbm_bytes: float
    l2_bytes_per_cta: float


def work_signature(launch) -> dict:
    """The arguments that decide a launch's work (grouping key of identical launches)."""
    out = {}
    for name in launch.kernel.arg_names:
        try:
            v = launch.arg(name)
        except (KeyError, IndexError):
            continue
        out[name] = (v.shape, v.dtype) if isinstance(v, TensorSpec) else v
    return out


def _cdiv(a, b):
    return -(-a // b)


def _grouped(pid, rows, cols, group):
    """``(row tile, column tile)`` of program ``pid`` in the kernels' grouped launch order."""
    from megatron_vocabstats.ops.kernels import triton_stats as ts

    order = getattr(ts, "tile_order", None)
    if order is None:
        return pid % rows, pid // rows
    return order.fn(pid, rows, cols, group)


def _stats(launch, occ) -> Work:
    a = launch.arg
    x = a("x_ptr")
    n, width, hidden = a("n_rows"), a("n_cols"), a("hidden")
    rows, block_n = a("ROWS"), a("BLOCK_N")
    out = NUM_STATS * n * 4 * (_cdiv(width, block_n) if a("BLOCKS") else 1)
    targets = n * 9 if a("HAS_TARGET") else 0
    if not a("FUSED"):
        row = width * x.itemsize
        return Work([_cdiv(width, block_n)], n * row + out + targets, row)
    tiles = _cdiv(width, block_n)
    block_k = a("BLOCK_K")
    h_tile, w_tile = rows * hidden * x.itemsize, block_n * hidden * x.itemsize
    ctas = launch.ctas()

    def steps(pid):
        return [[(("h", pid), h_tile), (("w", j), w_tile)] for j in range(tiles)]

    hbm = gpu_cost.l2_misses((steps(p) for p in range(ctas)), gpu_cost.SMS * occ)
    return Work([tiles, _cdiv(hidden, block_k)], hbm + out + targets,
                tiles * (h_tile + w_tile))


def _grad(launch, occ) -> Work:
    a = launch.arg
    x, o = a("x_ptr"), a("out_ptr")
    n, width, hidden = a("n_rows"), a("n_cols"), a("hidden")
    rows, block_n = a("ROWS"), a("BLOCK_N")
    written = n * width * o.itemsize
    per_row = 4 * (2 + a("HAS_H") * 2) + 9 * a("HAS_TARGET") + a("HAS_VALID")
    if not a("FUSED"):
        tile = rows * block_n * (x.itemsize + o.itemsize)
        return Work([], n * width * x.itemsize + written + n * per_row, tile)
    gx, gy = launch.grid[0], launch.grid[1]
    h_tile, w_tile = rows * hidden * x.itemsize, block_n * hidden * x.itemsize

    def steps(pid):
        r, c = pid % gx, pid // gx
        return [[(("h", r), h_tile), (("w", c), w_tile)]]

    hbm = gpu_cost.l2_misses((steps(p) for p in range(gx * gy)), gpu_cost.SMS * occ)
    return Work([_cdiv(hidden, a("BLOCK_K"))], hbm + written + n * per_row,
                h_tile + w_tile + rows * block_n * o.itemsize)


def _liger_ce(launch, occ) -> Work:
    """Liger's cross-entropy kernel: one row per program, two passes over the row (online max
    and sum, then the gradient written in place), so the row is read twice and written once; the
    second read hits the L2 only if the resident rows fit."""
    a = launch.arg
    x = a("X_ptr")
    n, width = launch.grid[0], a("n_cols")
    row = width * x.itemsize
    resident = min(n, gpu_cost.SMS * occ) * row
    reads = 1 if resident <= gpu_cost.L2_USABLE else 2
    return Work([_cdiv(width, a("BLOCK_SIZE"))], n * row * (reads + 1) + n * 16, 3 * row)


WORK = {"_stats_kernel": _stats, "_grad_kernel": _grad,
        "liger_cross_entropy_kernel": _liger_ce}


def work_of(launch, occ: int) -> Work:
    """The :class:`Work` of ``launch`` with ``occ`` CTAs resident per SM."""
    if launch.name not in WORK:
        raise KeyError(f"no work model for Triton kernel {launch.name!r} (benchmarks/gpu_work.py)")
    return WORK[launch.name](launch, occ)

