"""Core ops on tp = 2 gloo ranks launched with torchrun (dist/hostile_inputs_cases.py)."""

import pytest

from conftest import check_case
from dist.hostile_inputs_cases import CASES

SCRIPT = "hostile_inputs_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [2])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
