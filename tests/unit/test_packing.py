"""Single-process tests of packing, label shift, context-parallel indices, unpacking and
``forbid_host_sync``; the multi-process (cp, tp x cp) cases are in test_packing_dist.py."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from _reference import reference_stats
from megatron_vocabstats import vocab_parallel_stats
from megatron_vocabstats.packing import (
    IGNORE_INDEX,
    context_parallel_indices,
    gather_from_context_parallel,
    make_packed_seq_params,
    pack_sequences,
    sequence_alignment,
    shard_for_context_parallel,
    shift_packed_labels,
    unpack_sequences,
)
from megatron_vocabstats.testing import HostSyncError, forbid_host_sync


# ----------------------------------------------------------------------------- loop references


def reference_pack(seqs, alignment, total_length=None, pad=0, ignore=IGNORE_INDEX):
    """The docstring's reference semantics, one Python loop over sequences."""
    padded = [-(-len(s) // alignment) * alignment for s in seqs]
    total = sum(padded) if total_length is None else total_length
    padded[-1] += total - sum(padded)
    tokens, labels, positions = [], [], []
    for s, p in zip(seqs, padded):
        s = [int(v) for v in s]
        tokens += s + [pad] * (p - len(s))
        labels += (s[1:] + [ignore] * (p - len(s) + 1))[:p]
        positions += list(range(p))
    cu, cu_p = [0], [0]
    for s, p in zip(seqs, padded):
        cu.append(cu[-1] + len(s))
        cu_p.append(cu_p[-1] + p)
    return dict(tokens=tokens, labels=labels, position_ids=positions, cu=cu, cu_p=cu_p,
                max_seqlen=max(padded))


def reference_cp_indices(cu_p, cp, rank):
    """Chunks r and 2cp-1-r of every padded sequence, by slicing."""
    out = []
    for start, end in zip(cu_p[:-1], cu_p[1:]):
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += range(start + c * chunk, start + (c + 1) * chunk)
    return out


def random_lengths(gen, n, high):
    return torch.randint(0, high, (n,), generator=gen).tolist()


def make_seqs(lengths, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def assert_matches_reference(batch, ref):
    assert batch.tokens.tolist() == [ref["tokens"]]
    assert batch.labels.tolist() == [ref["labels"]]
    assert batch.position_ids.tolist() == [ref["position_ids"]]
    assert batch.loss_mask.tolist() == [[float(v != IGNORE_INDEX) for v in ref["labels"]]]
    assert batch.cu_seqlens.tolist() == ref["cu"]
    assert batch.cu_seqlens_padded.tolist() == ref["cu_p"]
    assert batch.cu_seqlens.dtype == batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.loss_mask.dtype == torch.float32


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("fp8", [1, 16, 32])
def test_sequence_alignment_is_the_smallest_safe_multiple(cp, tp, sp, fp8):
    a = sequence_alignment(cp, tp, sp, fp8)
    t = tp if sp else 1

    def safe(length):  # any number of sequences of this padded length
        return (cp == 1 or length % (2 * cp) == 0) and length % (cp * t * fp8) == 0

    assert safe(a)
    for p in (2, 3, 5, 7):  # no proper divisor of a is safe (one sequence suffices to show it)
        if a % p == 0:
            assert not safe(a // p), (a, p)
    if not sp and fp8 == 1:
        assert a == (2 * cp if cp > 1 else 1)


def test_sequence_alignment_examples_and_errors():
    assert sequence_alignment() == 1
    assert sequence_alignment(cp_size=2) == 4
    assert sequence_alignment(tp_size=4, sequence_parallel=True) == 4
    assert sequence_alignment(fp8_multiple=16) == 16
    # cp=2, tp=4 with SP: lcm(4, 4) = 4 would leave 2 tokens per cp rank for 4 tp ranks.
    assert sequence_alignment(cp_size=2, tp_size=4, sequence_parallel=True) == 8
    for kwargs, name in [({"cp_size": 0}, "cp_size"), ({"tp_size": 1.5}, "tp_size"),
                         ({"fp8_multiple": -16}, "fp8_multiple"),
                         ({"sequence_parallel": 1}, "sequence_parallel")]:
        with pytest.raises(ValueError, match=name):
            sequence_alignment(**kwargs)


# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("alignment", [1, 4, 6])
@pytest.mark.parametrize("extra", [0, 2])
def test_pack_list_matches_loop_reference(alignment, extra):
    gen = torch.Generator().manual_seed(alignment * 10 + extra)
    lengths = random_lengths(gen, 7, 12) + [1, 0]
    seqs = make_seqs(lengths, seed=alignment)
    needed = sum(-(-n // alignment) * alignment for n in lengths)
    total = needed + extra * alignment
    batch = pack_sequences(seqs, alignment=alignment, total_length=total, pad_token_id=3,
                           seq_params=False)
    ref = reference_pack(seqs, alignment, total, pad=3)
    assert_matches_reference(batch, ref)
    assert batch.max_seqlen == ref["max_seqlen"]
    assert batch.tokens.shape == (1, total)
    assert batch.packed_seq_params is None


@pytest.mark.parametrize("as_tensor", [True, False], ids=["lengths_tensor", "lengths_ints"])
def test_pack_padded_batch_equals_list(as_tensor):
    lengths = [3, 5, 1, 0, 6]
    seqs = make_seqs(lengths, seed=1)
    width = 7
    rows = torch.full((len(seqs), width), 99)
    for b, s in enumerate(seqs):
        rows[b, : len(s)] = s
    lens = torch.tensor(lengths) if as_tensor else lengths
    batch = pack_sequences(rows, lens, alignment=4, seq_params=False)
    # Lengths on the device: the static bound B * ceil(S / a) * a, read from no value.
    total = len(lengths) * 8 if as_tensor else sum(-(-n // 4) * 4 for n in lengths)
    assert_matches_reference(batch, reference_pack(seqs, 4, total))
    assert batch.max_seqlen == (total if as_tensor else 8)
    same_total = pack_sequences(rows, lens, alignment=4, total_length=40, seq_params=False)
    from_list = pack_sequences(seqs, alignment=4, total_length=40, seq_params=False)
    for field in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
                  "cu_seqlens_padded"):
        assert torch.equal(getattr(same_total, field), getattr(from_list, field)), field


def test_labels_never_cross_a_sequence_and_equal_scoring_each_alone():
    tokens = torch.tensor([[10, 11, 12, 20, 21]])
    cu = torch.tensor([0, 3, 5])
    labels, mask = shift_packed_labels(tokens, cu)
    assert labels.tolist() == [[11, 12, IGNORE_INDEX, 21, IGNORE_INDEX]]
    assert mask.tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0]]
    packed = pack_sequences([torch.tensor([10, 11, 12]), torch.tensor([20, 21])], seq_params=False)
    assert torch.equal(packed.labels, labels) and torch.equal(packed.tokens, tokens)
    assert packed.cu_seqlens.tolist() == [0, 3, 5]
    # A rolled label would put 20 (the next sequence's first token) at position 2.
    assert 20 not in labels[0, :3].tolist()

    table = torch.randn(32, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    st = vocab_parallel_stats(table[tokens[0]].float(), labels[0])
    for start, end in [(0, 3), (3, 5)]:
        alone = tokens[0, start:end]
        alone_labels = torch.cat([alone[1:], torch.tensor([IGNORE_INDEX])])
        one = vocab_parallel_stats(table[alone].float(), alone_labels)
        assert torch.equal(st.logprobs[start:end], one.logprobs)
        assert torch.equal(st.entropy[start:end], one.entropy)
        ref_lp, ref_h, _ = reference_stats(table[alone], alone_labels)
        assert (one.logprobs.double() - ref_lp).abs().max() <= 1e-5
        assert (one.entropy.double() - ref_h).abs().max() <= 1e-5


def test_shift_with_padding_between_sequences():
    tokens = torch.tensor([10, 11, 12, 0, 20, 21, 0, 0])
    labels, mask = shift_packed_labels(tokens, torch.tensor([0, 3, 5]),
                                       cu_seqlens_padded=torch.tensor([0, 4, 8]))
    assert labels.tolist() == [11, 12, -100, -100, 21, -100, -100, -100]
    assert mask.tolist() == [1, 1, 0, 0, 1, 0, 0, 0]


def test_length_one_sequence_is_ignored_and_leaves_others_alone():
    seqs = [torch.tensor([4, 5, 6]), torch.tensor([7]), torch.tensor([8, 9])]
    batch = pack_sequences(seqs, alignment=2, seq_params=False)
    assert batch.labels.tolist() == [[5, 6, -100, -100, -100, -100, 9, -100]]
    table = torch.randn(16, 12, generator=torch.Generator().manual_seed(1))
    st = vocab_parallel_stats(table[batch.tokens[0]], batch.labels[0])
    assert st.logprobs[4].item() == 0.0 and st.entropy[4].item() == 0.0
    without = pack_sequences([seqs[0], seqs[2]], alignment=2, seq_params=False)
    st2 = vocab_parallel_stats(table[without.tokens[0]], without.labels[0])
    kept = [0, 1, 2, 3, 6, 7]  # the positions of the first and third sequences
    assert torch.equal(st.logprobs[kept], st2.logprobs)
    assert torch.equal(st.entropy[kept], st2.entropy)


def test_only_padding():
    batch = pack_sequences([torch.empty(0, dtype=torch.int64)], alignment=4, total_length=8,
                           pad_token_id=2, seq_params=False)
    assert batch.tokens.tolist() == [[2] * 8]
    assert batch.labels.tolist() == [[IGNORE_INDEX] * 8]
    assert batch.loss_mask.sum().item() == 0.0
    assert batch.cu_seqlens.tolist() == [0, 0] and batch.cu_seqlens_padded.tolist() == [0, 8]
    rows = pack_sequences(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                          alignment=2, seq_params=False)
    assert rows.labels.eq(IGNORE_INDEX).all() and rows.cu_seqlens.tolist() == [0, 0, 0]
    st = vocab_parallel_stats(torch.randn(8, 5), batch.labels[0])
    assert st.logprobs.eq(0).all() and st.entropy.eq(0).all()
    out, mask = unpack_sequences(st.logprobs, batch.cu_seqlens, max_seqlen=4,
                                 cu_seqlens_padded=batch.cu_seqlens_padded)
    assert out.shape == (1, 4) and not mask.any()


# ----------------------------------------------------------------------------- PackedSeqParams


@pytest.mark.megatron
def test_packed_seq_params_for_installed_release():
    psp_mod = pytest.importorskip("megatron.core.packed_seq_params")
    fields = {f.name for f in dataclasses.fields(psp_mod.PackedSeqParams)}
    batch = pack_sequences(make_seqs([3, 5, 1]), alignment=4)
    psp = batch.packed_seq_params
    assert isinstance(psp, psp_mod.PackedSeqParams)
    assert psp.qkv_format == "thd"
    assert psp.cu_seqlens_q is batch.cu_seqlens and psp.cu_seqlens_kv is batch.cu_seqlens
    assert psp.cu_seqlens_q_padded is batch.cu_seqlens_padded
    assert psp.cu_seqlens_kv_padded is batch.cu_seqlens_padded
    assert psp.max_seqlen_q == psp.max_seqlen_kv == batch.max_seqlen == 8
    if "pad_between_seqs" in fields:  # 0.19+
        assert psp.pad_between_seqs is True
        assert pack_sequences(make_seqs([4, 8]), alignment=4).packed_seq_params \
            .pad_between_seqs is False
    if "total_tokens" in fields:  # Mamba-only, derived by Megatron with a host sync
        assert psp.total_tokens is None and psp.seq_idx is None


def test_without_megatron_packed_seq_params_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.packed_seq_params", None)
    batch = pack_sequences(make_seqs([3, 2]))
    assert batch.packed_seq_params is None
    assert make_packed_seq_params(batch.cu_seqlens, batch.cu_seqlens_padded, 3) is None
    assert batch.labels.tolist() == [reference_pack(make_seqs([3, 2]), 1)["labels"]]


# ----------------------------------------------------------------------------- context parallel


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_indices_match_chunk_slicing_and_partition(cp):
    gen = torch.Generator().manual_seed(cp)
    padded = [2 * cp * k for k in random_lengths(gen, 6, 4)] + [2 * cp]
    cu_p = [0]
    for p in padded:
        cu_p.append(cu_p[-1] + p)
    total = cu_p[-1]
    seen = []
    for rank in range(cp):
        idx = context_parallel_indices(torch.tensor(cu_p, dtype=torch.int32), total, cp_size=cp,
                                       cp_rank=rank)
        assert idx.dtype == torch.int64 and idx.shape == (total // cp,)
        assert idx.tolist() == reference_cp_indices(cu_p, cp, rank)
        seen += idx.tolist()
    assert sorted(seen) == list(range(total))


def test_cp_indices_issue_example():
    # lengths [3, 5, 1] padded to 4: sequences [0,4), [4,12), [12,16); chunks of 1, 2, 1.
    cu_p = torch.tensor([0, 4, 12, 16])
    assert context_parallel_indices(cu_p, 16, cp_size=2, cp_rank=0).tolist() == \
        [0, 3, 4, 5, 10, 11, 12, 15]
    assert context_parallel_indices(cu_p, 16, cp_size=2, cp_rank=1).tolist() == \
        [1, 2, 6, 7, 8, 9, 13, 14]


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_indices_for_bs_batch_equal_megatron_chunking(cp):
    b, s = 3, 4 * cp
    x = torch.arange(b * s).view(b, s)
    for rank in range(cp):
        idx = context_parallel_indices(None, s, cp_size=cp, cp_rank=rank)
        chunks = x.view(b, 2 * cp, s // (2 * cp))
        megatron = chunks[:, [rank, 2 * cp - 1 - rank]].reshape(b, -1)
        assert torch.equal(x.index_select(1, idx), megatron)


def test_cp1_and_no_group_are_identity():
    x = torch.randn(1, 6)
    assert shard_for_context_parallel(x, None) is x
    assert gather_from_context_parallel(x, None) is x
    batch = pack_sequences(make_seqs([3, 2]), seq_params=False)
    assert shard_for_context_parallel(batch, None) is batch
    idx = context_parallel_indices(batch.cu_seqlens_padded, 5, cp_size=1, cp_rank=0)
    assert idx.tolist() == list(range(5))


# ----------------------------------------------------------------------------- unpacking


def test_unpack_matches_loop_reference_and_is_differentiable():
    lengths = [3, 0, 5, 1]  # padded to [4, 0, 8, 4]
    cu = torch.tensor([0, 3, 3, 8, 9])
    cu_p = torch.tensor([0, 4, 4, 12, 16])
    values = torch.randn(16, 2, dtype=torch.float64, requires_grad=True)
    out, mask = unpack_sequences(values, cu, max_seqlen=6, cu_seqlens_padded=cu_p, dim=0,
                                 padding_value=-1.0)
    assert out.shape == (4, 6, 2) and mask.shape == (4, 6) and mask.dtype == torch.bool
    expected = torch.full((4, 6, 2), -1.0, dtype=torch.float64)
    for i, (n, start) in enumerate(zip(lengths, cu_p[:-1].tolist())):
        expected[i, :n] = values.detach()[start:start + n]
        assert mask[i].tolist() == [j < n for j in range(6)]
    assert torch.equal(out, expected)
    weights = torch.randn(4, 6, 2, dtype=torch.float64)
    (out * weights).sum().backward()
    expected_grad = torch.zeros_like(values)
    for i, (n, start) in enumerate(zip(lengths, cu_p[:-1].tolist())):
        expected_grad[start:start + n] = weights[i, :n]
    assert torch.equal(values.grad, expected_grad)
    row, _ = unpack_sequences(values.detach()[:, 0].unsqueeze(0), cu, max_seqlen=6,
                              cu_seqlens_padded=cu_p)
    assert row.shape == (1, 4, 6) and torch.equal(row[0][mask], expected[..., 0][mask])
    plain, _ = unpack_sequences(torch.arange(9), cu, max_seqlen=5)
    assert plain.tolist() == [[0, 1, 2, 0, 0], [0] * 5, [3, 4, 5, 6, 7], [8, 0, 0, 0, 0]]


# ----------------------------------------------------------------------------- bad input


def test_bad_cu_seqlens_are_named():
    tokens = torch.arange(5)
    cases = [
        (torch.tensor([1, 3, 5]), "cu_seqlens must start at 0"),
        (torch.tensor([0, 3, 2, 5]), "cu_seqlens must be non-decreasing"),
        (torch.tensor([0, 3, 4]), "cu_seqlens must end at the packed length T=5"),
        (torch.tensor([0.0, 5.0]), "cu_seqlens must be a 1-D integer tensor"),
        (torch.tensor([5]), "cu_seqlens must be a 1-D integer tensor"),
    ]
    for cu, message in cases:
        with pytest.raises(ValueError, match=message):
            shift_packed_labels(tokens, cu)
        with pytest.raises(ValueError, match=message):
            unpack_sequences(tokens, cu, max_seqlen=5)
    with pytest.raises(ValueError, match="cu_seqlens_padded must end at the packed length"):
        shift_packed_labels(tokens, torch.tensor([0, 3, 4]),
                            cu_seqlens_padded=torch.tensor([0, 4, 6]))
    with pytest.raises(ValueError, match="cu_seqlens: sequence 1 is longer than its padded"):
        unpack_sequences(tokens, torch.tensor([0, 2, 5]), max_seqlen=5,
                         cu_seqlens_padded=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="max_seqlen=2 is shorter than the longest sequence"):
        unpack_sequences(tokens, torch.tensor([0, 3, 5]), max_seqlen=2)


def test_cu_not_aligned_for_cp_is_named():
    cu_p = torch.tensor([0, 4, 10, 16])  # the second sequence has 6 tokens, not a multiple of 4
    with pytest.raises(ValueError, match=r"cu_seqlens_padded: sequence 1 has padded length 6, "
                                         r"not a multiple of 4 \(= 2 \* cp_size for cp_size=2"):
        context_parallel_indices(cu_p, 16, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="total_tokens has 10 tokens in all, not a multiple of 4"):
        context_parallel_indices(torch.tensor([0, 10]), 10, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"cp_rank must be an int in \[0, 2\)"):
        context_parallel_indices(cu_p, 16, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cu_seqlens_padded must end at the packed length T=20"):
        context_parallel_indices(torch.tensor([0, 4, 16]), 20, cp_size=2, cp_rank=0)


def test_bad_pack_arguments_are_named():
    rows = torch.zeros(3, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"lengths holds 6, outside \[0, S=5\]"):
        pack_sequences(rows, torch.tensor([3, 6, 1]), seq_params=False)
    with pytest.raises(ValueError, match=r"lengths holds 6, outside \[0, S=5\]"):
        pack_sequences(rows, [3, 6, 1], seq_params=False)
    with pytest.raises(ValueError, match="lengths is required"):
        pack_sequences(rows, seq_params=False)
    with pytest.raises(ValueError, match=r"lengths must be an integer tensor \[B=3\]"):
        pack_sequences(rows, torch.tensor([3, 1]), seq_params=False)
    with pytest.raises(ValueError, match="lengths is only for a padded batch"):
        pack_sequences(make_seqs([2]), [2], seq_params=False)
    with pytest.raises(ValueError, match="sequences is empty"):
        pack_sequences([], seq_params=False)
    with pytest.raises(ValueError, match=r"sequences\[1\] must be a 1-D integer tensor"):
        pack_sequences([torch.arange(3), torch.ones(2)], seq_params=False)
    with pytest.raises(ValueError, match="alignment must be an int in \\[1, "):
        pack_sequences(make_seqs([2]), alignment=0, seq_params=False)
    with pytest.raises(ValueError, match="total_length must be a non-negative multiple of "
                                         "alignment=4"):
        pack_sequences(make_seqs([2]), alignment=4, total_length=6, seq_params=False)
    with pytest.raises(ValueError, match="total_length=4 is smaller than the packed length 8"):
        pack_sequences(make_seqs([3, 2]), alignment=4, total_length=4, seq_params=False)
    with pytest.raises(ValueError, match="total_length=8 is smaller than the packed length 16"):
        pack_sequences(rows, torch.tensor([3, 5, 1]), alignment=4, total_length=8,
                       seq_params=False)
    with pytest.raises(ValueError, match="dim=2 is not a dimension of x"):
        shard_for_context_parallel(torch.zeros(1, 4), None, dim=2)


# ----------------------------------------------------------------------------- host syncs


def _hot_path(validate):
    rows = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 0, 0, 0, 0]])
    batch = pack_sequences(rows, torch.tensor([3, 5, 1]), alignment=4, seq_params=False,
                           validate=validate)
    labels, _ = shift_packed_labels(batch.tokens, batch.cu_seqlens,
                                    cu_seqlens_padded=batch.cu_seqlens_padded, validate=validate)
    pieces = [context_parallel_indices(batch.cu_seqlens_padded, batch.tokens.shape[1], cp_size=2,
                                       cp_rank=r, validate=validate) for r in range(2)]
    values = batch.tokens[0].index_select(0, torch.cat(pieces)).float()
    return unpack_sequences(values, batch.cu_seqlens, max_seqlen=5,
                            cu_seqlens_padded=batch.cu_seqlens_padded, validate=validate)


def test_packing_and_unpacking_never_sync_with_the_host():
    with forbid_host_sync():
        _hot_path(validate=False)
        pack_sequences(make_seqs([3, 1]), alignment=2, seq_params=False, validate=False)
    with pytest.raises(HostSyncError, match="_local_scalar_dense|Tensor.tolist"):
        with forbid_host_sync():
            _hot_path(validate=True)


def test_vocab_parallel_stats_without_validation_never_syncs():
    logits = torch.randn(9, 33, requires_grad=True)
    target = torch.tensor([1, 2, -100, 4, 5, 6, 7, 8, -100])
    with forbid_host_sync():
        st = vocab_parallel_stats(logits, target, validate=False, chunk_size=4)
        (st.logprobs.sum() + st.entropy.sum()).backward()
    assert logits.grad is not None


@pytest.mark.parametrize("name, fn", [
    ("item", lambda x: x[0].item()),
    ("int", lambda x: int(x[0])),
    ("if", lambda x: 1 if x[0] else 0),
    ("tolist", lambda x: x.tolist()),
    ("numpy", lambda x: x.numpy()),
    ("equal", lambda x: torch.equal(x, x)),
    ("nonzero", lambda x: x.nonzero()),
    ("where1", lambda x: torch.where(x > 1)),
    ("masked_select", lambda x: x.masked_select(x > 1)),
    ("mask_index", lambda x: x[x > 1]),
    ("mask_assign", lambda x: x.clone().__setitem__(x > 1, torch.tensor([7, 7]))),
    ("unique", lambda x: x.unique()),
    ("repeat_interleave", lambda x: torch.repeat_interleave(x)),
    ("bincount", lambda x: torch.bincount(x)),
])
def test_forbid_host_sync_rejects(name, fn):
    x = torch.tensor([0, 1, 2, 3])
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            fn(x)
    fn(x)  # and the mode is gone afterwards


def test_forbid_host_sync_allows_static_ops_and_listed_ones():
    x = torch.tensor([0, 1, 2, 3])
    with forbid_host_sync():
        x[torch.tensor([3, 0])]
        x[1:3].sum()
        torch.repeat_interleave(x, output_size=6)
        torch.where(x > 1, x, 0)
        torch.tensor([1, 2]) + x.shape[0]
    with forbid_host_sync(allow=("aten::nonzero", "Tensor.tolist")):
        x.nonzero()
        x.tolist()


def test_forbid_host_sync_rejects_device_to_host_copies():
    # A meta tensor stands in for device memory on a CPU-only machine.
    x = torch.empty(3, device="meta")
    for copy in (lambda: x.cpu(), lambda: x.to("cpu"), lambda: torch.empty(3).copy_(x)):
        with pytest.raises(HostSyncError, match="copies device memory to the host"):
            with forbid_host_sync():
                copy()
    with forbid_host_sync():
        torch.empty(3).to("cpu")
        torch.empty(3).copy_(torch.ones(3))
