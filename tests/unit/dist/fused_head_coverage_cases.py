"""Megatron LM-head paths beyond ``GPTModel.forward``: the schedule plan gets the fused head, and
each Megatron feature that the fused head cannot reproduce is named in the one log line (and
refused under ``require_fused_lm_head``), with Megatron's own path giving Megatron's loss.

Run by tests/unit/test_fused_head_coverage.py (marked ``megatron``) on tp = 1, 2 gloo ranks,
with the tiny fp32 models of megatron_patch_cases.py. Features a release lacks (GTP before 0.19,
``output_dtype`` and ``cross_entropy_fusion_impl="linear"`` before Megatron-LM main / dev) are
set on the real objects as those versions set them.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main
from megatron_patch_cases import batch, close, loss_and_grads, tiny_gpt

CASES = Cases()


def _spy_fused(calls):
    import megatron_vocabstats.ops.stats.from_hidden as fused_module

    original = fused_module.linear_vocab_parallel_stats
    fused_module.linear_vocab_parallel_stats = lambda *a, **k: calls.append(1) or original(*a,
                                                                                            **k)
    return lambda: setattr(fused_module, "linear_vocab_parallel_stats", original)


@CASES.register
def schedule_plan_gets_the_fused_head(group):
    """``forward_step(return_schedule_plan=True)`` (--overlap-moe-expert-parallel-comm) calls
    ``build_schedule_plan`` instead of ``forward``. 0.18+: the plan receives the fused output
    processor for a loss (none for a logits request), and that processor, where the plan's
    postprocess node hands it (``_postprocess``, reached here through ``forward``), gives
    Megatron's loss through the fused op. 0.16-0.17: the node calls ``_postprocess``, which the
    patch replaces."""
    import inspect

    from megatron.core.models.gpt import GPTModel

    from megatron_vocabstats import patch
    from megatron_vocabstats.megatron._patching import Patcher
    from megatron_vocabstats.megatron.model import fused_output_processor
    from megatron_vocabstats.testing.megatron_cpu import cuda_factories_on_cpu

    if "output_processor" not in inspect.signature(GPTModel.build_schedule_plan).parameters:
        from megatron.core.models.gpt.fine_grained_callables import PostProcessNode

        assert "self.gpt_model._postprocess(" in inspect.getsource(PostProcessNode.forward_impl)
        patch.apply(lm_head_chunk_size=5)
        try:
            assert Patcher.is_ours(GPTModel._postprocess)
        finally:
            patch.remove()
        return
    from megatron.core.models.common import model_chunk_schedule_plan as plans

    model = tiny_gpt(dist.get_world_size())
    ids, pos, labels = batch()
    patch.remove()
    native, _, _ = loss_and_grads(model, labels=labels)
    built = []
    plan_class = plans.TransformerModelChunkSchedulePlan
    plans.TransformerModelChunkSchedulePlan = lambda *args, **kwargs: built.append(kwargs)
    calls = []
    unspy = _spy_fused(calls)
    try:
        patch.apply(lm_head_chunk_size=5)
        model.build_schedule_plan(ids, pos, None, labels=labels)
        model.build_schedule_plan(ids, pos, None)
        processor = built[0]["output_processor"]
        assert processor is fused_output_processor, f"the schedule plan got {processor}"
        assert built[1]["output_processor"] is None, "a logits request got the fused head"
        with cuda_factories_on_cpu():
            ours = model(ids, pos, None, labels=labels, output_processor=processor)
    finally:
        plans.TransformerModelChunkSchedulePlan = plan_class
        unspy()
        patch.remove()
    assert calls, "the schedule plan's output processor did not reach the fused op"
    close(ours.detach(), native, "per-token loss")


def named_once_or_refused(model, change, needle: str, *, runs: bool = True):
    """Megatron's loss of ``model``; then ``change(model)`` (a feature the fused head does not
    reproduce): with ``lm_head_chunk_size`` set, two steps log one line naming ``needle`` on
    rank 0, never reach the fused op and give Megatron's loss (``runs``: where Megatron's own
    forward runs on these CPU ranks); with ``require_fused_lm_head`` the forward raises, naming
    ``needle`` and the flag."""
    from megatron_vocabstats import patch
    from megatron_vocabstats.megatron import head

    patch.remove()
    head._REPORTED.clear()  # logged once per process: the cases before logged the same line
    native, _, _ = loss_and_grads(model)
    change(model)
    records, calls = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("megatron_vocabstats")
    logger.addHandler(handler)
    unspy = _spy_fused(calls)
    try:
        if runs:
            patch.apply(lm_head_chunk_size=5)
            for _ in range(2):
                loss, _, _ = loss_and_grads(model)
            close(loss, native, "per-token loss")
            assert not calls, "the fused op ran"
        patch.apply(lm_head_chunk_size=5, require_fused_lm_head=True)
        try:
            loss_and_grads(model)
        except ValueError as exc:
            assert needle in str(exc) and "--require-fused-lm-head" in str(exc), str(exc)
        else:
            raise AssertionError(f"require_fused_lm_head did not refuse {needle}")
    finally:
        logger.removeHandler(handler)
        unspy()
        patch.remove()
    if runs:
        said = [r.getMessage() for r in records if needle in r.getMessage()]
        assert len(said) == (1 if os.environ.get("RANK", "0") == "0" else 0), said


def _tag_gtp(weight):
    weight.is_gtp_weight_remat = True  # what megatron-core 0.19's wrap_module_params_gtp sets


@CASES.register
def gtp_sharded_output_layer_is_named(group):
    """The output layer's ``gtp_remat_size > 1`` (its GEMM gathers GTP shards; refused before
    Megatron's forward, which needs the GTP group) and a GTP-tagged output weight."""
    tp = dist.get_world_size()
    named_once_or_refused(tiny_gpt(tp), lambda m: setattr(m.output_layer, "gtp_remat_size", 2),
                          "GTP weight sharding", runs=False)
    named_once_or_refused(tiny_gpt(tp), lambda m: _tag_gtp(m.output_layer.weight),
                          "GTP weight sharding")


@CASES.register
def gtp_sharded_tied_embedding_is_named(group):
    """A GTP-tagged tied embedding: the weight the output layer is called with."""
    model = tiny_gpt(dist.get_world_size(), share_embeddings_and_output_weights=True)
    named_once_or_refused(model, lambda m: _tag_gtp(m.shared_embedding_or_output_weight()),
                          "GTP weight sharding")


@CASES.register
def output_logit_dtype_is_named(group):
    """``output_layer.output_dtype`` (Megatron-LM main's --output-logit-dtype) other than the
    parameters' dtype: float64 GEMM outputs of this fp32 model, as fp32 ones of a bf16 model."""
    named_once_or_refused(tiny_gpt(dist.get_world_size()),
                          lambda m: setattr(m.output_layer, "output_dtype", torch.float64),
                          "output_layer.output_dtype")


@CASES.register
def output_logit_dtype_of_the_parameters_is_fused(group):
    """``output_dtype`` equal to the parameters' dtype changes nothing: no reason."""
    from megatron_vocabstats.megatron.head import not_fused_reasons

    model = tiny_gpt(dist.get_world_size())
    model.output_layer.output_dtype = model.config.params_dtype
    assert not_fused_reasons(model.output_layer, model.config) == ()


@CASES.register
def linear_cross_entropy_fusion_is_named(group):
    """``cross_entropy_loss_fusion`` with ``cross_entropy_fusion_impl="linear"`` (Megatron's
    dev-branch LinearCrossEntropyModule): named, Megatron's path with the plugin's loss."""

    def linear(model):
        model.config.cross_entropy_loss_fusion = True
        model.config.cross_entropy_fusion_impl = "linear"

    named_once_or_refused(tiny_gpt(dist.get_world_size()), linear,
                          "cross_entropy_fusion_impl='linear'")


if __name__ == "__main__":
    main(CASES)
