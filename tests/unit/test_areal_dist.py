"""The AReaL integration against AReaL's real code on gloo ranks (torchrun): the cases of
``dist/areal_cases.py`` at tp = 1 and tp = 2, each size in one launch (see
``conftest.torchrun_results``). They need the AReaL wheel (``requirements/py311-nodeps.txt``);
without it they skip."""

import pytest

from conftest import check_case
from dist.areal_cases import CASES


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, nproc):
    check_case("areal_cases.py", nproc, name)
