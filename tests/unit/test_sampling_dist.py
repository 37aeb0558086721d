"""Sampler log-probs on tp = 1, 2 and 4 gloo ranks launched with torchrun
(dist/sampling_cases.py)."""

import pytest

from conftest import check_case
from dist.sampling_cases import CASES

SCRIPT = "sampling_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
