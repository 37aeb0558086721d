"""AReaL's training-step log-probs and entropy, per tp rank, for the peak-memory table of
docs/integrations.md (the driver, ``benchmarks/bench_integrations.py``, measures the callables).

AReaL's Megatron and FSDP engines call ``gather_logprobs_entropy(logits, labels, temperature,
tp_group=...)`` on the model's logits shard and back-propagate a loss of both outputs; AReaL has
no fused LM-head path, so there is no "ours fused" row:

* ``areal``: AReaL's real ``areal.utils.functional.vocab_parallel.gather_logprobs_entropy``
  (the installed AReaL, else its real module without its dependencies, through the tests' loader
  ``tests/unit/_framework_stubs.py``; AReaL 1.0.4 is installed on the py311 leg);
* ``ours unfused``: :func:`megatron_vocabstats.integrations.areal_ops.gather_logprobs_entropy`,
  what ``import megatron_vocabstats.integrations.areal`` binds in its place.

May import: torch, :mod:`megatron_vocabstats.integrations.areal_ops` and AReaL.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VP = "areal.utils.functional.vocab_parallel"


def areal_function():
    """AReaL's own ``gather_logprobs_entropy`` (the original, also while the integration is
    applied)."""
    try:
        module = importlib.import_module(VP)
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
        import _framework_stubs

        module = _framework_stubs.load("areal")[VP]
    fn = module.gather_logprobs_entropy
    return getattr(fn, "__wrapped__", fn)


def cases(T: int, V: int, H: int, tp_group, dtype) -> dict:
    """Zero-argument callables, one training step each from this rank's ``[T, V / tp]`` logits
    shard in ``dtype`` (``H`` unused: no fused path): forward of log-probs and entropy at
    temperature 1 (AReaL's default), backward of their sum."""
    del H
    from megatron_vocabstats.integrations import areal_ops

    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    rank = 0 if tp_group is None else dist.get_rank(tp_group)

    def step(fn):
        def run():
            gen = torch.Generator().manual_seed(1000 + rank)  # shards differ across ranks
            logits = torch.randn(T, V // tp, generator=gen, dtype=dtype).requires_grad_()
            labels = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(7))
            logprobs, entropy = fn(logits, labels, 1.0, tp_group=tp_group)
            (logprobs.sum() + entropy.sum()).backward()
        return run

    return {"areal": step(areal_function()),
            "ours unfused": step(areal_ops.gather_logprobs_entropy)}
