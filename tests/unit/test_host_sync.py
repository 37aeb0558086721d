"""No host synchronisation in any hot path, proved on CPU with ``forbid_host_sync``.

Each hot path runs forward and backward inside the guard, which fails on
``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``if t:``), ``.tolist()`` and ops whose output
shape depends on values. Every path is also run once with something that does sync (its
``validate=True`` checks), so the guard is shown to see that path at all. The tensor-parallel
(gloo) variants are in ``dist/batch_invariant_cases.py``; the context-parallel ones in
``dist/packing_cases.py``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from megatron_vocabstats import (
    StatsOptions,
    StepBatch,
    linear_vocab_parallel_cross_entropy,
    linear_vocab_parallel_stats,
    logprobs_step,
    make_forward_step,
    nll_loss,
    policy_loss,
    score_tokens,
    sft_loss,
    shift_packed_labels,
    token_loss,
    unpack_sequences,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
)
from megatron_vocabstats.losses import selected_tokens, token_stats
from megatron_vocabstats.ops.engine import wgrad
from megatron_vocabstats.testing import HostSyncError, forbid_host_sync

MODES = [False, True, "tp"]


@pytest.mark.parametrize("name, fn", [
    ("_local_scalar_dense", lambda x: torch.ops.aten._local_scalar_dense(x[0])),
    ("item", lambda x: x[1].item()),
    ("tolist", lambda x: x.tolist()),
    ("nonzero", lambda x: x.nonzero()),
    ("masked_select", lambda x: x.masked_select(x > 1)),
    ("bool_index", lambda x: x[x > 1]),
    ("unique", lambda x: torch.unique(x)),
    ("repeat_interleave_repeats", lambda x: x.repeat_interleave(x)),
])
def test_guard_rejects_each_listed_sync(name, fn):
    x = torch.tensor([1, 0, 2, 3])
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            fn(x)


def test_guard_allows_repeat_interleave_with_output_size():
    x = torch.tensor([1, 0, 2, 3])
    with forbid_host_sync():
        x.repeat_interleave(x, output_size=6)


def _logits_case(dtype=torch.float32, vocab=70, width=80):
    torch.manual_seed(0)
    logits = (torch.randn(3, 6, width, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, vocab, (3, 6))
    target[0, :2] = -100
    return logits, target


@pytest.mark.parametrize("batch_invariant", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_core_op_and_wrappers_never_sync(dtype, batch_invariant):
    logits, target = _logits_case(dtype)
    opts = dict(vocab_size=70, chunk_size=4, validate=False, batch_invariant=batch_invariant)
    with forbid_host_sync():
        leaf = logits.clone().requires_grad_()
        st = vocab_parallel_stats(leaf, target, temperature=0.7, label_smoothing=0.1, **opts)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        leaf2 = logits.clone().requires_grad_()
        lp = vocab_parallel_logprobs(leaf2, target, **opts)
        ent = vocab_parallel_entropy(leaf2, **opts)
        ce = vocab_parallel_cross_entropy(leaf2, target, 0.1, None, **opts)
        (lp.sum() + ent.sum() + ce.sum()).backward()
    assert leaf.grad is not None and leaf2.grad is not None
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            vocab_parallel_stats(logits, target, **{**opts, "validate": True})


def _fused_case(dtype=torch.float32):
    torch.manual_seed(1)
    hidden = torch.randn(5, 2, 16, dtype=dtype)
    weight = (torch.randn(80, 16) * 0.3).to(dtype)
    target = torch.randint(0, 70, (5, 2))
    target[0, 0] = -100
    return hidden, weight, target


@pytest.mark.parametrize("batch_invariant", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_op_never_syncs(dtype, batch_invariant):
    hidden, weight, target = _fused_case(dtype)
    opts = dict(vocab_size=70, chunk_size=3, validate=False, batch_invariant=batch_invariant)
    with forbid_host_sync():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        st = linear_vocab_parallel_stats(h, w, target, label_smoothing=0.1, temperature=1.3,
                                         **opts)
        (st.logprobs.sum() + st.entropy.sum()).backward()
        # The forward-gradient mode: its backward scale is computed on the device.
        h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        mask = (target != -100).float()
        loss = linear_vocab_parallel_cross_entropy(h2, w2, target, loss_weights=mask, **opts)
        ((loss * mask).sum() / 7.0).backward()
    assert h.grad is not None and w.grad is not None and h2.grad is not None
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            loss = linear_vocab_parallel_cross_entropy(
                h2, w2, target, loss_weights=mask, **{**opts, "validate": True})


def test_fused_op_wgrad_probe_is_skipped_during_capture(monkeypatch):
    # The CUDA probe reads a value on the host; during a capture it must not run at all.
    monkeypatch.setattr(wgrad, "_WGRAD_MODES", {})
    monkeypatch.setattr(wgrad, "capturing", lambda: True)
    monkeypatch.setattr(wgrad, "_probe_wgrad_mode", lambda device_type: 1 / 0)
    assert wgrad.wgrad_mode("cuda") == "upcast"
    assert wgrad._WGRAD_MODES == {}


def test_packing_step_functions_never_sync():
    tokens = torch.tensor([[5, 6, 7, 0, 8, 9, 0, 0]])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_p = torch.tensor([0, 4, 8], dtype=torch.int32)
    with forbid_host_sync():
        labels, mask = shift_packed_labels(tokens, cu, cu_seqlens_padded=cu_p, validate=False)
        rows, row_mask = unpack_sequences(labels.float(), cu, max_seqlen=4,
                                          cu_seqlens_padded=cu_p, validate=False)
    assert rows.shape == (1, 2, 4) and row_mask.shape == (2, 4)


def _loss_inputs():
    logits, target = _logits_case()
    labels = target.clamp(min=0)
    mask = torch.ones(3, 6)
    mask[2, 3:] = 0
    return logits, labels, mask


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=80, hidden=8):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.output_layer = torch.nn.Linear(hidden, vocab, bias=False)
        self.tp_group = None

    def forward(self, input_ids):
        return self.output_layer(self.embedding(input_ids))


@pytest.mark.parametrize("batch_invariant", MODES)
def test_losses_and_forward_step_never_sync(batch_invariant):
    logits, labels, mask = _loss_inputs()
    per_token = torch.randn(3, 6)
    model = _TinyLM()
    options = StatsOptions(vocab_size=70, chunk_size=4, entropy="grad",
                           batch_invariant=batch_invariant)
    batch = StepBatch({"input_ids": labels}, labels, mask,
                      {"old_logprobs": per_token, "advantages": per_token.flip(0)})
    step = make_forward_step(lambda it: batch, functools.partial(policy_loss, entropy_coef=0.01),
                             stats=options)
    hidden = torch.randn(3, 6, 16)
    weight = torch.randn(80, 16) * 0.3
    with forbid_host_sync():
        leaf = logits.clone().requires_grad_()
        out = sft_loss(leaf, labels, mask, vocab_size=70, label_smoothing=0.1, entropy="metric",
                       batch_invariant=batch_invariant)
        (out.loss_sum / out.num_tokens.clamp(min=1)).backward()
        nll_loss(per_token, mask, entropy=per_token.abs())
        score_tokens(per_token, mask, entropy=per_token.abs())
        sel = selected_tokens(labels, mask)
        token_stats(logits, labels, sel, options=options)
        fused = functools.partial(linear_vocab_parallel_stats, hidden, weight)
        token_loss(fused, labels, mask, loss_fn=nll_loss, options=options)
        with torch.no_grad():
            logprobs_step(logits, labels, mask, vocab_size=70, batch_invariant=batch_invariant)
        output, loss_fn = step(iter(()), model)
        result = loss_fn(output)
        result.loss_sum.backward()
    assert leaf.grad is not None and model.output_layer.weight.grad is not None
