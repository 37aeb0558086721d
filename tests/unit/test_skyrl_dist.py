"""The SkyRL integration against SkyRL's real code (the ``skyrl==0.3.0`` wheel) on 2 gloo ranks
(torchrun) at tp 1, tp 2 and cp 2: the cases of ``dist/skyrl_cases.py``, all in one launch (see
``conftest.torchrun_results``). They need megatron-core and the SkyRL wheel
(``requirements/py311-nodeps.txt``: SkyRL pins torch 2.11, the oldest leg); without either
they skip."""

import pytest

from conftest import check_case
from dist.skyrl_cases import CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    pytest.importorskip("megatron.core")
    pytest.importorskip("skyrl")
    check_case("skyrl_cases.py", 2, name)
