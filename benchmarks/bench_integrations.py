"""Benchmark: peak memory per rank of one training step's log-probs (and entropy) in each RL
framework, the framework's own path against the integration, unfused and fused.

Each framework's cases live in ``benchmarks/integrations/<framework>.py``: ``cases(T, V, H,
tp_group, dtype)`` returns zero-argument callables ("<framework>", "ours unfused", "ours fused"
where the framework fuses) that make their inputs (this rank's bf16 logits shard ``[T, V/tp]``,
or the hidden states and the output layer's shard) and run forward and backward. The peak
counts everything alive while one runs, its inputs included (torch's ``MemTracker`` on CPU,
``max_memory_allocated`` on CUDA). ``L`` is one bf16 logits shard, ``T * V/tp * 2`` bytes.

Run under torchrun, one rank per tp rank (gloo on CPU)::

    torchrun --nproc-per-node 2 benchmarks/bench_integrations.py --tokens 4096 [--framework NAME]

A framework whose own code is not installed in this environment (AReaL and SkyRL: the oldest
leg's venv) prints why it was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integrations")
MiB = 2**20


def frameworks() -> list[str]:
    return sorted(name[:-3] for name in os.listdir(CASES_DIR)
                  if name.endswith(".py") and not name.startswith("_"))


def load_cases(name: str):
    """The cases module of ``name``, loaded by its path (its file name is the framework's: on
    ``sys.path`` it would shadow the framework's own package)."""
    spec = importlib.util.spec_from_file_location(f"_bench_cases_{name}",
                                                  os.path.join(CASES_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--framework", action="append", choices=frameworks(),
                        help="only these (default: every one in benchmarks/integrations/)")
    args = parser.parse_args(argv)

    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))  # the frameworks' stub loader
    from megatron_vocabstats.ops.workspace import reset_workspace
    from megatron_vocabstats.profiling import peak_memory_bytes

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    tp = dist.get_world_size()
    group = dist.group.WORLD if tp > 1 else None
    try:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    except ImportError:
        pass
    unit = args.tokens * (-(-args.vocab // tp)) * 2
    rows = []
    for name in args.framework or frameworks():
        try:
            cases = load_cases(name).cases(args.tokens, args.vocab, args.hidden, group,
                                           torch.bfloat16)
        except ImportError as exc:
            rows.append((name, "-", f"skipped: {exc}"))
            continue
        for label, run in cases.items():
            reset_workspace()  # our chunk buffers are allocated inside each measurement
            dist.barrier()
            peak = peak_memory_bytes(run, device=device)
            peaks = [torch.tensor(float(peak))]
            dist.all_reduce(peaks[0], op=dist.ReduceOp.MAX)
            value = int(peaks[0])
            rows.append((name, label, f"{value / MiB:,.0f} MiB ({value / unit:.2f} L)"))
    if dist.get_rank() == 0:
        print(f"\npeak per rank (max over ranks), one step forward + backward; tp = {tp}, "
              f"T = {args.tokens}, V = {args.vocab}, H = {args.hidden}, bf16, {device}; "
              f"L = the bf16 logits shard ({unit / MiB:,.0f} MiB)\n")
        print("| framework | path | peak |")
        print("|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
