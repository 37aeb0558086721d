"""Multi-process cases for packing under context parallelism (tests/unit/test_packing_dist.py).

Logits are a deterministic function of the packed position (a seeded table indexed by the token at
that position), built identically on every rank, so context-parallel sharding only changes which
rank computes which row: results must be bitwise equal to the cp=1 computation.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main  # noqa: E402

from _reference import reference_stats  # noqa: E402
from megatron_vocabstats import vocab_parallel_stats  # noqa: E402
from megatron_vocabstats.packing import (  # noqa: E402
    context_parallel_indices,
    gather_from_context_parallel,
    pack_sequences,
    sequence_alignment,
    shard_for_context_parallel,
    unpack_sequences,
)
from megatron_vocabstats.profiling import count_collectives  # noqa: E402
from megatron_vocabstats.testing import HostSyncError, forbid_host_sync  # noqa: E402

CASES = Cases()
VOCAB = 37


def rank_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def make_sequences(lengths, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


def logits_table(width, dtype=torch.float32, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, width, generator=gen, dtype=torch.float64) * 3).to(dtype)


def position_weights(total):
    """Upstream weights per packed position, the same on every rank."""
    pos = torch.arange(total, dtype=torch.float32)
    return 0.5 + 0.1 * pos, torch.cos(pos)


def score(tokens, labels, table, tp_group=None, columns=None):
    """Stats and logits leaf for tokens [n] (vocab columns ``columns`` of the table)."""
    full = table[tokens]
    leaf = (full if columns is None else full[:, columns]).clone().requires_grad_()
    st = vocab_parallel_stats(leaf, labels, tp_group=tp_group, vocab_size=VOCAB, chunk_size=3)
    return st, leaf


def weighted_backward(lp, ent):
    w_lp, w_h = position_weights(lp.shape[-1])
    (lp * w_lp + ent * w_h).sum().backward()


def check_cp_matches_cp1(batch, cp_group, table, *, tp_group=None, columns=None):
    """cp-sharded stats, gathered, vs the same stats on the whole packed row: bitwise, grads too."""
    cp_rank, cp = rank_size(cp_group)
    tokens, labels = batch.tokens[0], batch.labels[0]
    whole, whole_leaf = score(tokens, labels, table, tp_group, columns)
    weighted_backward(whole.logprobs, whole.entropy)

    local = shard_for_context_parallel(batch, cp_group)
    st, leaf = score(local.tokens[0], local.labels[0], table, tp_group, columns)
    lp = gather_from_context_parallel(st.logprobs.unsqueeze(0), cp_group,
                                      cu_seqlens_padded=batch.cu_seqlens_padded)[0]
    ent = gather_from_context_parallel(st.entropy.unsqueeze(0), cp_group,
                                       cu_seqlens_padded=batch.cu_seqlens_padded)[0]
    weighted_backward(lp, ent)

    assert torch.equal(lp, whole.logprobs), "cp logprobs differ from cp=1"
    assert torch.equal(ent, whole.entropy), "cp entropy differs from cp=1"
    own = context_parallel_indices(batch.cu_seqlens_padded, tokens.numel(), cp_size=cp,
                                   cp_rank=cp_rank)
    assert torch.equal(leaf.grad, whole_leaf.grad.index_select(0, own)), "cp gradient differs"

    ref_lp, ref_h, _ = reference_stats(table.double()[tokens], labels, vocab_size=VOCAB)
    assert (lp.double() - ref_lp).abs().max().item() <= 1e-5
    assert (ent.double() - ref_h).abs().max().item() <= 1e-5
    return lp, ent


def check_each_sequence_alone(batch, seqs, lp, ent, table):
    """The unpacked per-sequence rows equal scoring each sequence by itself."""
    width = max(len(s) for s in seqs)
    lp_rows, mask = unpack_sequences(lp, batch.cu_seqlens, max_seqlen=width,
                                     cu_seqlens_padded=batch.cu_seqlens_padded)
    ent_rows, _ = unpack_sequences(ent, batch.cu_seqlens, max_seqlen=width,
                                   cu_seqlens_padded=batch.cu_seqlens_padded)
    for i, s in enumerate(seqs):
        n = len(s)
        assert mask[i].tolist() == [j < n for j in range(width)]
        alone = torch.cat([s[1:], torch.tensor([-100])])[:n]
        st, _ = score(s, alone, table)
        assert torch.equal(lp_rows[i, :n], st.logprobs), f"sequence {i} depends on the others"
        assert torch.equal(ent_rows[i, :n], st.entropy), f"sequence {i} depends on the others"


@CASES.register
def cp_equals_cp1_bitwise_lengths_3_5_1(group):
    _, cp = rank_size(group)
    seqs = make_sequences([3, 5, 1])
    batch = pack_sequences(seqs, alignment=sequence_alignment(cp_size=cp), seq_params=False)
    a = 2 * cp
    assert batch.cu_seqlens_padded.tolist() == [0, a, a + -(-5 // a) * a, a + -(-5 // a) * a + a]
    if cp == 2:
        assert batch.cu_seqlens_padded.tolist() == [0, 4, 12, 16]
    for dtype in (torch.float32, torch.bfloat16):
        table = logits_table(VOCAB, dtype)
        lp, ent = check_cp_matches_cp1(batch, group, table)
        check_each_sequence_alone(batch, seqs, lp, ent, table)


@CASES.register
def cp_equals_cp1_padded_batch_and_total_padding(group):
    _, cp = rank_size(group)
    seqs = make_sequences([7, 2, 11, 1, 4], seed=3)
    a = sequence_alignment(cp_size=cp)
    rows = torch.zeros(len(seqs), 11, dtype=torch.int64)
    for b, s in enumerate(seqs):
        rows[b, :len(s)] = s
    batch = pack_sequences(rows, torch.tensor([len(s) for s in seqs]), alignment=a,
                           total_length=(11 // a + 1) * a * 5, seq_params=False)
    table = logits_table(VOCAB)
    lp, ent = check_cp_matches_cp1(batch, group, table)
    check_each_sequence_alone(batch, seqs, lp, ent, table)


@CASES.register
def cp_length_one_and_only_padding(group):
    _, cp = rank_size(group)
    table = logits_table(VOCAB)
    one = pack_sequences(make_sequences([1]), alignment=2 * cp, seq_params=False)
    lp, ent = check_cp_matches_cp1(one, group, table)
    assert lp.eq(0).all() and ent.eq(0).all()  # no next token: nothing scored
    empty = pack_sequences([torch.empty(0, dtype=torch.int64)], alignment=2 * cp,
                           total_length=4 * cp, seq_params=False)
    lp, ent = check_cp_matches_cp1(empty, group, table)
    assert lp.eq(0).all() and ent.eq(0).all()


@CASES.register
def tp2_x_cp2_equals_tp2_x_cp1_bitwise(group):
    rank, world = rank_size(group)
    if world != 4:
        raise Skip("needs 4 processes (tp=2 x cp=2)")
    # Every rank creates every group, in the same order.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, cp_rank = rank % 2, rank // 2
    tp_group, cp_group = tp_groups[cp_rank], cp_groups[tp_rank]
    assert dist.get_rank(cp_group) == cp_rank and dist.get_rank(tp_group) == tp_rank
    width = -(-VOCAB // 2)
    table = logits_table(2 * width)  # columns >= VOCAB are padding
    columns = slice(tp_rank * width, (tp_rank + 1) * width)
    seqs = make_sequences([3, 5, 1, 6])
    a = sequence_alignment(cp_size=2, tp_size=2, sequence_parallel=True)
    batch = pack_sequences(seqs, alignment=a, seq_params=False)
    lp, ent = check_cp_matches_cp1(batch, cp_group, table, tp_group=tp_group, columns=columns)
    table_list = [torch.empty_like(lp) for _ in range(world)]
    dist.all_gather(table_list, lp, group=group)
    assert all(torch.equal(table_list[0], t) for t in table_list), "ranks disagree"


@CASES.register
def bs_batch_shard_gather_roundtrip(group):
    rank, cp = rank_size(group)
    x = torch.randn(3, 4 * cp, 5)
    local = shard_for_context_parallel(x, group, dim=1)
    chunks = x.view(3, 2 * cp, 2, 5)
    assert torch.equal(local, chunks[:, [rank, 2 * cp - 1 - rank]].reshape(3, 4, 5))
    assert torch.equal(gather_from_context_parallel(local, group, dim=1), x)


@CASES.register
def thd_roundtrip_any_dim_and_dtype(group):
    _, cp = rank_size(group)
    batch = pack_sequences(make_sequences([5, 0, 9, 2]), alignment=2 * cp, total_length=24 * cp,
                           seq_params=False)
    total = batch.tokens.shape[1]
    cu_p = batch.cu_seqlens_padded
    for x, dim in [(torch.randn(total, 1, 6), 0), (torch.randn(2, total).bfloat16(), 1),
                   (torch.randint(0, 9, (1, total)), 1)]:
        local = shard_for_context_parallel(x, group, cu_seqlens_padded=cu_p, dim=dim)
        back = gather_from_context_parallel(local, group, cu_seqlens_padded=cu_p, dim=dim)
        assert back.dtype == x.dtype and torch.equal(back, x)
    local = shard_for_context_parallel(batch, group)
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        back = gather_from_context_parallel(getattr(local, name), group, cu_seqlens_padded=cu_p)
        assert torch.equal(back, getattr(batch, name)), name
    assert local.cu_seqlens is batch.cu_seqlens and local.max_seqlen == batch.max_seqlen


@CASES.register
def gather_gradient_is_own_slice_without_collectives(group):
    rank, cp = rank_size(group)
    cu_p = torch.tensor([0, 2 * cp, 6 * cp])
    total = 6 * cp
    x = torch.randn(1, total // cp, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(1, total, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with count_collectives() as forward_calls:
        full = gather_from_context_parallel(x, group, cu_seqlens_padded=cu_p, validate=False)
    with count_collectives() as backward_calls:
        (full * weights).sum().backward()
    assert len(forward_calls) == 1 and backward_calls == [], (forward_calls, backward_calls)
    own = context_parallel_indices(cu_p, total, cp_size=cp, cp_rank=rank)
    assert torch.equal(x.grad, weights.index_select(1, own))
    # Replicated loss: the sum over ranks of each rank's slice is the whole gradient, once.
    grads = [torch.empty_like(x.grad) for _ in range(cp)]
    dist.all_gather(grads, x.grad, group=group)
    pieces = [context_parallel_indices(cu_p, total, cp_size=cp, cp_rank=r) for r in range(cp)]
    rebuilt = torch.zeros_like(weights)
    for g, idx in zip(grads, pieces):
        rebuilt.index_add_(1, idx, g)
    assert torch.equal(rebuilt, weights)


@CASES.register
def no_host_sync_in_pack_shard_score_gather_unpack(group):
    _, cp = rank_size(group)
    seqs = make_sequences([3, 5, 1])
    rows = torch.zeros(3, 5, dtype=torch.int64)
    for b, s in enumerate(seqs):
        rows[b, :len(s)] = s
    lengths = torch.tensor([3, 5, 1])
    table = logits_table(VOCAB)
    with forbid_host_sync():
        batch = pack_sequences(rows, lengths, alignment=2 * cp, seq_params=False, validate=False)
        local = shard_for_context_parallel(batch, group, validate=False)
        leaf = table[local.tokens[0]].clone().requires_grad_()
        st = vocab_parallel_stats(leaf, local.labels[0], vocab_size=VOCAB, validate=False)
        lp = gather_from_context_parallel(st.logprobs, group, dim=0,
                                          cu_seqlens_padded=batch.cu_seqlens_padded,
                                          validate=False)
        rows_lp, mask = unpack_sequences(lp, batch.cu_seqlens, max_seqlen=5,
                                         cu_seqlens_padded=batch.cu_seqlens_padded,
                                         validate=False)
        (rows_lp * mask).sum().backward()
    assert leaf.grad is not None
    # The same path with validation reads values on the host, and the mode sees it on every rank.
    try:
        with forbid_host_sync():
            gather_from_context_parallel(st.logprobs.detach(), group, dim=0,
                                         cu_seqlens_padded=batch.cu_seqlens_padded)
    except HostSyncError:
        pass
    else:
        raise AssertionError("validate=True gather did not read values on the host")


@CASES.register
def misaligned_cu_seqlens_raise_on_every_rank(group):
    _, cp = rank_size(group)
    cu_p = torch.tensor([0, 2 * cp + 1, 4 * cp])  # first sequence not a multiple of 2 cp
    for call in (lambda: shard_for_context_parallel(torch.zeros(1, 4 * cp), group,
                                                    cu_seqlens_padded=cu_p),
                 lambda: gather_from_context_parallel(torch.zeros(1, 4), group,
                                                      cu_seqlens_padded=cu_p)):
        try:
            call()
        except ValueError as exc:
            assert "cu_seqlens_padded: sequence 0" in str(exc) and f"{2 * cp}" in str(exc), exc
        else:
            raise AssertionError("misaligned cu_seqlens_padded accepted")


@CASES.register
def mismatched_shards_raise_on_every_rank(group):
    rank, cp = rank_size(group)
    checks = [
        (torch.zeros(1, 4 + 2 * (rank == 0)), 1, "local token count differ"),
        (torch.zeros(1, 4, dtype=torch.float64 if rank == cp - 1 else torch.float32), 1,
         "dtype differs across the ranks of cp_group"),
        (torch.zeros(1, 4), 5 if rank == 0 else 1, "rejected their inputs"),
        # (before: another dim of the same size was gathered along, silently)
        (torch.zeros(1, 4, 4), 1 if rank == 0 else -1, "dim differs across the ranks of cp_group"),
    ]
    for x, dim, message in checks:
        try:
            gather_from_context_parallel(x, group, dim=dim)
        except ValueError as exc:
            if not (rank == 0 and message == "rejected their inputs"):
                assert message in str(exc), (message, str(exc))
        else:
            raise AssertionError(f"rank {rank}: mismatched shards accepted ({message})")


if __name__ == "__main__":
    main(CASES)
