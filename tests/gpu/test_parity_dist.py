"""Tensor-parallel parity with float64 on NCCL: tp = 2 and tp = 4, one GPU per rank.

Each case of ``dist/parity_cases.py`` is a test; one torchrun launch per tp size runs them all
(the unit suite's launcher, ``tests/unit/conftest.py``). NCCL refuses two ranks on one device, so
tp = N needs N GPUs: with fewer, every case skips with "needs N GPUs (found k)" and nothing is
launched.
"""

import os

import pytest
from _suite import ROOT, gpu_skip_reason, load_module

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist", "parity_cases.py")
CASES = load_module(SCRIPT, "gpu_parity_cases").CASES
# Its torchrun_results joins tests/unit/dist with the script name: an absolute path stays as is.
_launcher = load_module(os.path.join(ROOT, "tests", "unit", "conftest.py"), "unit_conftest")


def check_parity(tp: int, name: str) -> None:
    reason = gpu_skip_reason(tp)
    if reason is not None:
        pytest.skip(reason)
    _launcher.check_case(SCRIPT, tp, name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2(name):
    check_parity(2, name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp4(name):
    check_parity(4, name)
