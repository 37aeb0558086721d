"""Benchmark: peak memory of the LM head + losses with D = 0, 1, 2 multi-token-prediction (MTP)
depths, as Megatron computes them (``process_mtp_loss`` for the depths, then the main head).

Per tp rank, one forward + backward of ``sum(loss_mask * main per-token loss)`` with every MTP
depth's scaled loss attached by Megatron's ``MTPLossAutoScaler`` (training mode: the MTP loss
and, on 0.19, the acceptance counts logged), from bf16 hidden states ``[(1 + D) * s, b, H]`` and
a bf16 output layer (Megatron's ``ColumnParallelLinear``, so bf16 logits ``[s, b, V/tp]``):

* ``megatron``: Megatron's own (each head's logits, then ``vocab_parallel_cross_entropy``, and
  the acceptance counts read from the depth's logits);
* ``unfused_ours``: ``import megatron_vocabstats.patch`` with ``lm_head_chunk_size=0``: the same
  logits, our ``vocab_parallel_stats`` as the loss;
* ``fused``: ``lm_head_chunk_size=CHUNK``: every head's loss (and the acceptance counts, from the
  op's ``argmax`` output) from its hidden states, no logits.

Reported: the peak (MemTracker on CPU, ``max_memory_allocated`` on GPU; the inputs and their
gradients included; the ops' cached chunk buffers are dropped before each step, so that they are
allocated, and counted, inside it) and the peak minus the inputs and their gradients
("workspace"), with the ratio to Megatron's. Run (from the repo root)::

    python benchmarks/bench_mtp_head.py --tokens 1024 --hidden 256 --tp 1

prints the table and writes it (``.md``) and its rows (``.csv``) to a new directory per run,
``outputs/benchmarks/mtp_head-<UTC time>/`` (``--out PREFIX`` to choose; with ``--results`` the
committed ``benchmarks/results/mtp_head.md`` is replaced and ``mtp_head.csv`` appended to).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runner import (
    Measurement,
    add_output_arguments,
    device,
    drive,
    init_worker,
    is_worker,
    measure,
    output_prefix,
    write_worker_rows,
)

MiB = 1024**2
PROVIDERS = ("megatron", "unfused_ours", "fused")
MICRO_BATCH = 2


def _setup(tp: int, hidden: int, vocab: int):
    """Megatron's model-parallel state, the bf16 output layer (padded vocabulary) and a
    ``LanguageModule`` whose ``compute_language_model_loss`` and ``_scale_logits`` the heads
    use."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vocabstats.testing.megatron_cpu import install_cpu_shims

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    install_cpu_shims()
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                               tensor_model_parallel_size=tp, params_dtype=torch.bfloat16,
                               bf16=True, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False)
    padded = -(-vocab // (128 * tp)) * 128 * tp
    layer = tensor_parallel.ColumnParallelLinear(
        hidden, padded, config=config, init_method=torch.nn.init.normal_, bias=False,
        gather_output=False, tp_group=parallel_state.get_tensor_model_parallel_group())
    layer.to(device())
    return config, layer, LanguageModule(config=config)


class _Unhooked:
    """The output layer, called through its ``forward`` (no module hooks): CPU's MemTracker
    refuses a module called more than once in one tracked step, and every head calls it.

    ``self.forward``: the fused head's ``deferred_output_layer`` sets it on this wrapper (the
    layer it is given), so a call inside it returns the deferred logits; outside, the layer's."""

    def __init__(self, layer):
        self._layer = layer

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._layer, name)


def _step(provider: str, depths: int, config, layer, module, inputs, chunk: int):
    """The forward of ``provider`` at ``depths``; returns the backward closure."""
    import dataclasses

    from megatron.core.transformer import multi_token_prediction as mtp

    from megatron_vocabstats import patch
    from megatron_vocabstats.megatron.model import fused_output_processor
    from megatron_vocabstats.ops.workspace import reset_workspace

    hidden_all, labels, mask = inputs
    cfg = dataclasses.replace(config, mtp_num_layers=depths or None)
    weight, layer = layer.weight, _Unhooked(layer)

    def step():
        reset_workspace()  # the chunk buffers are allocated (and counted) inside the step
        patch.remove()
        if provider != "megatron":
            patch.apply(lm_head_chunk_size=chunk if provider == "fused" else 0)
        tracker = mtp.MTPLossLoggingHelper.tracker
        tracker.clear()
        for key in ("values", "loss_values", "correct_values", "total_values"):
            tracker[key] = torch.zeros(max(depths, 1), device=device())
        hidden = hidden_all
        if depths:
            hidden = mtp.process_mtp_loss(
                hidden_states=hidden_all, labels=labels, loss_mask=mask, output_layer=layer,
                output_weight=None, runtime_gather_output=None, is_training=True,
                compute_language_model_loss=module.compute_language_model_loss, config=cfg)
        if provider == "fused":
            loss = fused_output_processor(
                hidden_states=hidden, output_layer=layer, output_weight=None, labels=labels,
                compute_language_model_loss=module.compute_language_model_loss,
                scale_logits=module._scale_logits, config=cfg)
        else:
            logits, _ = layer(hidden)
            loss = module.compute_language_model_loss(labels, logits)
            del logits
        total = (loss * mask).sum()

        def backward():
            total.backward()
            hidden_all.grad = None
            weight.grad = None

        return backward

    return step


def worker(args) -> None:
    logging.getLogger("megatron_vocabstats").setLevel(logging.WARNING)  # no patch log per step
    group = init_worker()
    tp = torch.distributed.get_world_size()
    config, layer, module = _setup(tp, args.hidden, args.vocab)
    rows = []
    for tokens in args.tokens:
        seq = tokens // MICRO_BATCH
        gen = torch.Generator().manual_seed(0)
        labels = torch.randint(0, args.vocab, (MICRO_BATCH, seq), generator=gen).to(device())
        mask = (torch.rand(MICRO_BATCH, seq, generator=gen) > 0.1).float().to(device())
        for depths in args.depths:
            hidden_all = (torch.randn((1 + depths) * seq, MICRO_BATCH, args.hidden,
                                      generator=gen) * 0.5).to(torch.bfloat16).to(device())
            hidden_all.requires_grad_()
            inputs = (hidden_all, labels, mask)
            held = [hidden_all, layer.weight, labels, mask]
            input_bytes = 2 * sum(t.numel() * t.element_size() for t in held[:2]) + sum(
                t.numel() * t.element_size() for t in held[2:])
            for provider in PROVIDERS:
                step = _step(provider, depths, config, layer, module, inputs, args.chunk)
                peak, ms, fwd, bwd = measure(step, group=group, inputs=held, iters=args.iters,
                                             warmup=0)
                rows.append(Measurement(provider, f"mtp{depths}", tokens, tp, peak_bytes=peak,
                                        time_ms=ms, fwd_collectives=fwd, bwd_collectives=bwd,
                                        extra={"depths": depths,
                                               "workspace_bytes": peak - input_bytes}))
            from megatron_vocabstats import patch

            patch.remove()
    write_worker_rows(args.worker_out, rows)
    torch.distributed.destroy_process_group()


def table(rows: list[Measurement]) -> str:
    base = {(r.tokens, r.tp, r.extra["depths"]): r for r in rows if r.provider == "megatron"}
    lines = ["| T | tp | MTP depths | provider | peak/rank MiB | Megatron peak / this | "
             "workspace MiB | Megatron workspace / this | time ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base[(r.tokens, r.tp, r.extra["depths"])]
        work, bwork = r.extra["workspace_bytes"], b.extra["workspace_bytes"]
        lines.append(f"| {r.tokens} | {r.tp} | {r.extra['depths']} | {r.provider} | "
                     f"{r.peak_bytes / MiB:,.1f} | {b.peak_bytes / r.peak_bytes:.2f} | "
                     f"{work / MiB:,.1f} | {bwork / work:.2f} | {r.time_ms:,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024],
                        help="tokens per head (s * b, b = 2)")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk", type=int, default=256, help="--lm-head-chunk-size of fused")
    parser.add_argument("--iters", type=int, default=1)
    add_output_arguments(parser, "mtp_head")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if is_worker():
        worker(args)
        return
    drive(os.path.abspath(__file__), args.tp, sys.argv[1:], op="mtp_head",
          config=f"V={args.vocab}, H={args.hidden}, bf16, chunk={args.chunk}",
          table=table, out=output_prefix(parser, args, "mtp_head"))


if __name__ == "__main__":
    main()
