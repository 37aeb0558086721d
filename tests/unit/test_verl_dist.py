"""The verl integration against verl's real code on tp = 2 gloo ranks (torchrun): the cases of
``dist/verl_cases.py``, all in one launch (see ``conftest.torchrun_results``). They need
megatron-core and the verl wheel (``requirements/py312-nodeps.txt``); without either they skip."""

import pytest

from conftest import check_case
from dist.verl_cases import CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    pytest.importorskip("megatron.core")
    check_case("verl_cases.py", 2, name)
