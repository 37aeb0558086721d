"""Every Megatron LM-head path is fused or named: the schedule plan, GTP weight sharding, the
fp32 logit dtype and the 'linear' cross-entropy fusion (tiny GPTModel on tp = 1, 2 gloo ranks)."""

import pytest

from conftest import check_case
from dist.fused_head_coverage_cases import CASES

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_case(tp, name):
    pytest.importorskip("megatron.core")
    check_case("fused_head_coverage_cases.py", tp, name)
