"""The top-k ops and the distillation loss on tp = 1, 2, 4 gloo ranks launched with torchrun.

Each case in ``dist/topk_cases.py`` is its own test; one torchrun launch per tp size runs them
all (see ``conftest.torchrun_results``).
"""

import pytest

from conftest import check_case
from dist.topk_cases import CASES

SCRIPT = "topk_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
