"""The loss functions on tp = 1, 2 gloo ranks equal the float64 single-process losses.

Each case in ``dist/losses_cases.py`` is its own test; one torchrun launch per tp size runs them
all (see ``conftest.torchrun_results``).
"""

import pytest

from conftest import check_case
from dist.losses_cases import CASES

SCRIPT = "losses_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
