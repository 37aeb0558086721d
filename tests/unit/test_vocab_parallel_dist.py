"""The vocab-parallel op on tp = 1, 2, 3, 4 gloo ranks launched with torchrun.

Each case in ``dist/vocab_parallel_cases.py`` is its own test; one torchrun launch per tp size
runs them all (see ``conftest.torchrun_results``).
"""

import pytest

from conftest import check_case
from dist.vocab_parallel_cases import CASES

SCRIPT = "vocab_parallel_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_case(tp, name):
    check_case(SCRIPT, tp, name)
