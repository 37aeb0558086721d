"""The NeMo-RL integration on 2 gloo ranks (torchrun) at tp 1, tp 2 and cp 2: the cases of
``dist/nemo_rl_cases.py``, all in one launch, against the stand-in of ``_nemo_rl_standin``
(NeMo-RL ships no installable package) and float64 references."""

import pytest

from conftest import check_case
from dist.nemo_rl_cases import CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    check_case("nemo_rl_cases.py", 2, name)
