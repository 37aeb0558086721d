"""``parity_cases.py`` on gloo with CPU tensors, for machines without GPUs: checks the logic of
the NCCL cases where no GPU is lent: every CPU case they name exists and runs, each calls the ops
through :func:`parity_cases.on_device` (counted here), the swap is undone afterwards, and the
cases written for NCCL pass. Run by ``tests/unit/test_gpu_suite.py`` through the unit suite's
torchrun launcher.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_cases  # noqa: E402  (puts tests/unit/dist on sys.path)
from _harness import Cases, main  # noqa: E402

import megatron_vocabstats  # noqa: E402

CALLS = []
_on_device = parity_cases.on_device


def counting_on_device(op, dev):
    wrapped = _on_device(op, dev)

    def counted(*args, **kwargs):
        CALLS.append(op.__name__)
        return wrapped(*args, **kwargs)

    return counted


def checked(name, fn):
    def case(group):
        CALLS.clear()
        fn(group)
        if not name.endswith("_on_nccl"):
            assert CALLS, f"{name} never called an op through on_device"
        for module in (parity_cases.core_cases, parity_cases.fused_cases):
            for op in parity_cases.OPS:
                if hasattr(module, op):
                    assert getattr(module, op) is getattr(megatron_vocabstats, op), \
                        f"{module.__name__}.{op} was left swapped"

    return case


parity_cases.device = lambda: torch.device("cpu")
parity_cases.on_device = counting_on_device

if __name__ == "__main__":
    main(Cases({name: checked(name, fn) for name, fn in parity_cases.CASES.items()}))
