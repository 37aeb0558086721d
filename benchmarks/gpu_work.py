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


def _stats_bytes(launch, n: int) -> int:
    """Bytes of a statistics launch's per-row inputs (target index and flag) and outputs."""
    a = launch.arg
    out = a("out_ptr")
    targets = n * 9 if a("HAS_TARGET") else 0
    return out.nbytes + targets


def _row_stats(launch, occ) -> Work:
    """One row per program, read once up to ``real_width`` in blocks of ``LANES x GROUP``."""
    a = launch.arg
    x = a("x_ptr")
    n, block = launch.grid[0], a("LANES") * a("GROUP")
    end = min(a("n_cols"), a("real_width"))
    row = end * x.itemsize
    return Work([end // block], n * row + _stats_bytes(launch, n), row)


def _row_grad(launch, occ) -> Work:
    """One row per program: its real columns in full blocks (the unmasked loop), the rest in
    masked blocks; the zero-filling loop of rows that are not valid counts no iteration (the
    scenarios' rows are all valid)."""
    a = launch.arg
    x, o = a("x_ptr"), a("out_ptr")
    n, width, block = launch.grid[0], a("n_cols"), a("BLOCK_N")
    end = min(width, a("real_width"))
    full = end // block

    def trips(loop, body):
        loads = [i for i in body if i.root == "LDG"]
        if not loads:
            return 0
        if any(i.predicated for i in loads):
            return _cdiv(width - full * block, block)
        return full

    per_row = 4 * (2 + 2 * a("HAS_H")) + 9 * a("HAS_TARGET") + a("HAS_VALID")
    row = width * (x.itemsize + o.itemsize)
    return Work(trips, n * row + n * per_row, row)


def _order():
    from megatron_vocabstats.ops.kernels.triton_tiles import tile_order

    return tile_order.fn


def _tile_stats(launch, occ) -> Work:
    """``ROWS`` rows x one split of ``split_cols`` columns per program, in tiles of ``BLOCK_N``:
    ``hidden @ weight.T`` by ``tl.dot`` (``FUSED``; hidden and weight tiles re-read through the
    L2 in the kernel's grouped launch order) or stored logits (per-block statistics)."""
    a = launch.arg
    x = a("x_ptr")
    n, width, rows, block_n = a("n_rows"), a("n_cols"), a("ROWS"), a("BLOCK_N")
    split = a("split_cols")
    splits, row_tiles = _cdiv(width, split), _cdiv(n, rows)
    tiles = _cdiv(width, block_n) / splits  # per program, on average
    if not a("FUSED"):
        row = width * x.itemsize
        return Work([tiles], n * row + _stats_bytes(launch, n), row)
    hidden, block_k = a("hidden"), a("BLOCK_K")
    h_tile, w_tile = rows * hidden * x.itemsize, block_n * hidden * x.itemsize
    order = _order()

    def steps(pid):
        rt, sp = order(pid, row_tiles, splits, a("GROUP"))
        first = sp * split // block_n
        last = min(_cdiv(width, block_n), first + split // block_n)
        return [[(("h", rt), h_tile), (("w", j), w_tile)] for j in range(first, last)]

    ctas = launch.ctas()
    stored = n * width * x.itemsize if a("STORE") else 0
    hbm = gpu_cost.l2_misses((steps(p) for p in range(ctas)), gpu_cost.SMS * occ)
    return Work([tiles, _cdiv(hidden, block_k)], hbm + stored + _stats_bytes(launch, n),
                tiles * (h_tile + w_tile) + stored / ctas)


def _tile_grad(launch, occ) -> Work:
    """One recomputed ``ROWS x BLOCK_N`` tile per program, row tiles fastest in the launch
    order (the chunk's hidden rows stay in the L2, each weight tile is read once)."""
    a = launch.arg
    x, o = a("x_ptr"), a("out_ptr")
    n, width, hidden = a("n_rows"), a("n_cols"), a("hidden")
    rows, block_n = a("ROWS"), a("BLOCK_N")
    written = n * width * o.itemsize
    per_row = 4 * (2 + a("HAS_H") * 2) + 9 * a("HAS_TARGET") + a("HAS_VALID")
    gx, gy = launch.grid[0], launch.grid[1]
    h_tile, w_tile = rows * hidden * x.itemsize, block_n * hidden * x.itemsize

    def steps(pid):
        return [[(("h", pid % gx), h_tile), (("w", pid // gx), w_tile)]]

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


WORK = {"_row_stats_kernel": _row_stats, "_row_grad_kernel": _row_grad,
        "_tile_stats_kernel": _tile_stats, "_tile_grad_kernel": _tile_grad,
        "liger_cross_entropy_kernel": _liger_ce}


def work_of(launch, occ: int) -> Work:
    """The :class:`Work` of ``launch`` with ``occ`` CTAs resident per SM."""
    if launch.name not in WORK:
        raise KeyError(f"no work model for Triton kernel {launch.name!r} (benchmarks/gpu_work.py)")
    return WORK[launch.name](launch, occ)

