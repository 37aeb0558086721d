"""Batch-invariant mode and host-sync freedom on tp = 1, 2, 4 gloo ranks launched with torchrun.

Each case in ``dist/batch_invariant_cases.py`` is its own test; one torchrun launch per tp size
runs them all (see ``conftest.torchrun_results``).
"""

import pytest

from conftest import check_case
from dist.batch_invariant_cases import CASES

SCRIPT = "batch_invariant_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
