"""The check builder and LogitsSpec on tp = 2 gloo ranks (dist/agreement_cases.py)."""

import pytest

from conftest import check_case
from dist.agreement_cases import CASES

SCRIPT = "agreement_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [2])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
