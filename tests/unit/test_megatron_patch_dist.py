"""A tiny GPTModel on tp = 1, 2 gloo ranks gives the same loss and gradients with the patch."""

import pytest

from conftest import check_case
from dist.megatron_patch_cases import CASES

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2])
def test_case(tp, name):
    pytest.importorskip("megatron.core")
    check_case("megatron_patch_cases.py", tp, name)
