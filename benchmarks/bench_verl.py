"""Benchmark: peak memory of verl's Megatron LM-head step, verl's functions vs the integration.

Per tp rank, the peak bytes of tensors alive beyond the inputs (MemTracker on CPU,
``max_memory_allocated`` less what was allocated before on GPU) while one micro-batch goes from
the hidden states to verl's log-probs and entropy: forward only (verl's ``compute_log_prob``, no
grad), what a forward with grad leaves alive for the backward (it adds to the activations at the
step's peak), and forward + backward (``update_policy``):

* ``verl`` / ``unfused``: the output layer ``hidden @ weight.T`` in the model dtype, cast to fp32
  (Megatron's ``Float16Module`` output), then verl's real
  ``MegatronEngineWithLMHead._lm_head_logits_processor`` (temperature, clone, entropy, log-probs)
  on verl's own functions;
* ``ours`` / ``unfused``: the same after ``megatron_vocabstats.integrations.verl.apply()``;
* ``ours`` / ``fused``: verl's ``model_forward_fused.fused_output_processor``
  (``use_fused_kernels=True``) after ``apply()``: ``linear_vocab_parallel_stats`` from the hidden
  states, no logits. verl's own fused kernel is Triton on CUDA: on CPU it has no row.

verl comes from the installed verl (its real modules; without verl's dependencies, through
``tests/unit/_framework_stubs.py``). Run from the repo root, one torchrun job per tp size::

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_verl.py --tokens 1024 \\
        --vocab 151936 --hidden 512

Prints a markdown table on rank 0 (MiB, and in units ``L`` of the fp32 logits shard, ``T * V/tp
* 4`` bytes). Writes nothing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from megatron_vocabstats.ops.workspace import reset_workspace  # noqa: E402
from megatron_vocabstats.profiling import peak_memory_bytes  # noqa: E402

ENGINE = "verl.workers.engine.megatron.transformer_impl"
FUSED = "verl.models.mcore.model_forward_fused"
MiB = 2**20


def load_verl():
    """verl's engine and fused-forward modules: the installed verl, else its real modules without
    its dependencies (the tests' loader)."""
    try:
        return {name: importlib.import_module(name) for name in (ENGINE, FUSED)}
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
        import _framework_stubs

        return _framework_stubs.load("verl")


def held_bytes(fn, device) -> int:
    """Bytes alive once ``fn()`` returned, its result still referenced (what a forward leaves for
    its backward), beyond what was alive before."""
    if torch.device(device).type == "cuda":
        base = torch.cuda.memory_allocated(device)
        result = fn()
        alive = torch.cuda.memory_allocated(device) - base
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        with tracker:
            result = fn()
            alive = tracker.get_tracker_snapshot("current")[torch.device(device)]["Total"]
    del result
    return int(alive)


def unfused_step(modules, hidden, weight, labels, grad, backward=True):
    engine = modules[ENGINE].MegatronEngineWithLMHead
    config = SimpleNamespace(entropy_from_logits_with_chunking=False,
                             entropy_from_logits_chunk_size=2048)

    def step():
        h = hidden.detach().requires_grad_(grad)
        w = weight.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            logits = (h @ w.T).float().unsqueeze(0)  # the output layer, Float16Module's cast
            ret = engine._lm_head_logits_processor(
                SimpleNamespace(engine_config=config), logits, labels,
                torch.ones(labels.shape, device=labels.device), calculate_sum_pi_squared=False,
                calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                logits_processor_func=None, batch=None, data_format="thd")
        del logits
        if grad and backward:
            (ret["log_probs"].sum() + ret["entropy"].sum()).backward()
        return ret
    return step


def fused_step(modules, hidden, weight, labels, grad, backward=True):
    fused = modules[FUSED]

    def step():
        h = hidden.detach().unsqueeze(1).requires_grad_(grad)
        w = weight.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = fused.fused_output_processor(
                hidden_states=h, output_layer=SimpleNamespace(weight=w), output_weight=None,
                labels=labels, context=fused.FusedOutputProcessorContext(temperature=1.0),
                config=SimpleNamespace(sequence_parallel=False))
        if grad and backward:
            (out.log_probs.sum() + out.entropy.sum()).backward()
        return out
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    rank, tp = dist.get_rank(), dist.get_world_size()
    modules = load_verl()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    import megatron_vocabstats.integrations.verl as integration

    integration.remove()
    dtype, width = getattr(torch, args.dtype), -(-args.vocab // tp)
    weight = (torch.randn(width, args.hidden, device=device) / args.hidden**0.5).to(dtype)
    rows = []
    for tokens in args.tokens:
        hidden = torch.randn(tokens, args.hidden, device=device).to(dtype)
        labels = torch.randint(0, width * tp, (1, tokens), device=device)
        unit = tokens * width * 4
        for provider, path, make in (("verl", "unfused", unfused_step),
                                     ("ours", "unfused", unfused_step),
                                     ("ours", "fused", fused_step)):
            if provider == "ours":
                integration.apply()
            try:
                if not cuda:  # verl's entropy compiles a product with torch.compile: run eagerly
                    torch._dynamo.config.disable = True
                base = torch.cuda.memory_allocated(device) if cuda else 0
                peaks = []
                for grad, backward in ((False, False), (True, False), (True, True)):
                    reset_workspace()  # our chunk buffers are allocated inside each measurement
                    fn = make(modules, hidden, weight, labels, grad, backward)
                    peaks.append(held_bytes(fn, device) if grad and not backward else
                                 peak_memory_bytes(fn, device=device) - base)
            finally:
                integration.remove()
            rows.append((tokens, provider, path, *peaks, unit))
    if rank == 0:
        print(f"\nverl {integration.verl_version()}, V = {args.vocab}, tp = {tp}, "
              f"H = {args.hidden}, {args.dtype} model, {device}; peak per rank beyond the inputs "
              "(hidden, weight shard, labels)\n")
        print("| T | provider | path | forward, no grad | held for backward | "
              "forward + backward |")
        print("|---|---|---|---|---|---|")
        for tokens, provider, path, *peaks, unit in rows:
            cells = " | ".join(f"{b / MiB:.0f} MiB ({b / unit:.2f} L)" for b in peaks)
            print(f"| {tokens} | {provider} | {path} | {cells} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
