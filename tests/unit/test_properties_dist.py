"""Randomised property cases (fixed seeds) on tp = 2 gloo ranks launched with torchrun.

The cases are in ``dist/properties_cases.py``; one torchrun launch runs them all (see
``conftest.torchrun_results``). tp = 1 is covered in-process by ``test_properties.py``.
"""

import pytest

from conftest import check_case
from dist.properties_cases import CASES

SCRIPT = "properties_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [2])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
