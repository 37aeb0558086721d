"""SkyRL's training-step log-probs and entropy, per tp rank, for the peak-memory table of
docs/integrations.md (the driver, ``benchmarks/bench_integrations.py``, measures the callables).

SkyRL's Megatron policy loss (``megatron_model_wrapper``, RL path, defaults:
``use_entropy_loss=False``) computes the log-probs of one packed row ``[1, T, W]`` with a
gradient and the entropy as a metric (no gradient). The keys:

* ``skyrl``: SkyRL's real ``from_parallel_logits_to_logprobs`` and ``vocab_parallel_entropy``
  (``skyrl==0.3.0``, installed on the py311 leg, else its real module through the tests' loader
  ``tests/unit/_framework_stubs.py``) on this rank's bf16 logits shard;
* ``skyrl fused``: SkyRL's own fused head (``trainer.fused_lm_head_logprob=true``:
  ``from_parallel_hidden_to_logprobs`` and ``_fused_vocab_parallel_entropy_from_hidden``);
* ``ours unfused`` / ``ours fused``: the same calls to
  :mod:`megatron_vocabstats.integrations.skyrl_ops`, what
  ``import megatron_vocabstats.integrations.skyrl`` binds in their place.

SkyRL's entropy uses Megatron's tensor-parallel group: ``parallel_state`` is initialised at the
size of ``tp_group`` if it is not (``tp_group`` must be a process group: SkyRL's code always
communicates).

May import: torch, megatron-core, :mod:`megatron_vocabstats.integrations` and SkyRL.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MU = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
NAMES = ("from_parallel_logits_to_logprobs", "vocab_parallel_entropy",
         "from_parallel_hidden_to_logprobs", "_fused_vocab_parallel_entropy_from_hidden")


def skyrl_functions() -> dict:
    """SkyRL's own functions (the originals, also while the integration is applied)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    import _framework_stubs

    try:
        module = importlib.import_module(MU)
    except ImportError:
        module = _framework_stubs.load("skyrl")[MU]
    return {n: getattr(getattr(module, n), "__wrapped__", getattr(module, n)) for n in NAMES}


def _parallel_state(tp: int) -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def cases(T: int, V: int, H: int, tp_group, dtype) -> dict:
    """Zero-argument callables, one training step each from this rank's ``[1, T, V / tp]``
    logits shard (or ``[1, T, H]`` hidden states and the ``[V / tp, H]`` weight shard) in
    ``dtype``: log-probs forward and backward, entropy as a no-grad metric."""
    from megatron_vocabstats.integrations import skyrl_ops

    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    _parallel_state(tp)
    theirs = skyrl_functions()
    ours = {n: getattr(skyrl_ops, n) for n in NAMES}
    skyrl_ops.set_helpers({n: getattr(importlib.import_module(MU), n)
                           for n in skyrl_ops.HELPERS})
    width = V // tp
    start, end = rank * width, (rank + 1) * width

    def target():
        return torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(7))

    def unfused(fns):
        def run():
            gen = torch.Generator().manual_seed(1000 + rank)  # shards differ across ranks
            logits = torch.randn(1, T, width, generator=gen).to(dtype).requires_grad_()
            lp = fns["from_parallel_logits_to_logprobs"](logits, target(), start, end, tp_group)
            lp.sum().backward()
            with torch.no_grad(), torch._dynamo.config.patch(disable=True):
                fns["vocab_parallel_entropy"](logits.detach())
        return run

    def fused(fns):
        def run():
            gen = torch.Generator().manual_seed(1000 + rank)
            hidden = torch.randn(1, T, H, generator=gen).to(dtype).requires_grad_()
            weight = (torch.randn(width, H, generator=gen) / H**0.5).to(dtype).requires_grad_()
            lp = fns["from_parallel_hidden_to_logprobs"](hidden, weight, target(), start, end,
                                                         tp_group)
            lp.sum().backward()
            with torch.no_grad():
                fns["_fused_vocab_parallel_entropy_from_hidden"](hidden, weight, tp_group)
        return run

    return {"skyrl": unfused(theirs), "skyrl fused": fused(theirs),
            "ours unfused": unfused(ours), "ours fused": fused(ours)}
