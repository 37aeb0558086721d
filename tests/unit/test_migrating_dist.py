"""The multi-rank rows of docs/migrating.md on 2 gloo ranks (tp = 2 or cp = 2, torchrun).

Each case in ``dist/migrating_cases.py`` is its own test; one torchrun launch runs them all (see
``conftest.torchrun_results``). Cases named ``megatron_*`` compare with megatron-core itself and
are marked ``megatron``; the torchtitan and raw-logit top-k cases skip until ``vocab_start`` and
``vocab_parallel_topk_logits`` / ``vocab_parallel_gather_logits`` exist.
"""

import pytest

from conftest import check_case
from dist.migrating_cases import CASES

SCRIPT = "migrating_cases.py"


def _params():
    for name in sorted(CASES):
        marks = [pytest.mark.megatron] if name.startswith("megatron_") else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_case(name):
    if name.startswith("megatron_"):
        pytest.importorskip("megatron.core")
    check_case(SCRIPT, 2, name)
