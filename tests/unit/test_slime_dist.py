"""The slime integration on 2 gloo ranks at tp 1 and tp 2 (torchrun): the cases of
``dist/slime_cases.py``, all in one launch (see ``conftest.torchrun_results``), against the
stand-in of ``_slime_standin`` and float64 references."""

import pytest

from conftest import check_case
from dist.slime_cases import CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    check_case("slime_cases.py", 2, name)
