"""transformer-engine's ``thd_get_partitioned_indices`` gives the same indices as
``context_parallel_indices`` (needs CUDA and transformer-engine; skipped otherwise).

Run: ``python -m pytest tests/gpu/test_packing_te.py``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vocabstats.packing import context_parallel_indices, pack_sequences

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
tex = pytest.importorskip("transformer_engine_torch", reason="needs transformer-engine")

LAYOUTS = [
    [3, 5, 1],
    [1],
    [0, 17, 2, 0, 9],
    [64, 3, 128, 1, 1, 33],
]


@pytest.mark.parametrize("lengths", LAYOUTS, ids=str)
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("extra", [0, 1])
def test_same_indices_as_transformer_engine(lengths, cp, extra):
    seqs = [torch.randint(0, 100, (n,), device="cuda") for n in lengths]
    needed = sum(-(-n // (2 * cp)) * 2 * cp for n in lengths)
    batch = pack_sequences(seqs, alignment=2 * cp, total_length=needed + extra * 2 * cp,
                           seq_params=False)
    total = batch.tokens.shape[1]
    for rank in range(cp):
        ours = context_parallel_indices(batch.cu_seqlens_padded, total, cp_size=cp, cp_rank=rank)
        theirs = tex.thd_get_partitioned_indices(batch.cu_seqlens_padded, total, cp, rank)
        assert ours.device == theirs.device
        assert torch.equal(ours, theirs.to(torch.int64)), (lengths, cp, rank)
