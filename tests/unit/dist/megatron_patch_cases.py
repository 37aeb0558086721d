"""A tiny Megatron-Core GPTModel (and HybridModel) on tp gloo ranks: the patched loss equals
Megatron's own, fused and unfused, with MTP heads too.

Run by tests/unit/test_megatron_patch_dist.py (marked ``megatron``). fp32 throughout: the plugin's
chunked statistics sum the same terms in another order (a few ulps), so losses, gradients and the
logged MTP losses agree with Megatron's to 1e-5 relative, and the MTP acceptance counts (argmax
== label) exactly (the fused chunks' logits differ from Megatron's by ~1 ulp, and no two logits of
these random problems lie that close).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main

CASES = Cases()
VOCAB, SEQ, BATCH = 250, 12, 2


def tiny_config(tp: int, *, seed: int = 7, **config):
    """The TransformerConfig of the tiny models (model parallelism and CPU shims set up, the
    seed set); a field this release lacks raises ``Skip``."""
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vocabstats.testing.megatron_cpu import install_cpu_shims

    missing = set(config) - {f.name for f in dataclasses.fields(TransformerConfig)}
    if missing:
        raise Skip(f"TransformerConfig of this megatron-core has no {sorted(missing)}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    install_cpu_shims()
    torch.manual_seed(seed)
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                             use_cpu_initialization=True, tensor_model_parallel_size=tp,
                             params_dtype=torch.float32, hidden_dropout=0.0,
                             attention_dropout=0.0, **config)


def padded_vocab(tp: int) -> int:
    """The vocabulary padded to a multiple of 128 * tp, as Megatron-LM does."""
    return -(-VOCAB // (128 * tp)) * 128 * tp


def tiny_gpt(tp: int, *, seed: int = 7, share_embeddings_and_output_weights=False, **config):
    """A 2-layer GPT; with ``mtp_num_layers`` its MTP heads too (rope positions, as MTP needs)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    cfg = tiny_config(tp, seed=seed, **config)
    spec = get_gpt_layer_local_spec()
    mtp = {}
    if cfg.mtp_num_layers:
        mtp = dict(position_embedding_type="rope",
                   mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(tp),
                    max_sequence_length=SEQ,
                    share_embeddings_and_output_weights=share_embeddings_and_output_weights, **mtp)


def tiny_hybrid(tp: int, *, seed: int = 7, mtp_num_layers: int | None = None):
    """A 2-layer ``HybridModel`` (0.18+; ``MambaModel`` before) of attention layers (Megatron's
    local GPT layer spec: Mamba's kernels need CUDA) without the final norm (the stack builds it
    with transformer-engine). ``mtp_num_layers``: that many MTP depths of one attention layer each
    (pattern ``**/*/*``, rope positions, local norms; 0.18+ only, else ``Skip``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = tiny_config(tp, seed=seed, **({"mtp_num_layers": mtp_num_layers} if mtp_num_layers
                                        else {}))
    common = dict(config=cfg, vocab_size=padded_vocab(tp), max_sequence_length=SEQ,
                  position_embedding_type="rope" if mtp_num_layers else "learned_absolute")
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel
    except ImportError:  # 0.16-0.17
        if mtp_num_layers:
            raise Skip("this megatron-core has no HybridModel (its MambaModel takes no MTP "
                       "layer pattern)") from None
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules

        spec = ModuleSpec(module=MambaStack, params={"post_layer_norm": False},
                          submodules=MambaStackSubmodules(
                              attention_layer=get_gpt_layer_local_spec()))
        return MambaModel(mamba_stack_spec=spec, hybrid_override_pattern="**", **common)
    layer = get_gpt_layer_local_spec()
    mtp = {}
    if mtp_num_layers:  # the depths' layers come from the pattern; their norms from the spec
        mtp = dict(mtp_block_spec=get_gpt_mtp_block_spec(cfg, layer,
                                                         use_transformer_engine=False))
    spec = ModuleSpec(module=HybridStack, params={"post_layer_norm": False},
                      submodules=HybridStackSubmodules(attention_layer=layer, **mtp))
    pattern = "/".join(["**"] + ["*"] * (mtp_num_layers or 0))
    return HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern=pattern, **common)


def batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return ids, pos, labels


def uneven_loss_mask():
    """A loss mask whose rows keep different token counts (and one masked run inside a row)."""
    mask = torch.ones(BATCH, SEQ)
    mask[0, 3:6] = 0.0
    mask[1, -2:] = 0.0
    return mask


def fresh_mtp_tracker(depths: int) -> dict:
    """Megatron's MTP logging tracker, emptied, with its accumulators made on the CPU (Megatron
    makes them on ``torch.cuda.current_device()``): 0.17-0.18 ``values``, 0.19 ``loss_values``,
    ``correct_values``, ``total_values``."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    tracker.clear()
    acceptance = hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker")
    for key in ("loss_values", "correct_values", "total_values") if acceptance else ("values",):
        tracker[key] = torch.zeros(depths)
    return tracker


def loss_and_grads(model, mask=None, labels=None):
    """One forward and backward: ``(per-token loss, {param: grad}, {tracker key: values})``.

    Rotary embeddings (MTP's) move their frequencies to ``torch.cuda.current_device()``: device 0,
    which the factory mode maps to the CPU (the training loop's shims do the same)."""
    from megatron_vocabstats.testing.megatron_cpu import cuda_factories_on_cpu

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: 0
    ids, pos, random_labels = batch()
    labels = random_labels if labels is None else labels
    depths = model.config.mtp_num_layers or 0
    tracker = fresh_mtp_tracker(depths) if depths else {}
    model.zero_grad(set_to_none=True)
    with cuda_factories_on_cpu():
        loss = model(ids, pos, None, labels=labels,
                     **({} if mask is None else {"loss_mask": mask}))
    weights = torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)
    (loss * weights).sum().backward()
    logged = {k: v.clone() for k, v in tracker.items() if isinstance(v, torch.Tensor)}
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}, logged


def close(ours, theirs, what, rtol=1e-5):
    err = (ours - theirs).abs().max().item()
    scale = max(theirs.abs().max().item(), 1e-3)
    assert err <= rtol * scale, f"{what} differs by {err} (max {scale})"


def accepted_labels(model, mask):
    """Labels that the MTP heads of ``model`` (plugin off) predict at some positions: depth 1's
    top-1 at every 4th label, depth 2's at the ones 2 further (the heads' inputs do not depend
    on the labels), so that the acceptance counts are not all 0."""
    group = dist.group.WORLD
    logits = []
    hook = model.output_layer.register_forward_hook(
        lambda _module, _args, out: logits.append(out[0].detach()))
    try:
        loss_and_grads(model, mask)
    finally:
        hook.remove()
    labels = batch()[2].clone()
    for depth, shard in enumerate(logits[:-1], start=1):  # the MTP depths, then the main head
        shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, shard.contiguous(), group=group)
        top1 = torch.cat(shards, dim=-1)[..., :VOCAB].argmax(dim=-1).transpose(0, 1)  # [b, s]
        for j in range(2 * depth, SEQ, 4):
            labels[:, j] = top1[:, j - depth]
    return labels


def compare_with_native(*, options, spy, model=None, mask=None, labels=None, **gpt_config):
    """Loss, gradients and MTP log of one tiny model without, then with, the patch
    (``options``): ``spy`` must have been called, and, with the fused head, Megatron's output
    layer never have produced logits, yet its forward pre-hooks (the distributed optimizer's
    and FSDP's parameter gather) have run as often as without the patch. Returns
    ``(calls of spy, model)``."""
    import megatron_vocabstats.ops.stats.from_hidden as fused_module
    from megatron_vocabstats import patch
    from megatron_vocabstats.megatron import model as patched_model

    owner = fused_module if spy == "linear_vocab_parallel_stats" else patched_model
    model = model or tiny_gpt(dist.get_world_size(), **gpt_config)
    patch.remove()
    pre_hooks = []
    pre_hook = model.output_layer.register_forward_pre_hook(lambda *_: pre_hooks.append(1))
    native_loss, native_grads, native_log = loss_and_grads(model, mask, labels)
    native_pre_hooks, pre_hooks[:] = len(pre_hooks), []
    calls, logits_made = [], []
    original = getattr(owner, spy)
    setattr(owner, spy, lambda *a, **k: calls.append(1) or original(*a, **k))
    hook = model.output_layer.register_forward_hook(
        lambda _module, _args, out: logits_made.append(isinstance(out[0], torch.Tensor)))
    try:
        patch.apply(**options)
        ours_loss, ours_grads, ours_log = loss_and_grads(model, mask, labels)
    finally:
        setattr(owner, spy, original)
        hook.remove()
        pre_hook.remove()
        patch.remove()
    assert len(pre_hooks) == native_pre_hooks > 0, (
        f"the output layer's forward pre-hooks ran {len(pre_hooks)} times, Megatron's own path "
        f"{native_pre_hooks}")
    assert calls, f"the loss call site did not reach {spy}"
    if options.get("lm_head_chunk_size"):
        assert not any(logits_made), f"the output layer made logits {sum(logits_made)} times"
    assert ours_loss.shape == native_loss.shape == (BATCH, SEQ)
    close(ours_loss, native_loss, "per-token loss")
    assert ours_grads.keys() == native_grads.keys()
    for name, grad in native_grads.items():
        close(ours_grads[name], grad, f"{name} gradient")
    assert ours_log.keys() == native_log.keys()
    if "correct_values" in native_log:
        assert native_log["correct_values"].min() > 0, "no accepted token: a weak test"

    for key, values in native_log.items():
        if key in ("correct_values", "total_values"):  # counts: equal
            assert torch.equal(ours_log[key], values), f"{key}: {ours_log[key]} vs {values}"
        else:
            close(ours_log[key], values, f"MTP tracker {key}")
    return len(calls), model


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


def compare_mtp(chunk: int, model=None, **gpt_config):
    """A tiny GPT (or ``model``) with MTP heads, fused (``lm_head_chunk_size=chunk``) against
    Megatron, on the uneven loss mask and labels some of which the heads accept; the fused op
    must run once per head. Returns ``(model, mask, labels)``."""
    from megatron_vocabstats import patch

    mask = uneven_loss_mask()
    model = model or tiny_gpt(dist.get_world_size(), **gpt_config)
    patch.remove()
    labels = accepted_labels(model, mask)
    calls, _ = compare_with_native(options={"lm_head_chunk_size": chunk},
                                   spy="linear_vocab_parallel_stats", mask=mask, labels=labels,
                                   model=model)
    heads = 1 + model.config.mtp_num_layers
    assert calls == heads, f"fused op called {calls} times, not once per head ({heads})"
    return model, mask, labels


@CASES.register
def mtp_fused_equals_megatron(group):
    """Two MTP depths, a loss mask with uneven counts per row: main and MTP losses, every
    gradient, the logged MTP losses and (0.19) acceptance counts equal Megatron's; the fused op
    runs once per head (main + 2 depths) and Megatron's output layer never; the per-depth
    statistics equal the unfused plugin's."""
    from megatron_vocabstats import patch
    from megatron_vocabstats.megatron.model import LAST_MTP_STATS_ATTR

    model, mask, labels = compare_mtp(5, mtp_num_layers=2)
    fused_depths = getattr(model, LAST_MTP_STATS_ATTR, None)
    if fused_depths is None:  # 0.16: the MTP loss is inline in GPTModel._postprocess
        return
    patch.apply()
    try:
        loss_and_grads(model, mask, labels)
    finally:
        patch.remove()
    unfused_depths = getattr(model, LAST_MTP_STATS_ATTR)
    assert len(fused_depths) == len(unfused_depths) == 2
    for ours, theirs in zip(fused_depths, unfused_depths):
        assert ours.logprobs.shape == (BATCH, SEQ)
        close(ours.logprobs, theirs.logprobs, "per-depth logprobs")


@CASES.register
def mtp_fused_per_token_loss_detached_heads_mup(group):
    """One MTP depth with calculate_per_token_loss, mtp_detach_heads and MuP's output
    multiplier (0.5, a logit scale) on tied embeddings: equal to Megatron's, fused."""
    compare_mtp(7, mtp_num_layers=1, calculate_per_token_loss=True, mtp_detach_heads=True,
                use_mup=True, mup_base_hidden_size=16, share_embeddings_and_output_weights=True)


@CASES.register
def hybrid_model_fused_and_unfused_equal_megatron(group):
    """HybridModel (0.18+; MambaModel on 0.16-0.17): the plugin's loss, unfused and through the
    fused head (its forward has no output hook: the output layer is deferred), equals
    Megatron's."""
    model = tiny_hybrid(dist.get_world_size())
    compare_with_native(options={}, spy="vocab_parallel_stats", model=model)
    calls, _ = compare_with_native(options={"lm_head_chunk_size": 5},
                                   spy="linear_vocab_parallel_stats", model=model)
    assert calls == 1


@CASES.register
def hybrid_model_mtp_fused_equals_megatron(group):
    """HybridModel with two MTP depths (0.18+): the fused head at every depth equals Megatron's
    loss, gradients, MTP log and acceptance counts, the fused op running once per head."""
    from megatron_vocabstats.megatron.model import LAST_MTP_STATS_ATTR

    model, _, _ = compare_mtp(5, model=tiny_hybrid(dist.get_world_size(), mtp_num_layers=2))
    assert len(getattr(model, LAST_MTP_STATS_ATTR)) == 2


@CASES.register
def unfusable_output_layer_is_reported_once_or_refused(group):
    """An output layer the fused head does not reproduce (``disable_grad_reduce``): Megatron's
    output layer runs, with the plugin's unfused loss (equal to Megatron's), and rank 0 logs why
    once over two steps; with ``require_fused_lm_head`` the first forward raises, naming it."""
    import logging
    import os

    from megatron_vocabstats import patch

    model = tiny_gpt(dist.get_world_size())
    model.output_layer.disable_grad_reduce = True
    patch.remove()
    native_loss, native_grads, _ = loss_and_grads(model)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("megatron_vocabstats")
    logger.addHandler(handler)
    try:
        patch.apply(lm_head_chunk_size=5)
        for _ in range(2):
            loss, grads, _ = loss_and_grads(model)
        patch.apply(lm_head_chunk_size=5, require_fused_lm_head=True)
        try:
            loss_and_grads(model)
        except ValueError as exc:
            assert "disable_grad_reduce" in str(exc) and "--require-fused-lm-head" in str(exc)
        else:
            raise AssertionError("require_fused_lm_head did not refuse the unfusable layer")
    finally:
        logger.removeHandler(handler)
        patch.remove()
    close(loss, native_loss, "per-token loss")
    for name, grad in native_grads.items():
        close(grads[name], grad, f"{name} gradient")
    said = [r for r in records if "disable_grad_reduce" in r.getMessage()]
    assert len(said) == (1 if os.environ.get("RANK", "0") == "0" else 0), said


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
