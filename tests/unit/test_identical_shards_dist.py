"""Identical shards on every rank on 2 and 4 gloo ranks (torchrun): the cases of
``dist/identical_shards_cases.py``, one launch per world size (``conftest.torchrun_results``)."""

import pytest

from conftest import check_case
from dist.identical_shards_cases import CASES


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, nproc):
    check_case("identical_shards_cases.py", nproc, name)
