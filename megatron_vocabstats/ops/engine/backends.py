"""The kernel backends of the core statistics, one object per ``StatsConfig.kernel`` value.

A backend turns the core op's seam objects into what runs. With ``tiles`` (Triton) it reads the
logits itself, or computes them from ``chunk.hidden``/``chunk.weight`` when ``chunk.logits`` is
None, so the engine hands it chunks without fp32 buffers (:func:`.chunks.logits_chunks`
``upcast=False``, :func:`.linear.tile_chunks`). Ops with their own statistics or gradient
(top-k, sampling) use the torch chunks whatever the backend.
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
        """The :class:`~.kernel.ChunkStats` (``temperature``: applied by the chunk's upcast
        here); ``argmax``: also row ``_math.STAT_ARGMAX``."""
        del temperature
        return ShardStats(layout, entropy, zsum, batch_invariant=batch_invariant, blocks=blocks,
                          argmax=argmax)

    def stats_grad(self, grad: StatsGrad, temperature: float) -> ChunkGrad:
        """The :class:`~.kernel.ChunkGrad` that runs ``grad``."""
        del temperature
        return grad


class TritonBackend(Backend):
    """``kernel="triton"``: :mod:`..kernels.triton_stats` (imported on first use), batch-invariant
    as it is; ``blocks`` (mode "tp"): its per-block statistics."""

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
    """The backend of a ``StatsConfig``'s resolved ``cfg.kernel``."""
    return BACKENDS[cfg.kernel]


def grad_backend(cfg, grad: ChunkGrad) -> Backend:
    """The backend that runs ``grad``: ``cfg.kernel``'s for the core op's
    :class:`~.kernel.StatsGrad`, torch for any other op's gradient."""
    return backend_of(cfg) if isinstance(grad, StatsGrad) else TORCH
