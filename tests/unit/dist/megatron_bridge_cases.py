"""Megatron-Bridge's real SFT ``forward_step`` (``megatron.bridge.training.gpt_step``, the
installed megatron-bridge 0.3.1 wheel, loaded by ``_framework_stubs``) on a tiny megatron-core
GPTModel on gloo ranks, with and without ``import megatron_vocabstats.patch``: tp = 2
(``test_megatron_bridge_dist.py`` launches 2 ranks) and tp = 1 (1 rank).

Bridge's ``forward_step`` passes the labels into ``GPTModel``, so its per-token loss is
``LanguageModule.compute_language_model_loss``, which the patch replaces; Bridge's
``masked_next_token_loss`` then reduces it. The model keeps Bridge's default
``cross_entropy_loss_fusion=True`` (impl 'native'): unpatched, Megatron's fused cross-entropy
runs (eagerly: the same arithmetic without compiling on the CPU); patched, it does not, and the
one log line says so. fp32 throughout: the losses agree with Bridge's own within numerics.md's
fp32 1e-5 relative, and with a float64 cross-entropy of the model's gathered logits; the
gradients agree with Bridge's without the fusion to 1e-5, and with Bridge's default within bf16
rounding: Megatron's native fused cross-entropy returns its logits gradient in bf16.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main
from megatron_patch_cases import BATCH, SEQ, VOCAB, tiny_gpt

CASES = Cases()
LINE = "megatron-vocabstats 0.1.0 on:"


def _bridge():
    """``megatron.bridge.training.gpt_step`` from the wheel, and the patch module (removed:
    each run applies what it needs)."""
    import _framework_stubs

    try:
        modules = _framework_stubs.load("megatron.bridge")
    except ImportError as exc:
        raise Skip(str(exc)) from exc
    import megatron_vocabstats.patch as patch

    patch.remove()
    return modules["megatron.bridge.training.gpt_step"], patch


class _Timer:
    """Bridge's timers and straggler timer: ``t(name).start()/.stop()``, ``with t(...)``,
    ``with t``."""

    def __call__(self, *args, **kwargs):
        return self

    start = stop = __enter__ = lambda self, *a, **k: None
    __exit__ = lambda self, *exc: False  # noqa: E731


def _state():
    """The fields of Bridge's ``GlobalState`` that ``forward_step`` reads (its defaults)."""
    cfg = types.SimpleNamespace(
        dataset=types.SimpleNamespace(skip_getting_attention_mask_from_dataset=True),
        rerun_state_machine=types.SimpleNamespace(check_for_nan_in_loss=True,
                                                  check_for_spiky_loss=False))
    return types.SimpleNamespace(timers=_Timer(), straggler_timer=_Timer(), cfg=cfg)


def _batch():
    """One SFT micro-batch as Bridge's dataset yields it (prompt tokens masked out)."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[0, :4] = 0  # a prompt
    loss_mask[1, -2:] = 0  # padding
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ), "attention_mask": None}


@contextlib.contextmanager
def _counting(module, name, counts):
    """Count the calls of ``module.name`` (restored on exit)."""
    original = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, original)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logits_grad_hook(captured):
    """A forward hook on the output layer that keeps the gradient of its logits (unfused runs;
    the fused head makes no logits)."""

    def hook(module, inputs, output):
        logits = output[0] if isinstance(output, tuple) else output
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            logits.register_hook(lambda grad: captured.append(grad.detach().clone()))

    return hook


def _step(gpt_step, model):
    """Bridge's ``forward_step`` then its loss function and backward, as its schedule runs them;
    ``(loss, num_tokens, per-token losses, output-layer weight gradient, counts, log lines,
    logits gradient or None)``."""
    from megatron.core.models.common.language_module import language_module

    import _framework_stubs
    import megatron_vocabstats.megatron.model as patched_model
    import megatron_vocabstats.ops.stats.from_hidden as fused_linear

    model.zero_grad(set_to_none=True)
    counts, lines, dz = {}, _Lines(), []
    logger = logging.getLogger("megatron_vocabstats")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    saved_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # get_batch moves the batch to the GPU
    handle = model.output_layer.register_forward_hook(_logits_grad_hook(dz))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_framework_stubs.eager())
            stack.enter_context(_counting(language_module, "fused_vocab_parallel_cross_entropy",
                                          counts))
            stack.enter_context(_counting(patched_model, "vocab_parallel_stats", counts))
            stack.enter_context(_counting(fused_linear, "linear_vocab_parallel_stats", counts))
            output, loss_func = gpt_step.forward_step(_state(), iter([_batch()]), model)
            loss, num_tokens, report = loss_func(output)
            loss.backward()
    finally:
        handle.remove()
        torch.Tensor.cuda = saved_cuda
        logger.removeHandler(lines)
    assert torch.equal(report["lm loss"], torch.cat([loss.detach().view(1),
                                                     num_tokens.view(1).float()]))
    return (loss.detach(), int(num_tokens), output.detach(),
            model.output_layer.weight.grad.clone(), counts, lines.lines,
            dz[0] if dz else None)


def _float64_loss(model, group) -> torch.Tensor:
    """Float64 per-token cross-entropy ``[b, s]`` of the model's logits (no labels: Megatron
    returns ``[b, s, V/tp]``), gathered over tp, against the batch's labels. Over the padded
    vocabulary, as Megatron's loss (and the plugin without ``vocab_size``) takes it."""
    batch = _batch()
    with torch.no_grad():
        shard = model(batch["tokens"], batch["position_ids"], None)
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    logits = torch.cat(shards, dim=-1).double()  # Megatron's padded vocabulary: all columns
    return torch.logsumexp(logits, -1) - logits.gather(-1, batch["labels"].unsqueeze(-1))[..., 0]


def _close(ours, theirs, what, rtol=1e-5):
    scale = theirs.abs().max().clamp_min(1.0)
    gap = (ours.double() - theirs.double()).abs().max() / scale
    assert gap <= rtol, f"{what}: relative gap {float(gap):.3g} > {rtol}"


def _compare(group, *, lm_head_chunk_size: int, counted: str):
    """Bridge's default (``cross_entropy_loss_fusion=True``, Megatron's native fused
    cross-entropy), Bridge with the fusion off (Megatron's ``vocab_parallel_cross_entropy``) and
    Bridge with the patch (twice: one log line) on the same model and batch."""
    gpt_step, patch = _bridge()
    tp = dist.get_world_size(group)
    model = tiny_gpt(tp, cross_entropy_loss_fusion=True)  # Bridge's GPTModelProvider default
    assert model.config.cross_entropy_fusion_impl == "native"
    try:
        own = _step(gpt_step, model)
        model.config.cross_entropy_loss_fusion = False
        plain = _step(gpt_step, model)
        model.config.cross_entropy_loss_fusion = True
        patch.apply(lm_head_chunk_size=lm_head_chunk_size)
        from megatron_vocabstats.megatron import announce

        announce.reset()
        ours = _step(gpt_step, model)
        again = _step(gpt_step, model)
    finally:
        patch.remove()
    # unpatched: Megatron's fused cross-entropy, no plugin; patched: the plugin, not Megatron's
    assert own[4] == {"fused_vocab_parallel_cross_entropy": 1}, own[4]
    assert plain[4] == {}, plain[4]
    assert ours[4] == again[4] == {counted: 1}, ours[4]
    assert not [line for line in own[5] + plain[5] if line.startswith(LINE)], own[5]
    announced = [line for line in ours[5] + again[5] if line.startswith(LINE)]
    if dist.get_rank() == 0:
        assert len(announced) == 1, ours[5] + again[5]
        assert f"tp {tp}," in announced[0] and "megatron-core 0.16" in announced[0]
        assert ("supersedes cross_entropy_loss_fusion=True (cross_entropy_fusion_impl "
                "'native'") in announced[0], announced[0]
        assert ("fused LM head" in announced[0]) == (lm_head_chunk_size > 0), announced[0]
    else:
        assert not announced, announced
    assert own[1] == plain[1] == ours[1] == int(_batch()["loss_mask"].sum())
    reference = _float64_loss(model, group)
    for theirs, name in ((own, "Bridge's default"), (plain, "Bridge without fusion")):
        _close(ours[2], theirs[2], f"per-token loss vs {name}")
        _close(ours[0], theirs[0], f"Bridge's masked_next_token_loss vs {name}")
        _close(theirs[2], reference, f"{name}'s per-token loss vs float64")
    _close(ours[2], reference, "per-token loss vs float64")
    _close(ours[3], plain[3], "output-layer weight gradient vs Bridge without fusion")
    # Megatron's native fused cross-entropy returns its logits gradient in bf16 (0.16.1,
    # fused_cross_entropy.calculate_gradients), whatever the model's dtype: Bridge's default
    # gradient is ours rounded to bf16 (half an ulp: 2^-9 relative), the weight gradient within
    # the sum of those roundings.
    if ours[6] is not None:
        assert plain[6] is not None and own[6] is not None
        _close(ours[6], plain[6], "logits gradient vs Bridge without fusion")
        rounded = (own[6] - ours[6]).abs() <= 2.0 ** -8 * ours[6].abs() + 1e-12
        assert bool(rounded.all()), "Bridge's default logits gradient is not ours in bf16"
    _close(ours[3], own[3], "output-layer weight gradient vs Bridge's default", rtol=2.0 ** -7)


@CASES.register
def sft_forward_step_unfused(group):
    """The import (chunked unfused op): Bridge's loss, gradient and report as Bridge's own."""
    _compare(group, lm_head_chunk_size=0, counted="vocab_parallel_stats")


@CASES.register
def sft_forward_step_fused(group):
    """``apply(lm_head_chunk_size=8)``: the fused LM head under Bridge's ``forward_step``."""
    _compare(group, lm_head_chunk_size=8, counted="linear_vocab_parallel_stats")


def _modelopt_capture_hook(module, inputs, output):
    """Stands in for ModelOpt's ``student_output_capture_fwd_hook``: keeps the output."""
    module._intermediate_output = output


_modelopt_capture_hook.__module__ = "modelopt.torch.distill.distillation_model"


@CASES.register
def modelopt_distillation_keeps_logits(group):
    """An output layer carrying ModelOpt's distillation capture hook (Bridge's ``distill``):
    the fused head falls back to Megatron's output layer, naming it once, so the hook captures
    real logits; with ``require_fused_lm_head`` it refuses, naming it."""
    from megatron_vocabstats.megatron import head

    gpt_step, patch = _bridge()
    tp = dist.get_world_size(group)
    model = tiny_gpt(tp)
    model.output_layer._intermediate_output = None
    model.output_layer.register_forward_hook(_modelopt_capture_hook)
    warned = _Lines()
    logging.getLogger("megatron_vocabstats").addHandler(warned)
    head._REPORTED.clear()
    try:
        patch.apply(lm_head_chunk_size=8)
        counts = _step(gpt_step, model)[4]
        captured = model.output_layer._intermediate_output
        patch.apply(lm_head_chunk_size=8, require_fused_lm_head=True)
        try:
            _step(gpt_step, model)
        except ValueError as exc:
            refusal = str(exc)
        else:
            raise AssertionError("require_fused_lm_head did not refuse ModelOpt distillation")
    finally:
        patch.remove()
        logging.getLogger("megatron_vocabstats").removeHandler(warned)
    assert counts == {"vocab_parallel_stats": 1}, counts
    logits = captured[0]
    assert isinstance(logits, torch.Tensor) and logits.shape[-1] * tp >= VOCAB, type(logits)
    assert "ModelOpt distillation" in refusal and "--require-fused-lm-head" in refusal, refusal
    fallbacks = [line for line in warned.lines if "ModelOpt distillation" in line]
    assert len(fallbacks) == (1 if dist.get_rank() == 0 else 0), warned.lines


if __name__ == "__main__":
    main(CASES, timeout_s=300.0)
