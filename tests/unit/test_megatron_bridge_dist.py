"""Megatron-Bridge's real SFT ``forward_step`` with ``import megatron_vocabstats.patch`` on gloo
ranks (torchrun): the cases of ``dist/megatron_bridge_cases.py`` at tp = 1 and tp = 2, each size
in one launch (see ``conftest.torchrun_results``). They need the megatron-bridge 0.3.1 wheel
(``requirements/py311-nodeps.txt``: it needs megatron-core < 0.17, the oldest leg); without it
they skip."""

import pytest

import _framework_stubs
from conftest import check_case
from dist.megatron_bridge_cases import CASES

pytestmark = pytest.mark.megatron
if _framework_stubs.root("megatron.bridge") is None:  # skip without launching torchrun
    pytest.skip(f"megatron-bridge is not installed ({_framework_stubs.INSTALL['megatron.bridge']})",
                allow_module_level=True)


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, nproc):
    check_case("megatron_bridge_cases.py", nproc, name)
