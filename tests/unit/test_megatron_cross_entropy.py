"""The drop-in against Megatron's vocab_parallel_cross_entropy on tp = 1, 2 (gloo, torchrun)."""

import pytest

from conftest import check_case
from dist.megatron_ce_cases import CASES

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_case(tp, name):
    pytest.importorskip("megatron.core")
    check_case("megatron_ce_cases.py", tp, name)
