"""Unequal vocabulary shards given per rank (``vocab_start``) on tp = 2 and 3 gloo ranks
(dist/uneven_cases.py)."""

import pytest

from conftest import check_case
from dist.uneven_cases import CASES

SCRIPT = "uneven_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
