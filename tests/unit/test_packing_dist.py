"""Packing under context parallelism: cp = 2 and 4, and tp=2 x cp=2, on gloo ranks (torchrun).

Each case in ``dist/packing_cases.py`` is its own test; one torchrun launch per world size runs
them all (see ``conftest.torchrun_results``).
"""

import pytest

from conftest import check_case
from dist.packing_cases import CASES

SCRIPT = "packing_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_case(world, name):
    check_case(SCRIPT, world, name)
