"""Forward steps for Megatron's schedule, evaluation, and the plugin-versus-native comparison.

Two ways to reach the per-token statistics, both through the patched ``GPTModel``:

* **labels path** (SFT, evaluation): ``model(..., labels=labels)`` returns the per-token loss
  ``[b, s]``, computed by the plugin (fused from the hidden states when
  ``--lm-head-chunk-size > 0``, so the logits are never materialised) or by Megatron's own loss
  when the plugin is off.
* **logits path** (GRPO, scoring): ``model(..., labels=None)`` returns the logits
  ``[b, s, V/tp]`` and :func:`megatron_vocabstats.make_forward_step` turns them into
  differentiable log-probs and entropy with ``vocab_parallel_stats`` (unfused: the logits of one
  microbatch exist, which is fine at the example's sizes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_vocabstats import StatsOptions, StepBatch, make_forward_step, nll_loss
from megatron_vocabstats.megatron import settings
from megatron_vocabstats.packing import gather_from_context_parallel, shard_for_context_parallel
from megatron_vocabstats.profiling import peak_memory_bytes

from .data import Batch
from .model import Parallel, run_schedule

# Plugin settings for pure next-token NLL: no entropy bonus, no label smoothing.
PURE_NLL = {"entropy": "off", "entropy_coef": 0.0, "label_smoothing": 0.0}
# fp32 tolerance of docs/numerics.md, relative to the largest per-token loss.
FP32_RTOL = 1e-5
BF16_ATOL = 2e-2


@contextlib.contextmanager
def plugin_settings(**changes):
    """Temporarily change the plugin's run-time settings (restored on exit)."""
    before = dataclasses.asdict(settings.current())
    settings.update(**changes)
    try:
        yield settings.current()
    finally:
        settings.update(**before)


def shard_tokens(x: torch.Tensor, batch: Batch, par: Parallel) -> torch.Tensor:
    """This context-parallel rank's share of a per-token ``[1, T]`` tensor of ``batch``."""
    if par.cp == 1:
        return x
    return shard_for_context_parallel(x, par.cp_group,
                                      cu_seqlens_padded=batch.packed.cu_seqlens_padded)


def shard_batch(batch: Batch, par: Parallel) -> Batch:
    """This context-parallel rank's share of ``batch`` (the batch itself when cp = 1).

    ``packed`` keeps the global layout (cu_seqlens), as Megatron passes it under cp.
    """
    if par.cp == 1:
        return batch
    local = shard_for_context_parallel(batch.packed, par.cp_group)
    inputs = dict(batch.model_inputs, input_ids=local.tokens, position_ids=local.position_ids)
    return dataclasses.replace(batch, model_inputs=inputs,
                               labels=shard_tokens(batch.labels, batch, par),
                               loss_mask=shard_tokens(batch.loss_mask, batch, par))


def gather_tokens(x: torch.Tensor, batch: Batch, par: Parallel) -> torch.Tensor:
    """Per-token values of a cp-sharded row back in packed order (identity when cp = 1)."""
    return gather_from_context_parallel(x, par.cp_group,
                                        cu_seqlens_padded=batch.packed.cu_seqlens_padded)


# --------------------------------------------------------------------------- labels path


def answer_nll(per_token_loss: torch.Tensor, *, loss_mask: torch.Tensor):
    """Megatron loss function: NLL summed over response tokens of the model's per-token loss."""
    return nll_loss(per_token_loss.neg(), loss_mask)


def labels_forward_step(sink: list | None = None):
    """``forward_step(data_iterator, model)`` over :class:`Batch` items, labels path.

    With ``sink``, each microbatch's detached per-token loss ``[1, T]`` is appended to it.
    """

    def forward_step(data_iterator, model, *_, **__):
        batch = next(data_iterator)
        per_token = model(**batch.model_inputs, labels=batch.labels)
        if sink is not None:
            sink.append(per_token.detach())
        return per_token, functools.partial(answer_nll, loss_mask=batch.loss_mask)

    return forward_step


def reduce_reports(results: Sequence[Mapping], keys: Iterable[str], par: Parallel
                   ) -> dict[str, float]:
    """Mean of each ``[sum, count]`` report over microbatches and data/context-parallel ranks."""
    keys = list(keys)
    totals = torch.stack([sum(r[k] for r in results) for k in keys]).to(par.device)
    if par.dp * par.cp > 1:
        dist.all_reduce(totals, group=par.dp_cp_group)
    totals = totals.double().cpu()
    return {k: (t[0] / t[1]).item() if t[1] > 0 else float("nan") for k, t in zip(keys, totals)}


def evaluate_nll(model, batches: Sequence[Batch], par: Parallel, seq_length: int) -> float:
    """Mean NLL per response token over ``batches`` (nats), forward only, labels path."""
    model.eval()
    with torch.no_grad(), plugin_settings(**PURE_NLL):
        results = run_schedule(model, labels_forward_step(), [shard_batch(b, par) for b in batches],
                               forward_only=True, seq_length=seq_length)
    model.train()
    return reduce_reports(results, ["lm loss"], par)["lm loss"]


# --------------------------------------------------------------------------- logits path


def step_batch(batch: Batch, loss_inputs: Mapping | None = None) -> StepBatch:
    return StepBatch(batch.model_inputs, batch.labels, batch.loss_mask, loss_inputs)


def logits_forward_step(loss_fn, *, vocab_size: int, entropy: str):
    """:func:`make_forward_step` over :class:`StepBatch` items (logits path)."""
    return make_forward_step(lambda it: next(it), loss_fn,
                             stats=StatsOptions(vocab_size=vocab_size, entropy=entropy))


# --------------------------------------------------------------------------- comparison


@dataclasses.dataclass
class Leg:
    """One loss path of the comparison: a name and the plugin settings that select it."""

    name: str
    options: dict


def comparison_legs(lm_head_chunk_size: int) -> list[Leg]:
    return [Leg("megatron", {"active": False}),
            Leg("plugin", {"active": True, "lm_head_chunk_size": 0}),
            Leg(f"plugin fused ({lm_head_chunk_size})",
                {"active": True, "lm_head_chunk_size": lm_head_chunk_size})]


def _lm_head_weight(model):
    """The LM head weight module to count as the region's input (tied: the embedding)."""
    if model.share_embeddings_and_output_weights:
        return model.embedding.word_embeddings, model.shared_embedding_or_output_weight()
    return model.output_layer, None


def region_peak_bytes(model, hidden: torch.Tensor, batch: Batch, par: Parallel,
                      dtype: torch.dtype | None = None) -> int:
    """Peak memory of the LM head + loss, forward and backward, from the final hidden states.

    Runs exactly what the patched ``GPTModel`` runs after its decoder
    (``megatron_vocabstats.megatron.model.fused_output_processor``: Megatron's output layer and
    loss, the plugin's loss on the logits, or the fused head) with the current settings, and
    returns the peak bytes above what existed before: the logits, every workspace, the gradient
    of the LM-head weight and of the hidden states count; the weight and the hidden states
    themselves do not. CPU: ``MemTracker`` (the weight and hidden states registered, then
    subtracted); CUDA: ``max_memory_allocated`` minus the memory allocated before.

    ``dtype`` (e.g. ``torch.bfloat16``, what users train in): the hidden states and a copy of
    the LM-head weight in that dtype, so the logits are in it too; None = the model's own. The
    model's own weight is registered and subtracted then too: every path calls the output layer
    (the fused head for its hooks, ``head.deferred_call``), and ``MemTracker`` counts the
    parameters of a module it sees called, here an fp32 ``[V/tp, H]`` the region never uses.
    """
    from megatron_vocabstats.megatron.model import fused_output_processor

    module, output_weight = _lm_head_weight(model)
    held = [module]  # what exists before the region (registered, then subtracted)
    leaf = hidden.detach().clone().requires_grad_()
    if dtype is not None and dtype != hidden.dtype:
        weight = output_weight if output_weight is not None else model.output_layer.weight
        leaf = hidden.detach().to(dtype).requires_grad_()
        output_weight = weight.detach().to(dtype).requires_grad_()
        held.append(output_weight)  # the region's weight, beside the model's

    def region():
        out = fused_output_processor(
            hidden_states=leaf, output_layer=model.output_layer, output_weight=output_weight,
            labels=batch.labels, compute_language_model_loss=model.compute_language_model_loss,
            config=model.config, runtime_gather_output=None)
        (out * batch.loss_mask).sum().backward()

    model.zero_grad(set_to_none=True)
    if par.device.type == "cuda":
        before = torch.cuda.memory_allocated(par.device)
        peak = peak_memory_bytes(region, device=par.device) - before
    else:
        tensors = [leaf, *module.parameters(), *held[1:]]
        inputs = sum(t.numel() * t.element_size() for t in tensors)
        peak = peak_memory_bytes(region, *held, leaf, device=par.device) - inputs
    model.zero_grad(set_to_none=True)
    return peak


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _capture_hidden(model, store: list):
    """Forward hook on the decoder keeping the first microbatch's final hidden states."""

    def hook(_module, _inputs, output):
        if not store:
            store.append((output[0] if isinstance(output, tuple) else output).detach())

    return model.decoder.register_forward_hook(hook)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_loss_paths(model, batches: Sequence[Batch], par: Parallel, *, seq_length: int,
                       lm_head_chunk_size: int, bf16: bool) -> dict:
    """Megatron's loss, the plugin and the fused plugin on the same ``batches``.

    Per leg: one forward + backward through the whole model with Megatron's schedule (timed),
    the per-token losses on response tokens and the gradients compared with Megatron's (the
    first leg), and the peak memory of the LM head + loss region on each rank
    (:func:`region_peak_bytes`). Gradients are cleared afterwards; the model is not updated.

    Returns a dict with ``legs`` (name, mean loss, max per-token |difference|, max relative
    gradient difference, step seconds, peak bytes per rank with the model's logits and with bf16
    logits), ``logits_dtype`` (the model's), ``tolerance`` and ``ok``.
    """
    sharded = [shard_batch(b, par) for b in batches]
    reference, legs = None, []
    for leg in comparison_legs(lm_head_chunk_size):
        with plugin_settings(**PURE_NLL, **leg.options):
            sink, hidden = [], []
            handle = _capture_hidden(model, hidden)
            model.zero_grad(set_to_none=True)
            _synchronize(par.device)
            start = time.perf_counter()
            results = run_schedule(model, labels_forward_step(sink), sharded,
                                   forward_only=False, seq_length=seq_length)
            _synchronize(par.device)
            seconds = time.perf_counter() - start
            handle.remove()
            mean_loss = reduce_reports(results, ["lm loss"], par)["lm loss"]
            mask = torch.cat([b.loss_mask for b in sharded], dim=-1) != 0
            losses = torch.cat(sink, dim=-1)[mask].double()
            grads = _grads(model)
            peak = region_peak_bytes(model, hidden[0], sharded[0], par)
            # What users train in: the same region with bf16 logits (on CPU the example is fp32,
            # where Megatron's loss works in place; with bf16 it first makes an fp32 copy).
            peak_bf16 = region_peak_bytes(model, hidden[0], sharded[0], par,
                                          dtype=torch.bfloat16)
        if reference is None:
            reference = (losses, grads)
        diff = (losses - reference[0]).abs().max() if losses.numel() else torch.zeros(())
        grad_diff = max(((g - reference[1][n]).abs().max()
                         / reference[1][n].abs().max().clamp(min=1e-12)).item()
                        for n, g in grads.items())
        legs.append({"name": leg.name, "settings": leg.options, "mean_loss": mean_loss,
                     "max_abs_loss_diff": diff.item(), "max_rel_grad_diff": grad_diff,
                     "step_seconds": seconds, "peak_bytes": peak, "peak_bytes_bf16": peak_bf16})
        del grads
    model.zero_grad(set_to_none=True)
    out = _gathered(legs, reference[0], par, bf16)
    # The region's own logits dtype: that of the LM-head weight (no autocast around it).
    out["logits_dtype"] = str(_lm_head_weight(model)[0].weight.dtype).removeprefix("torch.")
    return out


def _gathered(legs: list[dict], reference: torch.Tensor, par: Parallel, bf16: bool) -> dict:
    """Per-rank peaks and worst differences/times over ranks, identical on every rank."""
    local = [[leg["peak_bytes"], leg["max_abs_loss_diff"], leg["max_rel_grad_diff"],
              leg["step_seconds"], leg["peak_bytes_bf16"]] for leg in legs]
    everyone = [None] * par.world
    dist.all_gather_object(everyone, local)
    scale = reference.abs().max().item() if reference.numel() else 1.0
    scale = torch.tensor([scale], dtype=torch.float64)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    tolerance = BF16_ATOL if bf16 else FP32_RTOL * max(scale.item(), 1.0)
    out = []
    for i, leg in enumerate(legs):
        rows = [r[i] for r in everyone]
        entry = {k: v for k, v in leg.items() if k not in ("peak_bytes", "peak_bytes_bf16")}
        entry.update(peak_bytes_per_rank=[r[0] for r in rows],
                     peak_bytes_per_rank_bf16=[r[4] for r in rows],
                     max_abs_loss_diff=max(r[1] for r in rows),
                     max_rel_grad_diff=max(r[2] for r in rows),
                     step_seconds=max(r[3] for r in rows))
        out.append(entry)
    ok = all(leg["max_abs_loss_diff"] <= tolerance for leg in out)
    return {"legs": out, "tolerance": tolerance, "ok": ok}
