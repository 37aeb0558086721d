"""Single-process tests of linear_vocab_parallel_stats (the fused LM head) against float64.

The tensor-parallel and sequence-parallel cases are in ``dist/fused_linear_cases.py`` (run by
``test_fused_linear_dist.py``); its reference helpers are reused here with ``group=None``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist.fused_linear_cases import (
    assert_close,
    make_problem,
    megatron_like_weight,
    reference_linear,
    run_and_check,
)
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.ops.engine.linear import auto_linear_chunk_size
from megatron_vocabstats.ops.stats.from_hidden import (
    linear_vocab_parallel_cross_entropy,
    linear_vocab_parallel_stats,
)
from megatron_vocabstats.profiling import peak_memory_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 0.6}, {"label_smoothing": 0.1}, {"vocab_size": 97},
     {"entropy": "off", "chunk_size": 1}, {"forward_grad": True, "temperature": 1.3},
     {"sequence_parallel": True}],
    ids=["plain", "temperature", "label_smoothing", "padded_vocab", "logprob_only_chunk1",
         "forward_grad", "sequence_parallel_tp1"],
)
def test_matches_float64_reference(dtype, options):
    run_and_check(None, dtype=dtype, **options)


def _chunked_logits(hidden2d, weight, chunk):
    return torch.cat([hidden2d[i:i + chunk] @ weight.T for i in range(0, hidden2d.shape[0], chunk)])


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_unfused_op_on_the_same_logits(dtype, chunk):
    """Values and dX bitwise equal to vocab_parallel_stats on the chunk products; dW within
    fp32 summation order (then one rounding); versus one full matmul within 2 max|dlogit| / tau."""
    torch.manual_seed(0)
    hidden = torch.randn(17, 24).to(dtype)
    weight = (torch.randn(64, 24) * 0.5).to(dtype)
    target = torch.randint(0, 60, (17,))
    target[3] = -100
    w_lp, w_h = torch.rand(17) + 0.5, torch.randn(17)
    opts = dict(vocab_size=60, temperature=0.8, label_smoothing=0.05)

    h_leaf, w_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = linear_vocab_parallel_stats(h_leaf, w_leaf, target, chunk_size=chunk, **opts)
    (ours.logprobs * w_lp + ours.entropy * w_h).sum().backward()

    logits = _chunked_logits(hidden, weight, chunk).requires_grad_()
    theirs = vocab_parallel_stats(logits, target, chunk_size=7, **opts)
    (theirs.logprobs * w_lp + theirs.entropy * w_h).sum().backward()
    g = logits.grad
    for a, b in zip(ours[:3], theirs[:3]):
        assert torch.equal(a, b)
    assert torch.equal(h_leaf.grad, _chunked_logits(g, weight.T, chunk))
    dw = sum(g[i:i + chunk].float().T @ hidden[i:i + chunk].float()
             for i in range(0, 17, chunk))
    scale = g.float().abs().T @ hidden.float().abs()  # sum_i |g_i| |h_i|
    # Same n fp32 products in 2 orders (each within gamma_n * scale), ours then rounded once (u_d).
    u, n, u_d = 2**-24, 17, torch.finfo(dtype).eps / 2
    gamma_n = n * u / (1 - n * u)
    assert_close(w_leaf.grad, dw, rtol=1.0, atol=0,
                 scale=u_d * dw.abs() + (1 + u_d) * 2 * gamma_n * scale, what="weight gradient")

    full = vocab_parallel_stats(hidden @ weight.T, target, **opts)
    bound = 2 * (hidden @ weight.T - logits.detach()).abs().max() / opts["temperature"]
    assert (full.logprobs - ours.logprobs).abs().max() <= bound + (1e-6 if bound else 0)


def test_all_ignored_batch_has_exactly_zero_gradients():
    hidden, weight, target = make_problem(1, ignore=range(15))
    h_leaf, w_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    st = linear_vocab_parallel_stats(h_leaf, w_leaf, target, vocab_size=101, chunk_size=4)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert torch.equal(st.logprobs, torch.zeros(5, 3))
    assert torch.equal(st.entropy, torch.zeros(5, 3))
    assert torch.equal(h_leaf.grad, torch.zeros_like(hidden))
    assert torch.equal(w_leaf.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("forward_grad", [False, True])
def test_out_of_range_targets_without_validate_are_nan_with_no_gradient(forward_grad):
    """As in the unfused op: a target outside [0, V) (padding id 101, 10**6, -1) gives a NaN
    logprob that passes no gradient, never a finite -logsumexp."""
    hidden, weight, target = make_problem(1, vocab=101, ignore=())
    bad = [1, 4, 9]
    target.view(-1)[bad] = torch.tensor([101, 10**6, -1])
    h_leaf, w_leaf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    mask = torch.ones(target.shape)
    st = linear_vocab_parallel_stats(h_leaf, w_leaf, target, vocab_size=101, chunk_size=4,
                                     entropy="off", validate=False,
                                     grad_weights=mask if forward_grad else None)
    st.logprobs.nan_to_num(0.0).sum().backward()
    lp = st.logprobs.view(-1)
    assert bool(lp[bad].isnan().all()) and bool(lp[[0, 2, 3]].isfinite().all())
    assert torch.equal(h_leaf.grad.view(-1, hidden.shape[-1])[bad],
                       torch.zeros(3, hidden.shape[-1]))


def test_cross_entropy_wrapper_is_minus_logprobs():
    hidden, weight, target = make_problem(1)
    loss = linear_vocab_parallel_cross_entropy(hidden, weight, target, vocab_size=101)
    st = linear_vocab_parallel_stats(hidden, weight, target, vocab_size=101, entropy="off")
    assert torch.equal(loss, -st.logprobs) and loss.view(-1)[0].item() == 0.0


@pytest.mark.parametrize("main_grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("forward_grad", [False, True], ids=["recompute", "forward_grad"])
def test_main_grad_contract(main_grad_dtype, forward_grad):
    hidden, weight, target = make_problem(1, dtype=torch.bfloat16)
    mask = torch.ones(target.shape)
    param = megatron_like_weight(weight, zero_out_wgrad=False, main_grad_dtype=main_grad_dtype)
    param.main_grad.fill_(0.25)  # earlier micro-batches: kept and added to
    loss = linear_vocab_parallel_cross_entropy(hidden, param, target, vocab_size=101,
                                               chunk_size=4, accumulate_into_main_grad=True,
                                               loss_weights=mask if forward_grad else None)
    loss.sum().backward()
    ref = reference_linear(hidden, weight, target, dtype=torch.bfloat16, w_lp=-mask,
                           vocab_size=101)
    assert param.grad_added_to_main_grad is True
    assert param.grad.shape == weight.shape and param.grad.dtype == weight.dtype  # the dummy
    tol = 2**-7 if main_grad_dtype == torch.float32 else 2**-6
    assert_close(param.main_grad, ref["dw"] + 0.25, rtol=tol, atol=1e-6,
                 scale=ref["dw_scale"] + 0.25, what="main_grad")


def test_main_grad_without_megatron_flag_returns_no_grad():
    hidden, weight, target = make_problem(1)
    param = torch.nn.Parameter(weight.clone())
    param.main_grad = torch.zeros_like(weight)
    linear_vocab_parallel_stats(hidden, param, target, vocab_size=101, entropy="off",
                                accumulate_into_main_grad=True).logprobs.sum().backward()
    assert param.grad is None and param.main_grad.abs().sum() > 0


def test_forward_grad_rejects_a_non_proportional_upstream_gradient():
    hidden, weight, target = make_problem(1)
    h_leaf = hidden.clone().requires_grad_()
    w = torch.rand(target.shape) + 0.5
    st = linear_vocab_parallel_stats(h_leaf, weight, target, vocab_size=101, grad_weights=w,
                                     entropy="off")
    with pytest.raises(ValueError, match="not a scalar multiple of grad_weights"):
        (st.logprobs * torch.rand(target.shape)).sum().backward()


@pytest.mark.parametrize("leaves", ["hidden", "both"])
def test_forward_grad_backward_runs_once_and_zero_weights_give_zero_grads(leaves):
    # "both": the weight-gradient sums are scaled in place, which used to surface as torch's
    # saved-tensor version error on the second backward.
    hidden, weight, target = make_problem(1)
    h_leaf = hidden.clone().requires_grad_()
    w_leaf = weight.clone().requires_grad_(leaves == "both")
    st = linear_vocab_parallel_stats(h_leaf, w_leaf, target, vocab_size=101, entropy="off",
                                     grad_weights=torch.zeros(target.shape))
    loss = (st.logprobs * torch.zeros(target.shape)).sum()  # the loss these weights describe
    loss.backward(retain_graph=True)
    assert torch.equal(h_leaf.grad, torch.zeros_like(hidden))
    if leaves == "both":
        assert torch.equal(w_leaf.grad, torch.zeros_like(weight))
    with pytest.raises(RuntimeError, match="linear_vocab_parallel_stats: .* backward runs once "
                                           "per forward"):
        loss.backward()


@pytest.mark.parametrize("frozen", ["hidden", "weight", "both"])
def test_only_requested_gradients(frozen):
    hidden, weight, target = make_problem(1)
    h = hidden.clone().requires_grad_(frozen == "weight")
    w = weight.clone().requires_grad_(frozen == "hidden")
    if frozen == "both":
        with torch.no_grad():
            st = linear_vocab_parallel_stats(h, w, target, vocab_size=101,
                                             grad_weights=torch.ones(target.shape),
                                             entropy="off")
        assert not st.logprobs.requires_grad
        return
    st = linear_vocab_parallel_stats(h, w, target, vocab_size=101)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    assert (h.grad is None) == (frozen == "hidden") and (w.grad is None) == (frozen == "weight")


def _fused_step(hidden, weight, target, **options):
    def run():
        st = linear_vocab_parallel_stats(hidden, weight, target, **options)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        hidden.grad = weight.grad = None

    return run


def _inputs(tokens, width=2048, hidden_size=64):
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(width, hidden_size) / 8).to(torch.bfloat16).requires_grad_()
    return hidden, weight, torch.randint(0, width, (tokens,))


def _grad_and_input_bytes(hidden, weight, target):
    return 2 * (hidden.numel() + weight.numel()) * 2 + target.numel() * 8


def test_peak_memory_has_no_logits_and_temperature_copies_nothing():
    tokens, width, hidden_size, chunk = 512, 2048, 64, 32
    hidden, weight, target = _inputs(tokens, width, hidden_size)
    peaks = {t: peak_memory_bytes(_fused_step(hidden, weight, target, chunk_size=chunk,
                                              temperature=t), hidden, weight, target)
             for t in (1.0, 0.7)}
    assert peaks[0.7] == peaks[1.0], f"temperature changed the peak: {peaks}"
    # Chunk buffers (bf16 + 2 fp32 [chunk, W], fp32 [chunk, H]), fp32 dW sums, [T] vectors.
    # The bf16 logits alone would be tokens * width * 2 = 2 MiB, more than the slack.
    workspace = 10 * chunk * width + 4 * chunk * hidden_size + 4 * width * hidden_size
    bound = 1.05 * (_grad_and_input_bytes(hidden, weight, target) + workspace + 64 * tokens * 4)
    assert peaks[1.0] <= bound, f"peak {peaks[1.0]} B exceeds {bound:.0f} B"


def test_workspace_does_not_grow_with_tokens():
    workspaces = {}
    for tokens in (256, 1024):
        hidden, weight, target = _inputs(tokens)
        peak = peak_memory_bytes(_fused_step(hidden, weight, target, chunk_size=32),
                                 hidden, weight, target)
        workspaces[tokens] = peak - _grad_and_input_bytes(hidden, weight, target)
    slope = (workspaces[1024] - workspaces[256]) / (1024 - 256)
    # Allowance: the [T] fp32 vectors (stats [5, T], gathered, outputs, masks): < 128 B/token.
    # Materialised bf16 logits would add 2 * W = 4096 B/token.
    assert slope <= 128, f"workspace grows by {slope:.0f} B per token: {workspaces}"


def test_auto_chunk_size():
    assert auto_linear_chunk_size(76032, torch.device("cpu")) == 64 * 2**20 // (4 * 76032)
    hidden, weight, target = make_problem(1)
    default = linear_vocab_parallel_stats(hidden, weight, target, vocab_size=101)
    chunked = linear_vocab_parallel_stats(hidden, weight, target, vocab_size=101, chunk_size=2)
    for a, b in zip(default[:3], chunked[:3]):
        assert_close(a, b, rtol=1e-6, atol=1e-6, what="auto vs explicit chunk")


def _bad(**changes):
    hidden, weight, target = make_problem(1)
    args = dict(hidden=hidden, weight=weight, target=target)
    args.update({k: v(args[k]) if callable(v) and k in args else v for k, v in changes.items()})
    return lambda: linear_vocab_parallel_stats(args.pop("hidden"), args.pop("weight"),
                                               args.pop("target"), vocab_size=101, **args)


@pytest.mark.parametrize(
    "call, match",
    [
        (_bad(hidden=lambda h: h[..., :-1]), "hidden size"),
        (_bad(hidden=lambda h: h[..., :0], weight=lambda w: w[:, :0]),
         "hidden: the hidden dimension is empty"),
        (_bad(weight=lambda w: w.double()), "weight dtype"),
        (_bad(hidden=lambda h: h.double(), weight=lambda w: w.double()), "hidden must be bf16"),
        (_bad(weight=lambda w: w[0]), "weight must be the 2-D"),
        (_bad(weight=lambda w: w[None]), "weight must be the 2-D"),
        (_bad(hidden=lambda h: h.numpy()), "hidden must be a tensor"),
        (_bad(target=lambda t: t[:, :2]), "target shape"),
        (_bad(target=lambda t: t.float()), "target must hold integer"),
        (_bad(grad_weights=torch.ones(5, 2), entropy="off"), "grad_weights shape"),
        (_bad(grad_weights=torch.ones(5, 3)), "entropy='grad' cannot"),
        (_bad(target=lambda t: None, grad_weights=torch.ones(5, 3), entropy="off"),
         "grad_weights needs a target"),
        (_bad(accumulate_into_main_grad=True), "weight.main_grad"),
        (_bad(sequence_parallel=1), "sequence_parallel must be a bool"),
        (_bad(chunk_size=0), "chunk_size"),
        (_bad(temperature=-1.0), "temperature"),
        (_bad(target=lambda t: t + 200), "target holds id"),
        (_bad(argmax=1), "argmax must be a bool"),
        (_bad(argmax=True, grad_weights=torch.ones(5, 3), entropy="off"),
         "argmax=True cannot be combined with grad_weights"),
        (_bad(argmax=np.True_, grad_weights=torch.ones(5, 3), entropy="off"),
         "argmax=True cannot be combined with grad_weights"),
    ],
    ids=["hidden_size", "hidden_size_0", "dtype_mismatch", "dtype", "weight_1d", "weight_3d",
         "hidden_not_tensor", "target_shape", "float_target", "grad_weights_shape",
         "grad_weights_entropy", "grad_weights_no_target", "main_grad_missing",
         "sequence_parallel_type", "chunk", "temperature", "target_range", "argmax_type",
         "argmax_grad_weights", "np_argmax_grad_weights"],
)
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_argmax_refused_by_the_triton_statistics(monkeypatch):
    """The argmax row is the torch statistics' own: a kernel resolving to "triton" is refused
    with the argument named (checked with the resolution stubbed: no triton needed)."""
    from megatron_vocabstats.ops import _checks

    monkeypatch.setattr(_checks, "resolve_kernel", lambda kernel, device: "triton")
    with pytest.raises(ValueError, match="argmax=True is computed by the torch"):
        _bad(argmax=True)()
    with pytest.raises(ValueError, match="argmax=True is computed by the torch"):
        vocab_parallel_stats(torch.randn(3, 8), torch.tensor([1, 2, 3]), argmax=True)


def test_argmax_is_an_optional_field_of_the_one_result_type():
    """``argmax=True`` fills ``VocabStats.argmax`` (int64, ties to the lowest id, padding never
    wins) and changes no other field, from logits and from hidden states; without it the
    field is None and the type is the same."""
    hidden, weight, target = make_problem(1)
    logits = hidden @ weight.T
    logits[0, :] = 0.0  # a row of ties: the lowest id wins
    for stats in (lambda **kw: vocab_parallel_stats(logits, target, vocab_size=101, **kw),
                  lambda **kw: linear_vocab_parallel_stats(hidden, weight, target,
                                                           vocab_size=101, **kw)):
        plain, with_argmax = stats(), stats(argmax=True)
        assert type(plain) is type(with_argmax) and plain.argmax is None
        for a, b in zip(plain[:3], with_argmax[:3]):
            assert torch.equal(a, b)
        assert with_argmax.argmax.dtype == torch.int64
        assert with_argmax.argmax.shape == target.shape
    full = vocab_parallel_stats(logits, target, vocab_size=101, argmax=True).argmax
    assert (full[0] == 0).all() and torch.equal(full[1:], logits[1:].argmax(-1))

