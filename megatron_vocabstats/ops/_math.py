"""Per-chunk vocabulary statistics and their merge across shards (the gradient: :mod:`._grad`).

Pure tensor math: no collectives, never writes to the caller's tensors (only to the scratch
buffers handed in). The formulas (``docs/numerics.md``):

* per shard r and token: ``m_r = max_j z_j``, ``s_r = sum_j exp(z_j - m_r)``,
  ``u_r = sum_j exp(z_j - m_r) (z_j - m_r)`` (relative to ``m_r``: large logits such as fp16's
  65504 do not cancel), ``t_r = z_y`` if the target is local else 0, and with label smoothing
  ``a_r = c sum_j (z_j - m_r)`` over the n_r real columns (-inf if one is at -inf), with
  ``c = zsum_scale(V)`` a power of two <= 1/(2V) so that the sum cannot overflow;
* merged with ``m = max_r m_r``: ``S = sum_r s_r e^(m_r - m)``,
  ``U = sum_r e^(m_r - m) (u_r + (m_r - m) s_r)`` (a part whose scale underflows to 0 adds 0),
  ``logZ = m + log S``, ``logprob = t - logZ``, ``H = log S - U / S`` (exact:
  ``logZ - E_p[z]``), and ``mean_j z_j - m = sum_r (a_r + c n_r (m_r - m)) / (c V)``
  (:func:`rebase_zsum_`: every term <= 0, so extreme logits neither overflow nor cancel).

Where each is computed (float64: ``tests/unit/_reference.py``'s ``reference_stats``, whose
autograd gives the reference gradient; Triton: ``ops/kernels/triton_tiles.py``,
``triton_kernels.py``):

==================  ============================  ======================  =========================
statistic           torch                         Triton twin             tests
==================  ============================  ======================  =========================
m_r, s_r, u_r, t_r  chunk_stats, block_stats      online_update,          test_vocab_parallel
                                                  tile_update
a_r (smoothing)     _real_zsum                    online_update (ZSUM)    test_hostile_inputs
parts of a shard    reduce_blocks (also the       merge_lanes (the row    test_triton_kernels,
(blocks, splits)    Triton splits)                kernel's lanes)         test_batch_invariant
merge over shards   rebase_zsum_, merge_stats,    (this module's)         test_vocab_parallel_dist
                    log_normaliser
gradient w.r.t. z   _grad.chunk_grad              _row_grad_kernel,       test_vocab_parallel,
                                                  _tile_grad_kernel       test_triton_fused_kernels
==================  ============================  ======================  =========================

Batch-invariant mode: every sum over columns is taken in blocks of :data:`BLOCK` columns, each
with its own maximum, and blocks (then shards) are combined by :func:`tree_sum_`, a fixed tree of
elementwise adds. An elementwise add or exp rounds alike whatever the tensor's shape and a max is
exact in any order, so a row's statistics do not depend on the other rows (torch's ``sum`` may
split a row over threads when there are few rows). With blocks aligned to global column ids,
merging the :func:`block_stats` of all blocks of all shards gives the same bits for every tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._grad import split_lse
from ._layout import BLOCK, ShardLayout, put_first_max_ids

# Logits are clamped to Z_FLOOR as they are upcast, so every shifted logit stays finite:
# exp(Z_FLOOR - m) is exactly 0 for any real maximum m, and p * log p gives 0, not 0 * -inf = NaN.
# A shard whose maximum is Z_FLOOR has no live column for that row: m_r = -inf, s_r = u_r = 0.
Z_FLOOR = -1.0e30

# Row order of the packed per-shard statistics tensor [NUM_STATS, T].
STAT_MAX, STAT_SUMEXP, STAT_ENT, STAT_TARGET, STAT_ZSUM = range(5)
NUM_STATS = 5
# The optional row after them: the global id of the part's first maximum (argmax=True), as int32
# bits (_layout.put_first_max_ids).
STAT_ARGMAX = NUM_STATS


def load_chunk(logits: torch.Tensor, out: torch.Tensor, layout: ShardLayout, temperature: float):
    """``z = max(logits / tau, Z_FLOOR)`` of a ``[n, W]`` chunk, in (and returned as) the fp32
    ``out[:n]``; padding columns (global id >= V, and ``out``'s columns beyond W, see
    :func:`padded_width`) at ``Z_FLOOR``. ``logits`` is never written."""
    z = out[: logits.shape[0]]
    z[:, : logits.shape[1]].copy_(logits)
    if temperature != 1.0:
        z.div_(temperature)
    z.clamp_(min=Z_FLOOR)
    if layout.real_width < z.shape[1]:
        z[:, layout.real_width :] = Z_FLOOR
    return z


def zsum_scale(vocab_size: int) -> float:
    """``c``: the power of two <= ``1 / (2 * vocab_size)`` that the label-smoothing sums of
    ``z - max`` are scaled by (exactly, being a power of two), so that they cannot overflow."""
    return math.ldexp(1.0, -((vocab_size - 1).bit_length() + 1))


def real_columns(num_parts: int, part_width: int, real: int, device) -> torch.Tensor:
    """``[num_parts]`` real column counts of consecutive parts of ``part_width`` columns of which
    the first ``real`` columns are real (the rest padding)."""
    starts = torch.arange(num_parts, device=device) * part_width
    return (real - starts).clamp(0, part_width)


def rebase_zsum_(parts: torch.Tensor, counts: torch.Tensor, vocab_size: int) -> None:
    """Make the label-smoothing row of ``[P, NUM_STATS, T]`` part statistics relative to the
    row's maximum over all parts, in place: ``a_r += c n_r (m_r - m)`` (``counts`` [P] the
    n_r). Summing the rows then gives ``c sum_j (z_j - m)`` over the whole row."""
    m_r = parts[:, STAT_MAX]
    m = m_r.amax(dim=0)
    delta = m_r - torch.where(torch.isfinite(m), m, 0.0)
    weight = (counts.to(delta.dtype) * zsum_scale(vocab_size)).unsqueeze(1)
    parts[:, STAT_ZSUM] += torch.where(torch.isfinite(delta), delta * weight, 0.0)


def _real_zsum(z: torch.Tensor, scratch: torch.Tensor, real: int, vocab_size: int) -> torch.Tensor:
    """``c sum_j z_j`` over the first ``real`` columns of the shifted ``z`` ``[n, W]`` (or per
    block of ``[n, nb, BLOCK]``, by :func:`tree_sum_`, padding as 0), scaled in ``scratch``."""
    n, c = z.shape[0], zsum_scale(vocab_size)
    if z.dim() == 2:
        return torch.mul(z[:, :real], c, out=scratch[:n, :real]).sum(dim=-1)
    scaled = torch.mul(z.reshape(n, -1), c, out=scratch[:n, : z.shape[1] * z.shape[2]])
    scaled[:, real:] = 0.0
    return tree_sum_(scaled.view(z.shape), 2)


def _floor_flag(z: torch.Tensor, scratch: torch.Tensor, real: int) -> torch.Tensor:
    """Per row (or block): whether one of the first ``real`` columns is at the floor. Taken
    before the shift, which could round a column just above the floor onto the shifted floor."""
    if z.dim() == 2:
        return z[:, :real].amin(dim=-1) <= Z_FLOOR
    flat = scratch[: z.shape[0], : z.shape[1] * z.shape[2]].copy_(z.reshape(z.shape[0], -1))
    flat[:, real:] = 0.0
    return flat.view(z.shape).amin(dim=-1) <= Z_FLOOR


def _shift_to_max(z, scratch, out, layout: ShardLayout, zsum: bool) -> torch.Tensor:
    """Shift ``z`` by its maxima over the last dim in place, into ``out[STAT_MAX]`` (-inf where
    none is live), with ``zsum`` ``out[STAT_ZSUM]`` too; returns the live mask (NaN is live)."""
    if zsum:
        at_floor = _floor_flag(z, scratch, layout.real_width)
    m = z.amax(dim=-1)
    live = ~(m <= Z_FLOOR)
    out[STAT_MAX] = torch.where(live, m, float("-inf"))
    z.sub_(m.unsqueeze(-1))
    if zsum:
        out[STAT_ZSUM] = torch.where(at_floor, float("-inf"),
                                     _real_zsum(z, scratch, layout.real_width, layout.vocab_size))
    return live


def chunk_stats(
    z: torch.Tensor,
    scratch: torch.Tensor,
    index: torch.Tensor | None,
    owned: torch.Tensor | None,
    out: torch.Tensor,
    *,
    layout: ShardLayout,
    entropy: bool,
    zsum: bool,
    batch_invariant: bool = False,
    argmax: bool = False,
):
    """One chunk's shard statistics into ``out`` ([NUM_STATS, n] fp32; ``argmax``: one more
    row, :data:`STAT_ARGMAX`, the id of each row's first maximum).

    ``z``: [n, W] fp32 from :func:`load_chunk` (overwritten); ``scratch``: fp32, >= n rows of
    width W; ``index``/``owned``: from ``local_target_index``, None without targets.
    ``batch_invariant``: by :func:`block_stats`, the blocks combined in a fixed order (``z`` then
    needs :func:`padded_width` columns)."""
    if argmax:
        put_first_max_ids(z, out[STAT_ARGMAX], layout.vocab_start)
    if batch_invariant:
        blocks = out.new_zeros((NUM_STATS, z.shape[0], z.shape[1] // BLOCK))
        block_stats(z, scratch, index, owned, blocks, layout=layout, entropy=entropy, zsum=zsum)
        reduce_blocks(blocks, out, entropy=entropy, target=index is not None, zsum=zsum,
                      layout=layout)
        return
    n = z.shape[0]
    if index is not None:
        picked = z.gather(1, index.unsqueeze(1)).squeeze(1)
        out[STAT_TARGET] = torch.where(owned, picked, 0.0)
    if zsum and layout.real_width == 0:  # no real column on this shard
        out[STAT_ZSUM] = 0.0
        zsum = False
    live = _shift_to_max(z, scratch, out, layout, zsum)
    e = torch.exp(z, out=scratch[:n])
    out[STAT_SUMEXP] = torch.where(live, e.sum(dim=-1), 0.0)
    if entropy:
        out[STAT_ENT] = torch.where(live, z.mul_(e).sum(dim=-1), 0.0)


def tree_sum_(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``dim`` in a fixed order, overwriting ``x``; returns the sums (a view of x).

    A halving tree over the size padded with zeros to a power of two P (entry i += entry i + P/2,
    then P halves): elementwise adds only, so each sum rounds alike whatever the other dims, the
    thread count or the device, and trailing zero entries leave the result bitwise unchanged."""
    size = x.shape[dim]
    if size == 0:
        return x.sum(dim)
    width = 1 << (size - 1).bit_length()
    while width > 1:
        half = width // 2
        if size > half:
            x.narrow(dim, 0, size - half).add_(x.narrow(dim, half, size - half))
            size = half
        width = half
    return x.select(dim, 0)


def block_stats(z, scratch, index, owned, out, *, layout: ShardLayout, entropy: bool,
                zsum: bool, argmax: bool = False) -> None:
    """:func:`chunk_stats` per block b of local columns ``[b*BLOCK, (b+1)*BLOCK)``, relative to
    the block's maximum and summed by :func:`tree_sum_` (batch-invariant), into ``out``
    ([NUM_STATS (+ argmax), n, nb] fp32, zeroed by the caller); the target logit in its block, 0
    elsewhere. ``z``: ``[n, nb*BLOCK]`` from :func:`load_chunk` (overwritten); ``scratch``: fp32,
    >= n rows of that width."""
    n, width = z.shape
    zb = z.view(n, width // BLOCK, BLOCK)
    if argmax:
        put_first_max_ids(zb, out[STAT_ARGMAX], layout.vocab_start)
    if index is not None:
        picked = torch.where(owned, z.gather(1, index.unsqueeze(1)).squeeze(1), 0.0)
        out[STAT_TARGET].scatter_(1, (index // BLOCK).unsqueeze(1), picked.unsqueeze(1))
    # (with zsum, blocks with no real column stay 0; the others -inf when one is at the floor)
    live = _shift_to_max(zb, scratch, out, layout, zsum)
    e = torch.exp(z, out=scratch[:n]).view(zb.shape)
    if entropy:
        out[STAT_ENT] = torch.where(live, tree_sum_(zb.mul_(e), 2), 0.0)
    out[STAT_SUMEXP] = torch.where(live, tree_sum_(e, 2), 0.0)


@dataclass(frozen=True, slots=True)
class _Combined:
    """Statistics combined over the parts (shards or blocks) of a row: ``max`` (-inf where no
    column is live), ``max_safe`` (0 there), ``sumexp`` and ``ent`` relative to ``max_safe``,
    ``target`` and ``zsum`` summed; None where not asked for."""

    max: torch.Tensor
    max_safe: torch.Tensor
    sumexp: torch.Tensor
    ent: torch.Tensor | None
    target: torch.Tensor | None
    zsum: torch.Tensor | None


def _sum0(x: torch.Tensor, ordered: bool, *, copy: bool = False) -> torch.Tensor:
    if not ordered:
        return x.sum(dim=0)
    return tree_sum_(x.clone() if copy else x, 0)


def _combine(parts: torch.Tensor, *, entropy: bool, target: bool, zsum: bool,
             ordered: bool) -> _Combined:
    """Combine ``[P, NUM_STATS, T]`` per-part statistics (``ordered``: with :func:`tree_sum_`)."""
    m_r = parts[:, STAT_MAX]
    m = m_r.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, 0.0)
    delta = m_r - m_safe  # -inf for parts with no live column: scale 0, and s_r = u_r = 0
    scale = torch.exp(delta)
    s_r = parts[:, STAT_SUMEXP]
    ent = None
    if entropy:
        # A part whose scale underflows to 0 adds 0: exactly its share, and never 0 * inf
        # (delta * s_r overflows for a part at -9e29 next to one at 3e38).
        ent = _sum0(torch.where(scale == 0, 0.0, scale * (parts[:, STAT_ENT] + delta * s_r)),
                    ordered)
    return _Combined(
        max=m, max_safe=m_safe, sumexp=_sum0(s_r * scale, ordered), ent=ent,
        target=_sum0(parts[:, STAT_TARGET], ordered, copy=True) if target else None,
        zsum=_sum0(parts[:, STAT_ZSUM], ordered, copy=True) if zsum else None)


def log_normaliser(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, log S)`` (``log Z = m + log S``) per token of ``[P, NUM_STATS, T]`` statistics,
    combined as :func:`merge_stats` does; ``m`` is 0 for a row with no live column (then
    ``log S = -inf``)."""
    c = _combine(parts, entropy=False, target=False, zsum=False, ordered=False)
    return c.max_safe, torch.log(c.sumexp)


def reduce_blocks(blocks: torch.Tensor, out: torch.Tensor, *, entropy: bool, target: bool,
                  zsum: bool, layout: ShardLayout, part_width: int = BLOCK) -> None:
    """:func:`chunk_stats`'s ``out`` [NUM_STATS, n] from :func:`block_stats` ``blocks``
    [NUM_STATS, n, nb] (or parts of ``part_width`` columns alike), combined in a fixed order."""
    parts = blocks.permute(2, 0, 1)
    if zsum:
        rebase_zsum_(parts, real_columns(parts.shape[0], part_width, layout.real_width,
                                         parts.device), layout.vocab_size)
    c = _combine(parts, entropy=entropy, target=target, zsum=zsum, ordered=True)
    out[STAT_MAX] = c.max
    out[STAT_SUMEXP] = c.sumexp
    for row, value in ((STAT_ENT, c.ent), (STAT_TARGET, c.target), (STAT_ZSUM, c.zsum)):
        if value is not None:
            out[row] = value


@dataclass(frozen=True, slots=True)
class MergedStats:
    """Per-token results of :func:`merge_stats`, all fp32 ``[T]``; ``lse_lo``: the rounding
    error of ``logsumexp`` (:func:`split_lse`), for the gradient."""

    logsumexp: torch.Tensor
    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None
    lse_lo: torch.Tensor | None = None


def merge_stats(
    gathered: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    vocab_size: int,
    label_smoothing: float,
    entropy: bool,
    has_target: bool,
    batch_invariant: bool = False,
    tokens_per_pass: int | None = None,
    in_range: torch.Tensor | None = None,
) -> MergedStats:
    """Merge ``[P, NUM_STATS, T]`` shard statistics into per-token logsumexp, logprob, entropy.

    ``logprobs = sum_j q_j log p_j`` with ``q = (1-eps) onehot(y) + eps/V`` (``log p_y`` without
    smoothing); NaN at valid rows whose ``in_range`` (``target_in_range``) is False (ids let
    through with ``validate`` off). Rows with ``valid`` False get logprob and entropy 0; a row with
    no live column gets logsumexp -inf and NaN logprob and entropy. The parts are summed in rank
    order (``batch_invariant``: by :func:`tree_sum_`, so the merge of all blocks'
    :func:`block_stats` in global column order is independent of tp): every rank gets the same
    bits. With smoothing the ``a_r`` must be rebased on the merged maximum (:func:`rebase_zsum_`,
    as ``engine.chunks.gathered_stats`` leaves them). ``tokens_per_pass``: merge that many tokens
    at a time (same bits; ``[P, tokens_per_pass]`` temporaries instead of ``[P, T]``)."""
    num_tokens = gathered.shape[-1]
    if tokens_per_pass is not None and num_tokens > tokens_per_pass:
        options = {"vocab_size": vocab_size, "label_smoothing": label_smoothing,
                   "entropy": entropy, "has_target": has_target,
                   "batch_invariant": batch_invariant}
        def part(x, s):
            return None if x is None else x[s:s + tokens_per_pass]

        passes = [merge_stats(gathered[..., s:s + tokens_per_pass], part(valid, s),
                              in_range=part(in_range, s), **options)
                  for s in range(0, num_tokens, tokens_per_pass)]
        return MergedStats(*(None if parts[0] is None else torch.cat(parts)
                             for parts in zip(*((p.logsumexp, p.logprobs, p.entropy, p.lse_lo)
                                                for p in passes))))
    smooth = has_target and label_smoothing > 0.0
    c = _combine(gathered, entropy=entropy, target=has_target, zsum=smooth,
                 ordered=batch_invariant)
    m_safe = c.max_safe
    log_sumexp = torch.log(c.sumexp)
    lse, lse_lo = split_lse(m_safe, log_sumexp)

    ent = None
    if entropy:
        ent = log_sumexp - c.ent / c.sumexp
        if valid is not None:
            ent = torch.where(valid, ent, 0.0)

    logprobs = None
    if has_target:
        target_logit = torch.where(c.target > Z_FLOOR, c.target, float("-inf"))
        # (t - m) - log S, not t - (m + log S): no rounding at the scale of large logits.
        logprobs = (target_logit - m_safe) - log_sumexp
        if smooth:
            # c.zsum = c sum_j (z_j - m) (-inf with a real column at -inf: an infinite loss).
            mean_logp = c.zsum / (vocab_size * zsum_scale(vocab_size)) - log_sumexp
            # An eps below fp32 resolution rounds to 0 in the product, and 0 * -inf would be NaN
            # where the float64 value is -inf: keep the -inf of a real column at -inf.
            smoothed = torch.where(torch.isneginf(mean_logp), mean_logp,
                                   label_smoothing * mean_logp)
            logprobs = (1.0 - label_smoothing) * logprobs + smoothed
        if in_range is not None:
            logprobs = torch.where(in_range, logprobs, float("nan"))
        logprobs = torch.where(valid, logprobs, 0.0)
    return MergedStats(logsumexp=lse, logprobs=logprobs, entropy=ent, lse_lo=lse_lo)
