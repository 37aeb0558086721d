"""Issue 14, core ops on tp = 2 gloo ranks launched with torchrun (dist/hardening_core_cases.py)."""

import pytest

from conftest import check_case
from dist.hardening_core_cases import CASES

SCRIPT = "hardening_core_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [2])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
