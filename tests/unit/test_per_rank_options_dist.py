"""Every op at tp 2 on gloo with each per-rank option differing raises promptly on
every rank (dist/per_rank_options_cases.py; one launch, a short gloo timeout)."""

import pytest

from conftest import check_case
from dist.per_rank_options_cases import CASES

SCRIPT = "per_rank_options_cases.py"


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    check_case(SCRIPT, 2, name)
