"""verl's real functions (the installed verl wheel, loaded by ``_framework_stubs``) against the verl
integration on 2 gloo ranks (tp = 2, Megatron's ``parallel_state``); run by
tests/unit/test_verl_dist.py.

Each case calls verl's own code before and after ``integrations.verl.apply()``: the unfused
functions of ``verl.utils.megatron.tensor_parallel`` through the names
``verl.workers.engine.megatron.transformer_impl`` binds, the Megatron engine's own
``_lm_head_logits_processor``, and ``model_forward_fused.fused_output_processor`` (verl's fused
path, whose Triton kernel needs CUDA: there only the float64 model of that kernel is the
reference). Values are compared with float64 references within the bounds of ``_reference``
(first-order bounds of fp32 arithmetic, ``docs/numerics.md``); gradients within numerics.md's
fp32 1e-5 on the scale of the terms that make them.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main  # noqa: E402

from _reference import (  # noqa: E402
    UNIT_ROUNDOFF,
    assert_within,
    linear_logits_error,
    reference_stats,
    stats_bounds,
    temperature_dz,
)
from megatron_vocabstats.ops import _comm  # noqa: E402
from megatron_vocabstats.profiling import count_collectives, peak_memory_bytes  # noqa: E402

CASES = Cases()
WIDTH = 40  # padded vocabulary: shards of 20 at tp = 2
T_PROC = "verl.utils.megatron.tensor_parallel"
ENGINE = "verl.workers.engine.megatron.transformer_impl"
FUSED = "verl.models.mcore.model_forward_fused"


def _verl():
    """verl's real modules, Megatron's parallel state at tp = world size, and the integration
    (imported, which applies it, then removed: each case applies it itself)."""
    import _framework_stubs

    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise Skip(f"megatron-core not importable: {exc}") from exc
    try:
        modules = _framework_stubs.load("verl")
    except ImportError as exc:
        raise Skip(str(exc)) from exc
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    import megatron_vocabstats.integrations.verl as integration

    integration.remove()
    return modules, integration, _framework_stubs.eager


def _shard(full, group):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    width = full.shape[-1] // tp
    return full[..., rank * width:(rank + 1) * width]


def _grad_close(actual, expected, scale, what):
    """numerics.md's fp32 tolerance, 1e-5 of the magnitude of the terms, plus fp32 underflow."""
    assert_within(actual, expected, 1e-5 * scale + 1e-30, what)


def _objective_grad(z, labels, w_lp, w_h):
    """Float64 gradient of ``sum(w_lp logp) + sum(w_h H)`` w.r.t. the logits ``z`` [..., V] and
    the magnitude of its terms (for :func:`_grad_close`)."""
    leaf = z.detach().double().requires_grad_()
    lp, ent, _ = reference_stats(leaf, labels)
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    p = torch.softmax(leaf.detach(), -1)
    logp = torch.log_softmax(leaf.detach(), -1)
    onehot = torch.zeros_like(p).scatter_(-1, labels.unsqueeze(-1), 1.0)
    scale = (w_lp.abs().unsqueeze(-1) * (p + onehot)
             + w_h.abs().unsqueeze(-1) * p * (logp.abs() + ent.detach().unsqueeze(-1)))
    return leaf.grad, scale


def _flat_bounds(z, group):
    """``stats_bounds`` of the float64 logits ``z`` [..., V] merged over the tp shards."""
    return stats_bounds(z.reshape(-1, z.shape[-1]), parts=dist.get_world_size(group))


def _call_each(module, shard, labels, weights, *, chunk_size, backward):
    """verl's three functions as ``module`` binds them, each on its own leaf (verl's entropy
    backward writes its saved logits in place, so two of them cannot share one); returns
    ``(outputs, leaves)``."""
    calls = (lambda x: module.vocab_parallel_log_probs_from_logits(x.clone(), labels),
             module.vocab_parallel_entropy,
             lambda x: module.vocab_parallel_entropy_with_chunking(x, chunk_size=chunk_size))
    outputs, leaves = [], []
    for call, weight in zip(calls, weights):
        leaf = shard.clone().requires_grad_()
        out = call(leaf)
        if backward:
            (out * weight).sum().backward()
        outputs.append(out)
        leaves.append(leaf)
    return outputs, leaves


@CASES.register
def verl_functions_match_tp2(group):
    """verl's vocab_parallel_log_probs_from_logits / vocab_parallel_entropy(_with_chunking)
    against the replacements bound in transformer_impl: same dtype and shape, values within the
    float64 bounds (verl's bf16 entropy within its own bf16 arithmetic), same gradients, logits
    untouched by ours; verl's chunked entropy has no backward over several chunks, ours has."""
    modules, integration, eager = _verl()
    ours_mod, theirs_mod = modules[ENGINE], modules[T_PROC]
    labels = torch.randint(0, WIDTH, (2, 5))
    weights = [torch.rand(2, 5, dtype=torch.float64) + 0.5 for _ in range(3)]
    for dtype in (torch.float32, torch.bfloat16):
        full = (torch.randn(2, 5, WIDTH, dtype=torch.float64) * 3).to(dtype)
        shard = _shard(full, group).contiguous()
        fp32 = dtype == torch.float32
        results = {}
        with eager():  # chunk_size 5: one chunk (see below)
            results["verl"] = _call_each(ours_mod, shard, labels, weights, chunk_size=5,
                                         backward=fp32)
        integration.apply()
        try:
            results["ours"] = _call_each(ours_mod, shard, labels, weights, chunk_size=2,
                                         backward=fp32)
        finally:
            integration.remove()
        assert ours_mod.vocab_parallel_entropy is theirs_mod.vocab_parallel_entropy  # restored
        for v, o, name in zip(results["verl"][0], results["ours"][0],
                              ("log_probs", "entropy", "entropy_with_chunking")):
            assert (o.dtype, o.shape) == (v.dtype, v.shape), f"{name}: {o.dtype}{tuple(o.shape)}"
        assert all(torch.equal(leaf.detach(), shard) for leaf in results["ours"][1]), \
            "ours wrote the logits"

        z = full.double()
        lp_ref, h_ref, _ = reference_stats(z, labels)
        b = _flat_bounds(z, group)
        lp_bound = b.logp.gather(-1, labels.reshape(-1, 1)).view(labels.shape)
        h_bound = b.entropy.view(labels.shape)
        u = 0.0 if fp32 else UNIT_ROUNDOFF[dtype]
        for side in ("verl", "ours"):
            assert_within(results[side][0][0], lp_ref, lp_bound,
                          f"{side} log_probs {dtype}")  # fp32 arithmetic on both sides
        # Ours: fp32 (the chunked one), or rounded once to the logits' dtype.
        assert_within(results["ours"][0][2], h_ref, h_bound, f"ours entropy (chunked) {dtype}")
        assert_within(results["ours"][0][1], h_ref, h_bound + u * (h_ref.abs() + h_bound),
                      f"ours entropy {dtype}")
        # verl's entropy works in the logits' dtype (its chunked one too, then stored in fp32):
        # max, log S and E_p[z] are each formed with a few roundings of u (exp, sum, division,
        # product, sum: at most 4 per term) and combined with two more, so |error| <=
        # 6 u (|max| + |log S| + E_p|z|) to first order.
        m = z.amax(-1)
        log_s = torch.logsumexp(z - m.unsqueeze(-1), -1)
        e_abs = (torch.softmax(z, -1) * z.abs()).sum(-1)
        verl_bound = h_bound + 6 * u * (m.abs() + log_s + e_abs)
        assert_within(results["verl"][0][1], h_ref, verl_bound, f"verl entropy {dtype}")
        assert_within(results["verl"][0][2], h_ref, verl_bound, f"verl entropy (chunked) {dtype}")
        if fp32:
            zero = torch.zeros_like(weights[0])
            for i, (w_lp, w_h) in enumerate(((weights[0], zero), (zero, weights[1]),
                                             (zero, weights[2]))):
                g_ref, scale = _objective_grad(z, labels, w_lp, w_h)
                for side in ("verl", "ours"):
                    _grad_close(results[side][1][i].grad, _shard(g_ref, group),
                                _shard(scale, group), f"{side} logits gradient of function {i}")
    # verl's chunked entropy saves each chunk as a view of the logits and its backward writes
    # that view in place, so a backward over two chunks or more fails; ours has one.
    leaf = _shard(torch.randn(2, 5, WIDTH), group).contiguous().requires_grad_()
    with eager():
        try:
            theirs_mod.vocab_parallel_entropy_with_chunking(leaf, chunk_size=2).sum().backward()
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc), str(exc)
        else:
            raise AssertionError("verl's chunked entropy had a backward over 3 chunks")
    integration.apply()
    try:
        ours_mod.vocab_parallel_entropy_with_chunking(leaf, chunk_size=2).sum().backward()
    finally:
        integration.remove()
    assert torch.isfinite(leaf.grad).all()


def _processor_run(modules, shard, labels, w_lp, w_h, *, chunking, grad=True, backward=True):
    """One call of verl's MegatronEngineWithLMHead._lm_head_logits_processor (the real method;
    ``self`` holds only the engine config it reads) and its backward; (outputs, leaf grad).
    Its entropy chunks cover the sequence: verl's chunked entropy has no backward over more than
    one chunk (verl_functions_match_tp2)."""
    engine = modules[ENGINE].MegatronEngineWithLMHead
    config = SimpleNamespace(entropy_from_logits_with_chunking=chunking,
                             entropy_from_logits_chunk_size=labels.shape[1])
    leaf = shard.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        logits = leaf * 1.0  # the model's output: not a leaf (verl divides it in place)
        ret = engine._lm_head_logits_processor(
            SimpleNamespace(engine_config=config), logits, labels, torch.full(labels.shape, 0.8),
            calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=False,
            distillation_only=False, logits_processor_func=None, batch=None, data_format="thd")
    del logits  # as after verl's forward step: only the autograd graph holds it
    if backward:
        ((ret["log_probs"] * w_lp).sum() + (ret["entropy"] * w_h).sum()).backward()
    return ret, leaf.grad


@CASES.register
def verl_engine_processor_tp2(group):
    """verl's Megatron engine (_lm_head_logits_processor: temperature division in place, clone,
    entropy, log-probs), with and without entropy chunking: the same values and logits gradient
    as verl's own functions, both within the float64 bounds."""
    modules, integration, eager = _verl()
    tokens = 6
    full = torch.randn(1, tokens, WIDTH, dtype=torch.float64).float() * 3
    labels = torch.randint(0, WIDTH, (1, tokens))
    w_lp, w_h = torch.rand(1, tokens) + 0.5, torch.rand(1, tokens) + 0.5
    z = full.double() / 0.8
    lp_ref, h_ref, _ = reference_stats(z, labels)
    b = stats_bounds(z.reshape(-1, WIDTH), dz=temperature_dz(full.reshape(-1, WIDTH), 0.8),
                     parts=dist.get_world_size(group))
    g_ref, scale = _objective_grad(z, labels, w_lp.double(), w_h.double())
    g_ref, scale = _shard(g_ref, group) / 0.8, _shard(scale, group) / 0.8
    shard = _shard(full, group).contiguous()
    for chunking in (False, True):
        with eager():
            theirs, g_theirs = _processor_run(modules, shard, labels, w_lp, w_h,
                                              chunking=chunking)
        integration.apply()
        try:
            with count_collectives() as calls:
                ours, g_ours = _processor_run(modules, shard, labels, w_lp, w_h,
                                              chunking=chunking)
        finally:
            integration.remove()
        # Our ops: one all-gather of statistics per call (and one of the checks), no all-reduce.
        assert calls and "all_reduce" not in calls, calls
        for side, ret, grad in (("verl", theirs, g_theirs), ("ours", ours, g_ours)):
            what = f"{side} (chunking={chunking})"
            assert_within(ret["log_probs"], lp_ref,
                          b.logp.gather(-1, labels.view(-1, 1)).view(labels.shape),
                          f"{what} log_probs")
            assert_within(ret["entropy"], h_ref, b.entropy.view(labels.shape),
                          f"{what} entropy")
            _grad_close(grad, g_ref, scale, f"{what} logits gradient")


def _held_bytes(fn) -> int:
    """Bytes alive (MemTracker, CPU) once ``fn()`` has returned, its result still referenced:
    what a forward leaves for its backward."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        result = fn()
        alive = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
    del result
    return int(alive)


@CASES.register
def verl_engine_processor_peak_memory_tp2(group):
    """The engine's log-prob + entropy step on our ops against verl's (MemTracker, CPU, fp32
    logits [1, 256, 1024] = L bytes per rank, our chunk 16: two fp32 [16, W] buffers, L/8):
    the forward peak (verl's compute_log_prob, no grad) is lower by the two [T, W] temporaries
    of verl's entropy (its shifted exp and the product it sums) less our buffers and O(T)
    statistics, so by 1.5 L; what the forward leaves for the backward is lower by verl's saved
    entropy softmax less our buffers, 0.75 L. Forward + backward is printed, not asserted:
    verl's backward reuses its saved softmaxes in place, ours allocates each gradient."""
    from megatron_vocabstats.ops.workspace import reset_workspace

    modules, integration, eager = _verl()
    tokens, width = 256, 2048
    shard = _shard(torch.randn(1, tokens, width) * 3, group).contiguous()
    labels = torch.randint(0, width, (1, tokens))
    w, size = torch.ones(1, tokens), shard.numel() * 4

    def run(**kwargs):
        return lambda: _processor_run(modules, shard, labels, w, w, chunking=False, **kwargs)

    peaks = {}
    for side in ("verl", "ours"):
        if side == "ours":
            integration.apply(logprobs_chunk_size=16)
        try:
            with eager():
                reset_workspace()  # our buffers are allocated inside each measurement
                forward = peak_memory_bytes(run(grad=False, backward=False), shard, labels)
                reset_workspace()
                held = _held_bytes(run(backward=False))
                reset_workspace()
                step = peak_memory_bytes(run(), shard, labels)
            peaks[side] = [round(x / size, 3) for x in (forward, held, step)]
        finally:
            integration.remove()
    print(f"rank {dist.get_rank()}: peak / L (forward, held for backward, forward + backward): "
          f"verl {peaks['verl']}, ours {peaks['ours']}")
    assert peaks["ours"][0] <= peaks["verl"][0] - 1.5, peaks
    assert peaks["ours"][1] <= peaks["verl"][1] - 0.75, peaks


class _SequenceGather(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region`` (all-gather along dim 0 over the tp
    group; backward: reduce-scatter, the sum over the ranks) on CPU tensors: Megatron's own
    allocates its output on the current CUDA device."""

    @staticmethod
    def forward(ctx, shard):
        from megatron.core import parallel_state

        ctx.group = parallel_state.get_tensor_model_parallel_group()
        return _comm.gather_sequence(shard, ctx.group)

    @staticmethod
    def backward(ctx, grad):
        return _comm.reduce_scatter_sequence(grad.clone(), ctx.group)


def _fused_problem(group, tokens=8, hidden_size=16):
    hidden = torch.randn(tokens, 1, hidden_size, dtype=torch.float64).float()
    weight = (torch.randn(WIDTH, hidden_size, dtype=torch.float64) * 0.5).float()
    labels = torch.randint(0, WIDTH, (1, tokens))
    return hidden, weight, labels


@CASES.register
def verl_fused_output_processor_tp2(group):
    """verl's fused path (model_forward_fused.fused_output_processor: the sequence-parallel
    gather of the hidden states, then linear_cross_entropy) on our op: log-probs and entropy of
    verl's kernel (fp32 logits times 1/temperature) within the float64 bounds, and d_hidden
    after verl's gather backward equal to the full dX rows of this rank (our share, summed by
    that reduce-scatter: a full dX would come back tp times too large); without sequence
    parallelism d_hidden is this rank's share, as verl's kernel returns it."""
    modules, integration, _ = _verl()
    fused = modules[FUSED]
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    hidden, weight, labels = _fused_problem(group)
    tokens = hidden.shape[0]
    w_lp, w_h = torch.rand(tokens) + 0.5, torch.rand(tokens) + 0.5
    z, dz = linear_logits_error(hidden.reshape(tokens, -1), weight, WIDTH, 0.7)
    b = stats_bounds(z, dz=dz, parts=tp)
    lp_ref, h_ref, _ = reference_stats(z, labels.view(-1))
    zl = (hidden.double().reshape(tokens, -1) @ weight.double().T).requires_grad_()
    lp, ent, _ = reference_stats(zl / 0.7, labels.view(-1))
    ((lp * w_lp).sum() + (ent * w_h).sum()).backward()
    g = zl.grad
    cols = slice(rank * WIDTH // tp, (rank + 1) * WIDTH // tp)
    share = g[:, cols] @ weight.double()[cols]
    scale = g[:, cols].abs() @ weight.double()[cols].abs()
    integration.apply()
    gather = fused.gather_from_sequence_parallel_region
    fused.gather_from_sequence_parallel_region = _SequenceGather.apply
    try:
        for sp in (True, False):
            rows = slice(rank * tokens // tp, (rank + 1) * tokens // tp) if sp else slice(None)
            h = hidden[rows].clone().requires_grad_()
            w = _shard(weight.T, group).T.contiguous().requires_grad_()
            out = fused.fused_output_processor(
                hidden_states=h, output_layer=SimpleNamespace(weight=w), output_weight=None,
                labels=labels, context=fused.FusedOutputProcessorContext(temperature=0.7),
                config=SimpleNamespace(sequence_parallel=sp))
            assert out.log_probs.shape == (tokens,) and out.log_probs.dtype == torch.float32
            assert_within(out.log_probs, lp_ref, b.logp.gather(-1, labels.view(-1, 1))[:, 0],
                          f"log_probs (sp={sp})")
            assert_within(out.entropy, h_ref, b.entropy, f"entropy (sp={sp})")
            ((out.log_probs * w_lp).sum() + (out.entropy * w_h).sum()).backward()
            if sp:  # verl's gather reduce-scatters our shares: this rank's rows of the full dX
                full = g @ weight.double()
                full_scale = g.abs() @ weight.double().abs()
                _grad_close(h.grad.view(tokens // tp, -1), full[rows], full_scale[rows],
                            "d_hidden after verl's sequence-parallel gather")
            else:
                _grad_close(h.grad.view(tokens, -1), share, scale, "d_hidden: this rank's share")
            _grad_close(w.grad, g[:, cols].T @ hidden.double().view(tokens, -1),
                        g[:, cols].abs().T @ hidden.double().view(tokens, -1).abs(),
                        f"d_weight (sp={sp})")
    finally:
        fused.gather_from_sequence_parallel_region = gather
        integration.remove()


@CASES.register
def verl_linear_cross_entropy_reductions_tp2(group):
    """linear_cross_entropy(..., reduction) as verl's: "sum"/"mean" reduce the log-probs to a
    0-d tensor, the entropy stays per token; an unknown reduction raises ValueError."""
    modules, integration, _ = _verl()
    fn_module = modules["verl.utils.kernel.linear_cross_entropy"]
    hidden, weight, labels = _fused_problem(group)
    w = _shard(weight.T, group).T.contiguous()
    integration.apply()
    try:
        per_token, ent = fn_module.linear_cross_entropy(hidden, w, labels, 1.0, "none", group)
        for reduction, expected in (("sum", per_token.sum()), ("mean", per_token.mean())):
            total, ent2 = fn_module.linear_cross_entropy(hidden, w, labels, 1.0, reduction, group)
            assert total.shape == () and torch.equal(total, expected), reduction
            assert torch.equal(ent2, ent)
        try:
            fn_module.linear_cross_entropy(hidden, w, labels, 1.0, "avg", group)
        except ValueError as exc:
            assert "reduction" in str(exc), str(exc)
        else:
            raise AssertionError("reduction='avg' was accepted")
    finally:
        integration.remove()


if __name__ == "__main__":
    main(CASES)
