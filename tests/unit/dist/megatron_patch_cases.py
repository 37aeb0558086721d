"""A tiny Megatron-Core GPTModel on tp gloo ranks: the patched loss equals Megatron's own.

Run by tests/unit/test_megatron_patch_dist.py (marked ``megatron``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main

CASES = Cases()
VOCAB, SEQ, BATCH = 250, 12, 2


def tiny_gpt(tp: int, *, seed: int = 7, share_embeddings_and_output_weights=False, **config):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vocabstats.testing.megatron_cpu import install_cpu_shims

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    install_cpu_shims()
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp,
                            params_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, **config)
    # The vocabulary is padded to a multiple of 128 * tp, as Megatron-LM does.
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=padded, max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=share_embeddings_and_output_weights)


def batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return ids, pos, labels


def loss_and_grads(model):
    ids, pos, labels = batch()
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=labels)
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare_with_native(*, options, spy, **gpt_config):
    """Loss and gradients of one tiny GPT without, then with, the patch (``options``)."""
    import megatron_vocabstats.ops.fused_linear as fused_module
    from megatron_vocabstats import patch
    from megatron_vocabstats.megatron import model as patched_model

    owner = fused_module if spy == "linear_vocab_parallel_stats" else patched_model
    model = tiny_gpt(dist.get_world_size(), **gpt_config)
    patch.remove()
    native_loss, native_grads = loss_and_grads(model)
    calls = []
    original = getattr(owner, spy)
    setattr(owner, spy, lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        patch.apply(**options)
        ours_loss, ours_grads = loss_and_grads(model)
    finally:
        setattr(owner, spy, original)
        patch.remove()
    assert calls, f"the loss call site did not reach {spy}"
    assert ours_loss.shape == native_loss.shape == (BATCH, SEQ)
    err = (ours_loss - native_loss).abs().max().item()
    assert err <= 1e-5 * native_loss.abs().max().item(), f"per-token loss differs by {err}"
    for name, grad in native_grads.items():
        diff = (ours_grads[name] - grad).abs().max().item()
        scale = grad.abs().max().item()
        assert diff <= 1e-5 * max(scale, 1e-3), f"{name}: gradient differs by {diff} (max {scale})"


@CASES.register
def patched_loss_and_grads_equal_megatron(group):
    compare_with_native(options={}, spy="vocab_parallel_stats")


@CASES.register
def fused_head_equals_megatron(group):
    compare_with_native(options={"lm_head_chunk_size": 5}, spy="linear_vocab_parallel_stats")


@CASES.register
def fused_head_tied_embeddings(group):
    # Sequence parallelism is covered by the fused op's own tests: Megatron's CPU layer spec
    # (torch LayerNorm) refuses sequence_parallel without apex or transformer-engine.
    compare_with_native(options={"lm_head_chunk_size": 7}, spy="linear_vocab_parallel_stats",
                        share_embeddings_and_output_weights=True)


@CASES.register
def fused_setting_keeps_logits_requests_native(group):
    from megatron_vocabstats import patch

    model = tiny_gpt(dist.get_world_size())
    ids, pos, _ = batch()
    patch.remove()
    with torch.no_grad():
        native = model(ids, pos, None)
        patch.apply(lm_head_chunk_size=5)
        try:
            ours = model(ids, pos, None)
        finally:
            patch.remove()
    assert ours.shape == native.shape and torch.equal(ours, native), "logits path changed"


if __name__ == "__main__":
    main(CASES)
