"""The kernel backends of the core statistics, one object per ``StatsConfig.kernel`` value.

A backend turns the core op's seam objects into what runs: :meth:`Backend.shard_stats` gives the
:class:`~.kernel.ChunkStats` of the statistics, :meth:`Backend.stats_grad` the
:class:`~.kernel.ChunkGrad` of a :class:`~.kernel.StatsGrad`. ``tiles`` says which chunks it
takes: the torch backend needs the fp32 upcast ``chunk.z`` (and, in the fused head, the chunk's
logits from the engine's GEMM); the Triton backend reads the logits itself, or computes them from
``chunk.hidden``/``chunk.weight`` when ``chunk.logits`` is None, so the engine hands it chunks
without buffers (:func:`.chunks.logits_chunks` ``upcast=False``, :func:`.linear.tile_chunks`).

Ops with their own statistics or gradient (top-k, sampling) use the torch chunks whatever the
backend: :func:`backend_of` is only asked for the core op's objects.
"""

from __future__ import annotations

from .kernel import ChunkGrad, ChunkStats, ShardStats, StatsGrad


class Backend:
    """The torch backend (``kernel="torch"``): the core op's own :class:`~.kernel.ShardStats`
    and :class:`~.kernel.StatsGrad` on fp32 chunks."""

    name = "torch"
    tiles = False  # whether it takes chunks without z (it reads or computes the logits itself)

    def shard_stats(self, *, layout, entropy: bool, zsum: bool, temperature: float,
                    batch_invariant: bool = False, blocks: bool = False,
                    argmax: bool = False) -> ChunkStats:
        """The statistics of a chunk (``temperature`` is applied by the chunk's upcast here);
        ``argmax``: also the id of each row's first maximum (row ``_math.STAT_ARGMAX``)."""
        del temperature
        return ShardStats(layout, entropy, zsum, batch_invariant=batch_invariant, blocks=blocks,
                          argmax=argmax)

    def stats_grad(self, grad: StatsGrad, temperature: float) -> ChunkGrad:
        """The gradient of a chunk for the core op's ``grad``."""
        del temperature
        return grad


class TritonBackend(Backend):
    """``kernel="triton"``: :mod:`..kernels.triton_stats` (imported on first use). A row's
    statistics are batch-invariant as they are; ``blocks`` (mode "tp") takes the kernel's
    per-block statistics."""

    name = "triton"
    tiles = True

    def shard_stats(self, *, layout, entropy, zsum, temperature, batch_invariant=False,
                    blocks=False, argmax=False):
        from ..kernels import triton_stats  # imports triton: only once the backend was chosen

        if argmax:  # the ops refuse it first, naming the argument (argmax=True)
            raise NotImplementedError("the Triton statistics have no argmax row")
        del batch_invariant
        return triton_stats.TritonShardStats(layout, entropy, zsum, temperature, blocks)

    def stats_grad(self, grad, temperature):
        from ..kernels import triton_stats

        return triton_stats.TritonStatsGrad(grad, temperature)


BACKENDS = {backend.name: backend for backend in (Backend(), TritonBackend())}
TORCH = BACKENDS["torch"]


def backend_of(cfg) -> Backend:
    """The backend of ``cfg.kernel`` (a ``StatsConfig``'s resolved ``"torch"`` or
    ``"triton"``)."""
    return BACKENDS[cfg.kernel]


def grad_backend(cfg, grad: ChunkGrad) -> Backend:
    """The backend that runs ``grad``: ``cfg.kernel``'s for the core op's
    :class:`~.kernel.StatsGrad`, torch for any other op's gradient (its own math on fp32
    chunks)."""
    return backend_of(cfg) if isinstance(grad, StatsGrad) else TORCH
