"""Vocab-parallel log-probs, entropy and cross-entropy straight from hidden states.

The LM head and :func:`~megatron_vocabstats.vocab_parallel_stats` in one autograd Function: the
tokens are processed in chunks, each chunk's logits ``hidden_chunk @ weight.T`` live only in a
``[chunk, W]`` buffer of the model dtype, and its statistics are taken with the core op's math
(``_math.load_chunk``, ``chunk_stats``, ``merge_stats``, ``chunk_grad``). Backward recomputes each
chunk's logits, turns them into the logits gradient and immediately into ``dX = g @ W`` and
``dW += g.T @ h``. No ``[T, V/tp]`` tensor ever exists, so the peak does not grow with the
sequence length beyond the ``[T, H]`` activations and a few ``[T]`` vectors.

Method: the chunked "cut cross-entropy" idea (Wijmans et al., 2024, arXiv:2411.09009) and
Liger-Kernel's fused linear cross-entropy, on top of the exact vocab-parallel statistics of
``docs/numerics.md``; Megatron's ``ColumnParallelLinear`` contract for sequence parallelism and
gradient-accumulation fusion (``weight.main_grad``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _comm
from ._checks import (
    LOGITS_DTYPES,
    Field,
    StatsConfig,
    auto_chunk_size,
    check_finite,
    checked_config,
    first_order_backward,
    host_checks_enabled,
    tensor_checksum,
)
from ._math import (
    MergedStats,
    chunk_grad,
    finite_lse,
    grad_coefficients,
    load_chunk,
    local_target_index,
    merge_stats,
    padded_width,
)
from .vocab_parallel import (
    VocabStats,
    flatten_target,
    function_outputs,
    gathered_stats,
    merge_tokens_per_pass,
)
from .workspace import WORKSPACE, capturing

# CPU auto chunking: tokens per chunk from the bytes of one fp32 [chunk, W] buffer. Unlike the
# core op, whose chunks only stream logits, every chunk here re-reads the whole [W, H] weight for
# the logits, dX and dW products and adds a [W, H] fp32 product into the weight-gradient sums,
# which only amortises over a few hundred tokens. Measured (benchmarks/bench_fused_linear.py
# --sweep-chunk, V=151,936, tp=2, T=512, process CPU ms per forward+backward) at chunk
# 32/64/128/256/512: H=512 2304/1649/1603/1575/1748, H=1024 3703/3262/3096/2740/3027. 64 MiB
# (220 tokens at W=76,032) sits at the optimum for 167 MB of chunk buffers.
CPU_LINEAR_CHUNK_BYTES = 64 * 2**20


def auto_linear_chunk_size(width: int, device: torch.device) -> int:
    """Tokens per chunk of :func:`linear_vocab_parallel_stats` when ``chunk_size=None``.

    CPU: ``CPU_LINEAR_CHUNK_BYTES // (4 * width)`` (220 tokens at W = 76,032; see the comment on
    the constant). Other devices: the core op's ``auto_chunk_size`` (256 MiB per fp32 buffer).
    """
    if device.type == "cpu":
        return max(1, CPU_LINEAR_CHUNK_BYTES // (4 * width))
    return auto_chunk_size(width, device)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinearStatsConfig:
    """Options of one :func:`linear_vocab_parallel_stats` call, validated.

    ``stats``: the core op's options (layout, chunk size, entropy mode, ...). ``grad_hidden`` /
    ``grad_weight``: which input gradients are produced. ``forward_grad``: gradients computed in
    forward for the upstream gradient ``c * grad_weights`` (see ``grad_weights``).
    """

    stats: StatsConfig
    sequence_parallel: bool
    accumulate_into_main_grad: bool
    forward_grad: bool
    grad_hidden: bool
    grad_weight: bool


_WGRAD_MODES: dict[str, str] = {}


def _wgrad_mode(device_type: str) -> str:
    """How this device adds ``g.T @ h`` (bf16/fp16 operands) into an fp32 accumulator.

    ``"addmm"``: one GEMM with fp32 output accumulating in place (CUDA builds whose
    ``addmm(out_dtype=float32)`` accepts an fp32 ``self``, like Megatron's
    ``wgrad_gemm_accum_fp32``); ``"mm"``: an fp32-output GEMM into a ``[W, H]`` temporary, then an
    add; ``"upcast"``: fp32 copies of the chunk operands and an fp32 GEMM (exact; the CPU path,
    where torch has no mixed-dtype GEMM). Probed once per device type, on the first call outside
    CUDA graph capture (the probe reads a value on the host); during a capture before any probe,
    ``"upcast"`` (always correct) without probing.
    """
    if device_type != "cuda":
        return "upcast"
    if device_type not in _WGRAD_MODES:
        if capturing():
            return "upcast"
        _WGRAD_MODES[device_type] = _probe_wgrad_mode(device_type)
    return _WGRAD_MODES[device_type]


def _probe_wgrad_mode(device_type: str) -> str:
    a = torch.ones(2, 2, device=device_type, dtype=torch.bfloat16)
    acc = torch.ones(2, 2, device=device_type)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        if bool((acc == 3.0).all()):
            return "addmm"
    except (RuntimeError, TypeError):
        pass
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return "mm"
    except (RuntimeError, TypeError):
        return "upcast"


# Batch-invariant mode: the logits are computed INVARIANT_ROWS rows per matmul, from a copy of the
# rows in a reused buffer (tail rows zero), so every GEMM has the same shape and alignment whatever
# the token count, the chunk size or the row's position.
INVARIANT_ROWS = 64


class _ChunkBuffers:
    """The reused buffers of one pass over the chunks (all with ``chunk`` rows).

    ``logits``: model dtype ``[chunk, W]``, the chunk's logits and then its logits gradient;
    ``z``/``scratch``: fp32 ``[chunk, W]`` for the core math; ``z_blocks``/``scratch_blocks``: the
    same memory as ``[chunk, padded W]`` for :func:`~._math.block_stats` (the same tensors unless
    ``batch_invariant`` and W is not a multiple of 128); ``h32``: fp32 ``[chunk, H]``, made on
    first use by the upcast weight-gradient path. With ``batch_invariant`` the rows (the chunk,
    or fewer tokens) are rounded up to a multiple of :data:`INVARIANT_ROWS`. All come from the
    workspace cache (:mod:`.workspace`); :meth:`release` gives them back.
    """

    def __init__(self, hidden2d: torch.Tensor, width: int, chunk: int, *,
                 batch_invariant: bool = False):
        rows = min(chunk, max(hidden2d.shape[0], 1))
        if batch_invariant:
            # Whole INVARIANT_ROWS blocks of the rows a chunk can hold, never of the full
            # chunk_size: a few tokens must not pay for a [chunk, W] buffer. The GEMM views
            # (_chunk_logits) have the same shape and strides whatever the buffer's row count.
            rows = -(-rows // INVARIANT_ROWS) * INVARIANT_ROWS
        wide = padded_width(width, batch_invariant)
        device, self._hidden = hidden2d.device, hidden2d.shape[1]
        self._leases = [WORKSPACE.take((rows, width), hidden2d.dtype, device)]
        self.logits = self._leases[0].tensor
        for name in ("z", "scratch"):
            lease = WORKSPACE.take((rows * wide,), torch.float32, device)
            self._leases.append(lease)
            setattr(self, name, lease.tensor[: rows * width].view(rows, width))
            setattr(self, name + "_blocks", lease.tensor.view(rows, wide))
        self._rows = rows
        self._h32 = self._hpad = None

    def _extra(self, dtype) -> torch.Tensor:
        lease = WORKSPACE.take((self._rows, self._hidden), dtype, self.logits.device)
        self._leases.append(lease)
        return lease.tensor

    def h32(self, n: int) -> torch.Tensor:
        if self._h32 is None:
            self._h32 = self._extra(torch.float32)
        return self._h32[:n]

    def padded_rows(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ([n, H]) copied into a reused ``[chunk, H]`` buffer whose other rows are 0."""
        if self._hpad is None:
            self._hpad = self._extra(h.dtype)
        self._hpad[: h.shape[0]].copy_(h)
        self._hpad[h.shape[0]:].zero_()
        return self._hpad

    def release(self) -> None:
        """Give the buffers back to the workspace; they must not be used afterwards."""
        WORKSPACE.give(*self._leases)
        self._leases = []


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bufs: _ChunkBuffers,
                  batch_invariant: bool) -> torch.Tensor:
    """``h @ weight.T`` ([n, W], model dtype) in ``bufs.logits``; with ``batch_invariant`` as
    matmuls of exactly :data:`INVARIANT_ROWS` rows (see there)."""
    n = h.shape[0]
    if not batch_invariant:
        return torch.matmul(h, weight.t(), out=bufs.logits[:n])
    padded = bufs.padded_rows(h)
    for start in range(0, n, INVARIANT_ROWS):
        block = slice(start, start + INVARIANT_ROWS)
        torch.matmul(padded[block], weight.t(), out=bufs.logits[block])
    return bufs.logits[:n]


def _logit_chunks(hidden2d, weight, target1d, valid, cfg: StatsConfig, bufs: _ChunkBuffers, *,
                  padded: bool = False):
    """Yield ``(rows, logits, z, index, owned)`` per chunk of tokens.

    ``logits``: ``hidden2d[rows] @ weight.T`` in the model dtype (one matmul, fp32 accumulation
    inside, one rounding, as Megatron's output layer; :data:`INVARIANT_ROWS` rows per matmul in
    batch-invariant mode); ``z``: its fp32 upcast from ``load_chunk`` (temperature applied,
    padding at the floor), in ``bufs.z_blocks`` if ``padded`` else ``bufs.z``;
    ``index``/``owned``: the rows' targets in this shard (None without targets).
    """
    num_tokens = hidden2d.shape[0]
    zbuf = bufs.z_blocks if padded else bufs.z
    for start in range(0, num_tokens, cfg.chunk_size):
        rows = slice(start, min(start + cfg.chunk_size, num_tokens))
        logits = _chunk_logits(hidden2d[rows], weight, bufs, bool(cfg.batch_invariant))
        index = owned = None
        if target1d is not None:
            index, owned = local_target_index(target1d[rows], valid[rows], cfg.layout)
        yield rows, logits, load_chunk(logits, zbuf, cfg.layout, cfg.temperature), index, owned


def _accumulate_wgrad(acc: torch.Tensor, grad: torch.Tensor, h: torch.Tensor,
                      bufs: _ChunkBuffers) -> None:
    """``acc += grad.T @ h`` accumulated in fp32 (``acc`` fp32 ``[W, H]``; ``grad`` ``[n, W]`` and
    ``h`` ``[n, H]`` in the model dtype). Clobbers ``bufs.z``."""
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), h)
        return
    mode = _wgrad_mode(acc.device.type)
    if mode == "addmm":
        torch.addmm(acc, grad.t(), h, out_dtype=acc.dtype, out=acc)
    elif mode == "mm":
        acc.add_(torch.mm(grad.t(), h, out_dtype=acc.dtype))
    else:
        n = grad.shape[0]
        acc.addmm_(bufs.z[:n].copy_(grad).t(), bufs.h32(n).copy_(h))


def _input_grads_of_chunk(grad, h, weight, dx_rows, acc, bufs: _ChunkBuffers) -> None:
    """From one chunk's logits gradient ``grad`` [n, W]: ``dx_rows = grad @ weight`` (if given) and
    ``acc += grad.T @ h`` (if given)."""
    if dx_rows is not None:
        torch.matmul(grad, weight, out=dx_rows)
    if acc is not None:
        _accumulate_wgrad(acc, grad, h, bufs)


def _weight_grad_buffer(weight, main_grad) -> torch.Tensor:
    """The fp32 ``[W, H]`` accumulator: an fp32 ``main_grad`` itself, else fresh zeros."""
    if main_grad is not None and main_grad.dtype == torch.float32:
        return main_grad
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def _finish_weight_grad(acc, weight, main_grad, cfg: LinearStatsConfig):
    """The gradient to return for ``weight`` given its fp32 sums ``acc``.

    Without ``accumulate_into_main_grad``: ``acc`` cast to the weight dtype. With it, Megatron's
    gradient-accumulation-fusion contract (``tensor_parallel.layers``): ``acc`` is added into
    ``main_grad`` unless it is ``main_grad``; if the weight has ``grad_added_to_main_grad``, that is
    set to True and a dummy gradient returned (zeros if ``weight.zero_out_wgrad``, else
    uninitialised), otherwise None.
    """
    if not cfg.accumulate_into_main_grad:
        return acc.to(weight.dtype)
    if acc is not main_grad:
        main_grad.add_(acc)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=weight.dtype, device=weight.device)


def _full_hidden(hidden, cfg: LinearStatsConfig, tp_group) -> torch.Tensor:
    """``hidden``, or under sequence parallelism every rank's shard gathered along dim 0."""
    return _comm.gather_sequence(hidden, tp_group) if cfg.sequence_parallel else hidden


def _reduce_hidden_grad(dx2d, total_shape, cfg: LinearStatsConfig, tp_group):
    """Sum the per-shard ``dX`` over the vocabulary shards, as ``ColumnParallelLinear``'s backward:
    one all-reduce, or under sequence parallelism one reduce-scatter to the local shard."""
    if cfg.sequence_parallel:
        return _comm.reduce_scatter_sequence(dx2d.view(total_shape), tp_group)
    return _comm.all_reduce_sum_(dx2d, tp_group).view(total_shape)


class _LinearVocabParallelStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, grad_weights, cfg: LinearStatsConfig, tp_group):
        sc = cfg.stats
        total = _full_hidden(hidden, cfg, tp_group)
        total_shape = total.shape
        hidden2d = total.reshape(-1, total_shape[-1])
        target1d, valid = flatten_target(target, sc.ignore_index)
        has_target = target is not None
        merge = functools.partial(
            merge_stats, vocab_size=sc.layout.vocab_size,
            label_smoothing=sc.label_smoothing if has_target else 0.0,
            entropy=sc.entropy != "off", has_target=has_target,
            batch_invariant=bool(sc.batch_invariant))
        bufs = _ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size,
                             batch_invariant=bool(sc.batch_invariant))
        try:
            if cfg.forward_grad:
                merged, dx2d, acc = _forward_with_grads(hidden2d, weight, target1d, valid,
                                                        grad_weights, bufs, cfg, tp_group, merge)
            else:
                chunks = ((rows, z, bufs.scratch_blocks, index, owned) for rows, _, z, index, owned
                          in _logit_chunks(hidden2d, weight, target1d, valid, sc, bufs,
                                           padded=True))
                parts = gathered_stats(chunks, hidden2d.shape[0], sc, tp_group,
                                       has_target=has_target, device=hidden.device)
                merged = merge(parts, valid,
                               tokens_per_pass=merge_tokens_per_pass(sc, parts.shape[0]))
        finally:
            bufs.release()
        del bufs, total, hidden2d
        if host_checks_enabled(sc.validate, hidden.device):
            check_finite(merged.logsumexp, valid)

        logprobs, entropy, lse = function_outputs(ctx, merged, total_shape[:-1], sc.entropy)
        ctx.cfg, ctx.tp_group = cfg, tp_group
        ctx.main_grad = weight.main_grad if cfg.accumulate_into_main_grad else None
        if cfg.forward_grad:
            grad_hidden = None
            if dx2d is not None:
                grad_hidden = _reduce_hidden_grad(dx2d, total_shape, cfg, tp_group)
            ctx.save_for_backward(weight, target, grad_weights, grad_hidden, acc)
            ctx.used = False
        else:
            ctx.save_for_backward(hidden, weight, target, lse,
                                  entropy if sc.entropy == "grad" else None)
        return logprobs, entropy, lse

    @staticmethod
    @first_order_backward("linear_vocab_parallel_stats")
    def backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        if ctx.cfg.forward_grad:
            grad_hidden, grad_weight = _scaled_forward_grads(ctx, grad_logprobs)
        else:
            grad_hidden, grad_weight = _recomputed_grads(ctx, grad_logprobs, grad_entropy)
        return grad_hidden, grad_weight, None, None, None, None


def _forward_with_grads(hidden2d, weight, target1d, valid, grad_weights, bufs,
                        cfg: LinearStatsConfig, tp_group, merge):
    """The forward-gradient pass: statistics, and for the upstream gradient ``grad_weights`` of
    the logprobs the per-shard ``dX`` ([T, H], model dtype) and the fp32 ``dW`` sums: 3 matmuls
    per chunk, no recompute.

    Each chunk's statistics are merged across the shards at once (one all-gather of the chunk's
    statistics per chunk), because its gradient needs the global logsumexp.
    Returns ``(MergedStats, dX or None, dW sums or None)``.
    """
    sc = cfg.stats
    coef_lp, _ = grad_coefficients(grad_weights, None, valid, sc.temperature)
    names = ("logsumexp", "logprobs") + (("entropy",) if sc.entropy != "off" else ())
    out = {name: hidden2d.new_empty(hidden2d.shape[0], dtype=torch.float32) for name in names}
    dx2d = torch.empty_like(hidden2d) if cfg.grad_hidden else None
    acc = _weight_grad_buffer(weight, None) if cfg.grad_weight else None
    for rows, logits, z, index, owned in _logit_chunks(hidden2d, weight, target1d, valid, sc,
                                                       bufs, padded=True):
        n = rows.stop - rows.start
        parts = gathered_stats([(slice(0, n), z, bufs.scratch_blocks, index, owned)], n, sc,
                               tp_group, has_target=True, device=hidden2d.device)
        part = merge(parts, valid[rows])
        for name in names:
            out[name][rows] = getattr(part, name)
        z = load_chunk(logits, bufs.z, sc.layout, sc.temperature)
        chunk_grad(z, bufs.scratch, logits, lse=finite_lse(part.logsumexp, valid[rows]), ent=None,
                   coef_lp=coef_lp[rows], coef_h=None, index=index, owned=owned,
                   valid=valid[rows], layout=sc.layout, label_smoothing=sc.label_smoothing)
        _input_grads_of_chunk(logits, hidden2d[rows], weight,
                              dx2d[rows] if dx2d is not None else None, acc, bufs)
    return MergedStats(**{name: out.get(name) for name in ("logsumexp", "logprobs", "entropy")}), \
        dx2d, acc


def _scaled_forward_grads(ctx, grad_logprobs):
    # Checked before ctx.saved_tensors: the first backward scaled acc in place, and unpacking it
    # again would raise torch's version-counter error instead.
    if ctx.used:
        raise RuntimeError("linear_vocab_parallel_stats: with grad_weights (forward-gradient "
                           "mode) backward runs once per forward: the gradients stored in "
                           "forward were scaled in place by the first backward. Run the forward "
                           "again, or pass grad_weights=None to backpropagate more than once")
    ctx.used = True
    weight, target, grad_weights, grad_hidden, acc = ctx.saved_tensors
    cfg: LinearStatsConfig = ctx.cfg
    valid = target.reshape(-1) != cfg.stats.ignore_index
    scale = _upstream_scale(grad_logprobs, grad_weights, valid, cfg, ctx.tp_group)
    if grad_hidden is not None:
        grad_hidden = grad_hidden.mul(scale)
    grad_weight = None
    if acc is not None:
        grad_weight = _finish_weight_grad(acc.mul_(scale), weight, ctx.main_grad, cfg)
    return grad_hidden, grad_weight


# Relative tolerance of the proportionality check of the forward-gradient mode: far above the
# rounding of c * w (a few fp32 ulps, and of the scale's reductions), far below any real mismatch.
SCALE_RTOL = 1e-4


def _upstream_scale(grad_logprobs, grad_weights, valid, cfg: LinearStatsConfig, tp_group):
    """The scalar c with ``grad_logprobs = c * grad_weights`` on the scored positions (0-d fp32).

    Least squares ``c = <g, w> / <w, w>`` (0 when every weight is 0), no host sync. With
    ``validate`` (outside CUDA graph capture) the residual is checked and a mismatch raises
    ``ValueError`` on every rank (one tiny all-gather under tp > 1).
    """
    g = torch.where(valid, grad_logprobs.reshape(-1).float(), 0.0)
    w = torch.where(valid, grad_weights.reshape(-1).float(), 0.0)
    norm = (w * w).sum()
    scale = torch.where(norm > 0, (g * w).sum() / norm.clamp(min=torch.finfo(torch.float32).tiny),
                        0.0)
    if host_checks_enabled(cfg.stats.validate, g.device) and g.numel():
        bad = not bool((g - scale * w).abs().max() <= SCALE_RTOL * g.abs().max())
        _, tp = _comm.group_rank_size(tp_group)
        if tp > 1:
            bad = any(row[0] for row in _comm.all_gather_ints([int(bad)], tp_group,
                                                               device=g.device))
        if bad:
            raise ValueError(
                "grad_weights: the upstream gradient of logprobs is not a scalar multiple of "
                "grad_weights on the scored positions (on some rank); the forward-gradient mode "
                "only serves losses sum(c * grad_weights * logprobs) with one scalar c. Pass the "
                "loss's per-token weights as grad_weights, or grad_weights=None"
            )
    return scale


def _recompute_backward(hidden, weight, target1d, valid, cfg: LinearStatsConfig, tp_group,
                       main_grad, logits_grad_) -> tuple:
    """``(grad_hidden, grad_weight)`` of a fused op by recomputing each chunk's logits.

    ``logits_grad_(rows, logits, z, index, owned, scratch)`` turns the chunk's logits (model
    dtype, in ``logits``; ``z`` their fp32 upcast) into their gradient in place; each chunk's
    gradient then becomes ``dX = g @ W`` and ``dW += g.T @ h`` right away. ``hidden`` is this
    rank's (sequence-parallel) shard; ``None`` for a gradient ``cfg`` does not ask for.
    """
    sc = cfg.stats
    total = _full_hidden(hidden, cfg, tp_group)
    hidden2d = total.reshape(-1, total.shape[-1])
    dx2d = torch.empty_like(hidden2d) if cfg.grad_hidden else None
    acc = _weight_grad_buffer(weight, main_grad) if cfg.grad_weight else None
    bufs = _ChunkBuffers(hidden2d, sc.layout.width, sc.chunk_size,
                         batch_invariant=bool(sc.batch_invariant))
    try:
        for rows, logits, z, index, owned in _logit_chunks(hidden2d, weight, target1d, valid, sc,
                                                           bufs):
            logits_grad_(rows, logits, z, index, owned, bufs.scratch)
            _input_grads_of_chunk(logits, hidden2d[rows], weight,
                                  dx2d[rows] if dx2d is not None else None, acc, bufs)
    finally:
        bufs.release()
    grad_hidden = None
    if dx2d is not None:
        grad_hidden = _reduce_hidden_grad(dx2d, total.shape, cfg, tp_group)
    grad_weight = None
    if acc is not None:
        grad_weight = _finish_weight_grad(acc, weight, main_grad, cfg)
    return grad_hidden, grad_weight


def _recomputed_grads(ctx, grad_logprobs, grad_entropy):
    hidden, weight, target, lse, ent = ctx.saved_tensors
    cfg: LinearStatsConfig = ctx.cfg
    sc = cfg.stats
    target1d, valid = flatten_target(target, sc.ignore_index)
    coef_lp, coef_h = grad_coefficients(grad_logprobs, grad_entropy, valid, sc.temperature)
    lse = finite_lse(lse.reshape(-1), valid)
    ent = ent.reshape(-1) if coef_h is not None else None

    def logits_grad_(rows, logits, z, index, owned, scratch):
        chunk_grad(
            z, scratch, logits,
            lse=lse[rows],
            ent=ent[rows] if ent is not None else None,
            coef_lp=coef_lp[rows] if coef_lp is not None else None,
            coef_h=coef_h[rows] if coef_h is not None else None,
            index=index, owned=owned, valid=valid[rows] if valid is not None else None,
            layout=sc.layout, label_smoothing=sc.label_smoothing,
        )

    return _recompute_backward(hidden, weight, target1d, valid, cfg, ctx.tp_group, ctx.main_grad,
                              logits_grad_)


def _local_problem(hidden, weight, target, grad_weights, *, lead_shape, sequence_parallel,
                   tp: int, entropy, accumulate_into_main_grad) -> ValueError | None:
    """The first problem with the arguments the core op's checks do not see, or None."""
    if not isinstance(hidden, torch.Tensor):
        return ValueError(f"hidden must be a tensor [..., H], got {type(hidden).__name__}")
    if hidden.dim() < (2 if sequence_parallel else 1):
        return ValueError(f"hidden must be [..., H] ([s/tp, ..., H] with sequence_parallel), got "
                          f"shape {tuple(hidden.shape)}")
    if hidden.shape[-1] == 0:
        return ValueError(f"hidden: the hidden dimension is empty (shape "
                          f"{tuple(hidden.shape)}); the logits hidden @ weight.T need H >= 1")
    if hidden.dtype not in LOGITS_DTYPES:
        return ValueError(f"hidden must be bf16, fp16 or fp32, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        what = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        return ValueError(f"weight must be the 2-D local shard [V/tp, H] of the output layer, "
                          f"got {what}")
    if weight.shape[0] == 0:
        return ValueError("weight: the local vocabulary shard has no rows")
    if weight.shape[1] != hidden.shape[-1]:
        return ValueError(f"weight has hidden size {weight.shape[1]} (shape "
                          f"{tuple(weight.shape)}) but hidden has {hidden.shape[-1]}")
    if weight.dtype != hidden.dtype:
        return ValueError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}: "
                          "the logits are computed in the model dtype, pass both in it")
    if weight.device != hidden.device:
        return ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    if isinstance(target, torch.Tensor) and tuple(target.shape) != lead_shape:
        where = (f"the gathered sequence ({tp} ranks x {hidden.shape[0]} rows: every rank passes "
                 "its equal-length shard of hidden and the full target)" if sequence_parallel
                 else "hidden")
        return ValueError(f"target shape {tuple(target.shape)} must equal the leading shape "
                          f"{lead_shape} of {where}")
    if grad_weights is not None:
        if target is None:
            return ValueError("grad_weights needs a target (it weights the target logprobs)")
        if not isinstance(grad_weights, torch.Tensor) or not grad_weights.dtype.is_floating_point:
            return ValueError("grad_weights must be a floating-point tensor shaped like target")
        if isinstance(target, torch.Tensor) and grad_weights.shape != target.shape:
            return ValueError(f"grad_weights shape {tuple(grad_weights.shape)} must equal target "
                              f"shape {tuple(target.shape)}")
        if grad_weights.device != hidden.device:
            return ValueError(f"grad_weights is on {grad_weights.device} but hidden on "
                              f"{hidden.device}")
        if entropy == "grad":
            return ValueError("entropy='grad' cannot be combined with grad_weights (the "
                              "forward-gradient mode serves log-prob losses only): pass "
                              "entropy='off' or 'metric'")
    if not isinstance(sequence_parallel, bool):
        return ValueError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if not isinstance(accumulate_into_main_grad, bool):
        return ValueError(f"accumulate_into_main_grad must be a bool, got "
                          f"{accumulate_into_main_grad!r}")
    if accumulate_into_main_grad:
        main_grad = getattr(weight, "main_grad", None)
        if (not isinstance(main_grad, torch.Tensor) or main_grad.shape != weight.shape
                or not main_grad.dtype.is_floating_point or main_grad.device != weight.device):
            return ValueError("accumulate_into_main_grad=True needs weight.main_grad, a float "
                              f"tensor of the weight's shape {tuple(weight.shape)} and device "
                              "(Megatron's DDP buffer)")
    return None


def _first_device(*candidates) -> torch.device:
    for x in candidates:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _checked_linear_config(hidden, weight, target, grad_weights, tp_group, *, sequence_parallel,
                           accumulate_into_main_grad, chunk_size,
                           local_error: ValueError | None = None, agree: tuple = (),
                           **options) -> LinearStatsConfig:
    """Validate one call: the fused op's own arguments, then the core op's checks
    (``_checks.checked_config``) on the shape, dtype and device of the logits it will compute.

    Under ``validate`` and tp > 1 a problem on one rank raises on every rank, and the ranks must
    agree on ``sequence_parallel``, whether ``grad_weights`` is given, and
    ``accumulate_into_main_grad`` (they change the collectives or the gradients), then on the
    caller's ``agree`` entries: all in the core op's one tiny all-gather.
    """
    _, tp = _comm.group_rank_size(tp_group)
    lead_shape = None
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        lead_shape = tuple(hidden.shape[:-1])
        if sequence_parallel is True and hidden.dim() >= 2:
            lead_shape = (hidden.shape[0] * tp, *lead_shape[1:])
    problem = _local_problem(hidden, weight, target, grad_weights, lead_shape=lead_shape,
                             sequence_parallel=sequence_parallel, tp=tp,
                             entropy=options["entropy"],
                             accumulate_into_main_grad=accumulate_into_main_grad)
    if problem is None and local_error is not None:
        problem = local_error
    if problem is None:
        width = weight.shape[0]
        # Shape, dtype and device of the logits, with no memory behind them.
        logits = hidden.new_empty(()).expand(*lead_shape, width)
        if chunk_size is None:
            chunk_size = auto_linear_chunk_size(width, hidden.device)
    else:  # the core checks' cross-rank exchange makes this rank's problem raise everywhere
        logits = torch.empty(0, device=_first_device(hidden, weight, target))
    agree = (("sequence_parallel", lambda: int(sequence_parallel), bool),
             ("grad_weights", lambda: int(grad_weights is not None),
              lambda given: "tensor" if given else None),
             (Field("grad_weights values", checksum=True),
              lambda: -1 if grad_weights is None else tensor_checksum(grad_weights)),
             ("accumulate_into_main_grad", lambda: int(accumulate_into_main_grad), bool),
             *agree)
    stats = checked_config(logits, target, tp_group, chunk_size=chunk_size, local_error=problem,
                           agree=agree, **options)
    grad_on = torch.is_grad_enabled()
    grad_hidden = grad_on and hidden.requires_grad
    grad_weight = grad_on and weight.requires_grad
    return LinearStatsConfig(
        stats=stats,
        sequence_parallel=sequence_parallel and tp > 1,
        accumulate_into_main_grad=accumulate_into_main_grad,
        forward_grad=grad_weights is not None and (grad_hidden or grad_weight),
        grad_hidden=grad_hidden,
        grad_weight=grad_weight,
    )


def linear_vocab_parallel_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    entropy: str = "grad",
    temperature: float = 1.0,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    grad_weights: torch.Tensor | None = None,
    accumulate_into_main_grad: bool = False,
    validate: bool = True,
    batch_invariant: bool | str = False,
) -> VocabStats:
    """Exact per-token log-probs, entropy and logsumexp of ``hidden @ W.T`` without the logits.

    Reference semantics (one process; ``W`` the full output weight, the shards of ``tp_group``
    stacked in rank order; ``h`` the full sequence, the shards of ``hidden`` concatenated along
    dim 0 under ``sequence_parallel``)::

        logits = h @ W.T                      # in the model dtype, as Megatron's output layer
        vocab_parallel_stats(logits, target, vocab_size=..., entropy=..., temperature=..., ...)

    computed chunk by chunk of tokens: a chunk's logits exist only in a ``[chunk, W]`` buffer
    (``W`` = padded V / tp), the statistics are those of the core op (same code, see
    :func:`~megatron_vocabstats.vocab_parallel_stats` and ``docs/numerics.md``), and backward
    recomputes each chunk's logits, derives the logits gradient and turns it into
    ``dX = g @ W`` and ``dW += g.T @ h`` right away. Method: chunked linear cross-entropy
    (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models",
    arXiv:2411.09009; Liger-Kernel's fused linear cross-entropy) made vocab-parallel with the
    core op's exact statistics.

    Numerics: each chunk's logits are ``hidden_chunk @ weight.T`` in the model dtype (fp32
    accumulation inside the matmul, one rounding), so all outputs are bitwise equal to
    ``vocab_parallel_stats`` on the logits assembled from those chunk products. Versus one full
    ``hidden @ weight.T`` they differ only where the BLAS rounds a logit differently for another
    row count (on CPU bf16/fp16 never observed; fp32 by ~1 ulp for chunks < 64 rows): then
    ``|d logprob| <= 2 max|d logit| / temperature``. The logits gradient is rounded once to the
    model dtype (as Megatron's unfused pair), ``dX`` is one matmul per chunk (fp32 accumulation,
    one rounding) summed over the shards in the model dtype, ``dW`` is accumulated over all
    chunks in fp32 and rounded once (or added into ``main_grad``).

    Args:
        hidden: ``[..., H]`` bf16/fp16/fp32 hidden states (Megatron ``[s, b, H]``, THD
            ``[T, 1, H]``), replicated on the ranks of ``tp_group``; with ``sequence_parallel``
            this rank's sequence shard ``[s/tp, ..., H]`` (gathered along dim 0 inside, its
            gradient reduce-scattered). Never modified.
        weight: this rank's shard ``[W, H]`` of the output layer (rows = global vocabulary ids
            ``[rank*W, (rank+1)*W)``), same dtype and device as ``hidden``; tied embeddings
            allowed (the same parameter may be used elsewhere; gradients add up).
        target: int64 global token ids shaped like the (gathered) leading shape of ``hidden``,
            or None for entropy and logsumexp only.
        tp_group: the tensor-parallel group; None means no tensor parallelism.
        sequence_parallel: ``hidden`` is the local sequence shard (Megatron's
            ``sequence_parallel``); ignored for tp = 1.
        vocab_size, vocab_start, entropy, temperature, ignore_index, label_smoothing,
            validate: as :func:`~megatron_vocabstats.vocab_parallel_stats` (with ``vocab_start``
            the weight shard holds rows ``[vocab_start, vocab_start + W)``). The temperature scales each fp32
            chunk and the gradients; the weight is never copied.
        chunk_size: tokens per chunk; workspace one ``[chunk, W]`` buffer of the model dtype, two
            fp32 ``[chunk, W]`` (plus an fp32 ``[chunk, H]`` on CPU). None:
            :func:`auto_linear_chunk_size` (64 MiB per fp32 buffer on CPU, 256 MiB on GPU).
            Results do not depend on it (up to the matmul rounding noted above).
        grad_weights: forward-gradient mode, for losses whose per-token weights are known in
            forward (masked SFT cross-entropy): fp32 (any float) weights ``w`` shaped like
            ``target``. Valid only when the upstream gradient of ``logprobs`` is ``c * w`` for a
            single scalar ``c`` — e.g. ``loss = -(w * logprobs).sum() / n`` or Megatron's
            ``sum(per_token_loss * loss_mask)`` with ``w = loss_mask``, under any later scaling.
            The gradients are then computed during forward (3 matmuls per chunk instead of 4,
            no recompute) and backward only multiplies them by ``c``. Needs ``entropy`` "off" or
            "metric". Costs between forward and backward: ``dX`` (the size of ``hidden``) and
            the fp32 ``dW`` sums (``4 * W * H`` bytes), and one all-gather of
            ``[5, chunk]`` statistics per chunk instead of one in all. With ``validate`` the
            backward checks the proportionality (a host sync) and raises ``ValueError`` if it
            does not hold. Backward runs once per forward (a second one, e.g. after
            ``retain_graph=True``, raises ``RuntimeError``). Not differentiated.
        accumulate_into_main_grad: Megatron's gradient-accumulation fusion: add the fp32 weight
            gradient into ``weight.main_grad`` (read at forward time), set
            ``weight.grad_added_to_main_grad = True`` and return a dummy gradient (zeros if
            ``weight.zero_out_wgrad``) if the weight has that attribute, else None. False: an
            ordinary gradient in the weight dtype.
        batch_invariant: as :func:`~megatron_vocabstats.vocab_parallel_stats` (``True`` or
            ``"tp"``), and the logits themselves are computed as matmuls of exactly 64 rows
            (``INVARIANT_ROWS``) from a reused, zero-padded copy of the rows, so that every GEMM
            has one shape whatever the token count, ``chunk_size`` or the row's position: a
            row's outputs are then bitwise invariant to them as far as the GEMM computes each
            row independently of the others with a fixed kernel for a fixed shape (checked on
            CPU for fp32 and bf16; cuBLAS does for a fixed shape, outside split-K heuristics
            that only depend on the shape). ``"tp"`` makes the statistics agree across tp for
            the same logits; the logits of tp shards are separate GEMMs of other N, so they
            can round differently from tp = 1. Costs: matmuls of 64 rows (the last one of a
            chunk partly on zero rows), chunk buffers rounded up to whole 64-row blocks even
            for few tokens, one ``[chunk, H]`` copy per chunk. Gradients are not covered
            (``dW`` sums over all tokens).

    Returns:
        :class:`~megatron_vocabstats.VocabStats` ``(logprobs, entropy, logsumexp)``, fp32,
        shaped like ``target`` (the gathered leading shape under sequence parallelism),
        bitwise identical on every rank of ``tp_group``.

    Communication: forward, one all-gather of ``[5, T]`` fp32 statistics (one of ``[5, chunk]``
    per chunk with ``grad_weights``), one of a few int64 with ``validate``, and the
    sequence-parallel all-gather of ``hidden``. Backward: the reduction of ``dX`` over the
    shards (one all-reduce, or one reduce-scatter under sequence parallelism, as
    ``ColumnParallelLinear``), plus under sequence parallelism the all-gather of ``hidden`` again
    (only the local shard is saved, as Megatron does). With ``grad_weights`` the ``dX`` reduction
    happens in forward and backward has none (one tiny int64 all-gather with ``validate``).

    Memory beyond inputs and outputs: the chunk buffers (reused across calls through
    ``ops.workspace``), ``O(tp * T)`` fp32 vectors, the
    gathered ``hidden`` under sequence parallelism, and in backward ``dX`` before its reduction
    and the fp32 ``[W, H]`` weight-gradient sums (none extra when ``main_grad`` is fp32).

    Raises:
        ValueError: naming the argument: ``hidden``/``weight`` not tensors, ``weight`` not 2-D,
            an empty hidden dimension (H = 0), hidden sizes, dtypes or devices that differ, a
            ``target`` whose shape is not the (gathered) leading shape of ``hidden``,
            ``grad_weights`` misshaped or with ``entropy="grad"``, ``accumulate_into_main_grad``
            without a matching ``weight.main_grad``, and everything
            :func:`vocab_parallel_stats` raises; with ``validate`` on tp > 1, on every rank,
            including a sequence-parallel shard whose length differs across ranks, and
            ``sequence_parallel``, ``grad_weights`` (given or None) or
            ``accumulate_into_main_grad`` differing across the ranks (the error names the field
            and prints each rank's value). Without ``validate`` those fail, hang or give wrong
            gradients.
        RuntimeError: a second backward through one forward with ``grad_weights`` (not
            supported: the gradients stored in forward are scaled in place by the first).
    """
    cfg = _checked_linear_config(
        hidden, weight, target, grad_weights, tp_group,
        sequence_parallel=sequence_parallel,
        accumulate_into_main_grad=accumulate_into_main_grad,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        vocab_start=vocab_start,
        entropy=entropy,
        temperature=temperature,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        validate=validate,
        batch_invariant=batch_invariant,
    )
    return VocabStats(*_LinearVocabParallelStats.apply(hidden, weight, target, grad_weights, cfg,
                                                       tp_group))


def linear_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    vocab_size: int | None = None,
    vocab_start: int | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    loss_weights: torch.Tensor | None = None,
    accumulate_into_main_grad: bool = False,
    validate: bool = True,
    batch_invariant: bool | str = False,
) -> torch.Tensor:
    """Per-token cross-entropy ``-log p(target)`` (fp32, nats, shaped like ``target``) of
    ``hidden @ W.T``, without the logits: the fused replacement of Megatron's output layer +
    ``vocab_parallel_cross_entropy`` (the same per-token loss contract; 0 with zero gradient at
    ``ignore_index``).

    ``loss_weights`` (e.g. Megatron's ``loss_mask``) selects the forward-gradient mode: valid when
    the upstream gradient of the returned loss is ``c * loss_weights`` for one scalar ``c`` (as
    ``sum(loss * loss_mask)`` then any scaling); see ``grad_weights`` of
    :func:`linear_vocab_parallel_stats`, whose other arguments, errors and communication apply.
    """
    stats = linear_vocab_parallel_stats(
        hidden, weight, target, tp_group=tp_group, sequence_parallel=sequence_parallel,
        vocab_size=vocab_size, vocab_start=vocab_start, chunk_size=chunk_size, entropy="off",
        ignore_index=ignore_index,
        label_smoothing=label_smoothing, grad_weights=loss_weights,
        accumulate_into_main_grad=accumulate_into_main_grad, validate=validate,
        batch_invariant=batch_invariant,
    )
    return 0.0 - stats.logprobs  # +0.0, not -0.0, at ignored positions
