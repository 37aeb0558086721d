"""Multi-process cases of docs/migrating.md (tp = 2 or cp = 2 gloo ranks); run by
tests/unit/test_migrating_dist.py.

Each case builds the same inputs on every rank (the harness seeds each case alike), implements the
other framework's convention in a few lines of float64 torch (written from the facts listed in
docs/migrating.md, not from their code) and checks that the mapping of the doc reproduces it.
Cases named ``megatron_*`` compare with the installed ``megatron.core`` itself.
"""

from __future__ import annotations

import inspect
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main  # noqa: E402

import megatron_vocabstats as mv  # noqa: E402
from megatron_vocabstats import (  # noqa: E402
    gather_from_context_parallel,
    linear_vocab_parallel_stats,
    shard_for_context_parallel,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_parallel_stats,
    vocab_parallel_topk_logprobs,
)

CASES = Cases()
VOCAB = 37        # real vocabulary: odd, so Megatron-style padding to 40 leaves 3 padding columns
PADDED = 40       # tp = 2 shards of 20 (Megatron / NeMo-RL / SkyRL / verl layout)


def _rank_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


def _close(actual, expected, *, rtol=1e-5, atol=1e-6, what):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != " \
        f"{tuple(expected.shape)}"
    err = (actual - expected).abs()
    ok = (err <= atol + rtol * expected.abs()) | (actual == expected)
    assert bool(ok.all()), f"rank {dist.get_rank()}: {what}: max error {err.max().item():.3g}"


def _far(actual, expected, *, at_least, what):
    gap = (actual.double() - expected.double()).abs().max().item()
    assert gap >= at_least, f"rank {dist.get_rank()}: {what}: differ by only {gap:.3g}"


def _full_logits(shape, width=PADDED, scale=3.0):
    """Seeded float64 logits ``[*shape, width]``, equal on every rank (padding columns carry values,
    as an untrained padded output layer does)."""
    return torch.randn(*shape, width, dtype=torch.float64) * scale


def _shard(full, group):
    rank, tp = _rank_size(group)
    width = full.shape[-1] // tp
    return full[..., rank * width:(rank + 1) * width]


def _need(name):
    if not hasattr(mv, name):
        raise Skip(f"megatron_vocabstats.{name} is not there yet")
    return getattr(mv, name)


def _need_vocab_start():
    if "vocab_start" not in inspect.signature(vocab_parallel_stats).parameters:
        raise Skip("vocab_parallel_stats has no vocab_start argument yet")


# ------------------------------------------------------------------------------------ NeMo-RL


def _nemo_logprobs(full, input_ids):
    """NeMo-RL's ``from_parallel_logits_to_logprobs`` convention: the target is ``input_ids``
    rolled left by one, normalised over every column of the shards, ids outside them give 0,
    the last position is dropped."""
    target = input_ids.roll(-1, dims=-1)
    logp = torch.log_softmax(full, -1)
    inside = (target >= 0) & (target < full.shape[-1])
    picked = logp.gather(-1, target.clamp(0, full.shape[-1] - 1)[..., None])[..., 0]
    return torch.where(inside, picked, 0.0)[:, :-1]


@CASES.register
def nemo_rl_logprobs_tp2(group):
    """Row NeMo-RL logprobs: shards [r*W, (r+1)*W) with vocab_start_index = r*W as NeMo-RL
    passes; our op with vocab_size omitted (= W*tp) equals theirs, gradient included."""
    full = _full_logits((2, 7))
    input_ids = torch.randint(0, VOCAB, (2, 7))
    leaf = full.clone().requires_grad_()
    theirs = _nemo_logprobs(leaf, input_ids)
    weights = torch.rand(theirs.shape, dtype=torch.float64)
    (theirs * weights).sum().backward()

    shard = _shard(full, group).float().clone().requires_grad_()
    ours = vocab_parallel_logprobs(shard[:, :-1], input_ids[:, 1:], tp_group=group)
    _close(ours, theirs, what="logprobs")
    (ours * weights.float()).sum().backward()
    _close(shard.grad, _shard(leaf.grad, group), what="logits gradient")
    # With the real vocabulary the padding columns get no mass: a different (correct) number.
    real = vocab_parallel_logprobs(shard[:, :-1], input_ids[:, 1:], tp_group=group,
                                   vocab_size=VOCAB)
    expected = torch.log_softmax(full[..., :VOCAB], -1)[:, :-1].gather(
        -1, input_ids[:, 1:, None])[..., 0]
    _close(real, expected, what="logprobs over the real vocabulary")
    _far(real, theirs, at_least=1e-4, what="real vs padded normalisation")


@CASES.register
def nemo_rl_log_softmax_tp2(group):
    """Row NeMo-RL log-softmax: ``_compute_distributed_log_softmax(logits, tp)`` (this rank's
    shard of the log-softmax over W*tp columns) = logits - our logsumexp (not differentiable)."""
    full = _full_logits((2, 5))
    shard = _shard(full, group).float()
    lse = vocab_parallel_stats(shard, None, tp_group=group, entropy="off").logsumexp
    ours = shard - lse[..., None]
    _close(ours, _shard(torch.log_softmax(full, -1), group), what="log-softmax shard")
    assert not lse.requires_grad


def _cp_order(total, cp):
    """Packed positions of each cp rank under the load-balanced split: chunks r and 2cp-1-r."""
    size = total // (2 * cp)
    return [list(range(r * size, (r + 1) * size))
            + list(range((2 * cp - 1 - r) * size, (2 * cp - r) * size)) for r in range(cp)]


@CASES.register
def nemo_rl_cp_gather_gradient(group):
    """Row NeMo-RL cp gather: same forward (bitwise); NeMo-RL's backward sums the upstream
    gradient over cp ranks, ours hands each rank its own; replicated loss: theirs = cp * ours."""
    rank, cp = _rank_size(group)
    total = 12
    full = torch.randn(2, total)
    own = _cp_order(total, cp)[rank]
    local = shard_for_context_parallel(full, group, dim=1)
    assert torch.equal(local, full[:, own]), "shard order differs from the load-balanced split"

    leaf = local.clone().requires_grad_()
    gathered = gather_from_context_parallel(leaf, group, dim=1)
    assert torch.equal(gathered, full), "gathered tensor differs from the packed original"

    # Upstream gradients that differ per rank (e.g. a loss computed from rank-local tokens).
    gen = torch.Generator().manual_seed(100 + rank)
    upstream = torch.randn(2, total, generator=gen)
    (gathered * upstream).sum().backward()
    summed = upstream.clone()
    dist.all_reduce(summed, group=group)
    theirs = summed[:, own]            # NeMo-RL AllGatherCPTensor.backward: all-reduce, then slice
    assert torch.equal(leaf.grad, upstream[:, own]), "ours: not this rank's own upstream gradient"
    _far(leaf.grad, theirs, at_least=1e-3, what="own vs cp-summed gradient")

    # A loss replicated over cp (the same upstream on every rank): theirs is cp times ours.
    leaf2 = local.clone().requires_grad_()
    same = torch.randn(2, total, generator=torch.Generator().manual_seed(5))
    (gather_from_context_parallel(leaf2, group, dim=1) * same).sum().backward()
    assert torch.equal(leaf2.grad * cp, (same * cp)[:, own])


@CASES.register
def nemo_rl_topk_and_gather_logits_tp2(group):
    """Row NeMo-RL top-k: ``distributed_vocab_topk`` (raw logits) = vocab_parallel_topk_logits;
    ``gather_logits_at_global_indices`` = vocab_parallel_gather_logits (bitwise);
    ``ChunkedDistributedGatherLogprob`` = vocab_parallel_topk_logprobs (padded normalisation)."""
    topk_logits = _need("vocab_parallel_topk_logits")
    gather_logits = _need("vocab_parallel_gather_logits")
    k = 5
    full = _full_logits((2, 6)).float()
    full[0, 0, VOCAB:] = torch.tensor([50.0, 52.0, 51.0])  # padding that outscores the real ids
    shard = _shard(full, group).contiguous()

    # NeMo-RL: torch.topk over every column of the shards (padding included), raw logit values.
    values, ids = torch.topk(full, k, dim=-1)
    ours = topk_logits(shard, k, tp_group=group)
    assert torch.equal(ours.logits, values) and torch.equal(ours.indices, ids), "top-k differs"
    real = topk_logits(shard, k, tp_group=group, vocab_size=VOCAB)
    assert int(real.indices.max()) < VOCAB, "vocab_size: padding ids chosen"
    assert int(ids[0, 0, :3].min()) >= VOCAB, "reference: the padding columns should win row 0"

    # Raw logits at given global ids: exact in both (one owner per id).
    idx = torch.randint(0, VOCAB, (2, 6, k))
    picked = gather_logits(shard, idx, tp_group=group, vocab_size=VOCAB)
    assert torch.equal(picked, full.gather(-1, idx)), "gathered logits differ"

    # Log-probs at given ids: NeMo-RL normalises over the padded shards.
    leaf = shard.clone().requires_grad_()
    lp = vocab_parallel_topk_logprobs(leaf, idx, tp_group=group)
    _close(lp, torch.log_softmax(full.double(), -1).gather(-1, idx), what="top-k log-probs")


# ------------------------------------------------------------------------------------ SkyRL


def _skyrl_packed_owner(cu, cp):
    """SkyRL ``AllGatherPackedCPTensor`` layout: per packed position, (cp rank, local index)."""
    owner, local = [], []
    for s in range(len(cu) - 1):
        start, length = cu[s], cu[s + 1] - cu[s]
        size = length // (2 * cp)
        for off in range(length):
            chunk = off // size
            rank = chunk if chunk < cp else 2 * cp - 1 - chunk
            within = off - chunk * size + (0 if chunk < cp else size)
            owner.append(rank)
            local.append(start // cp + within)
    return owner, local


@CASES.register
def skyrl_packed_cp_gather(group):
    """Row SkyRL cp gather: ``allgather_cp_sharded_packed_tensor`` (own gradient only) equals
    gather_from_context_parallel(..., cu_seqlens_padded=cu, dim=0), forward and backward."""
    rank, cp = _rank_size(group)
    cu_list = [0, 8, 12, 20]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    full = torch.randn(20)
    owner, local_index = _skyrl_packed_owner(cu_list, cp)
    mine = torch.zeros(10)
    for pos, (r, i) in enumerate(zip(owner, local_index)):
        if r == rank:
            mine[i] = full[pos]
    local = shard_for_context_parallel(full, group, cu_seqlens_padded=cu, dim=0)
    assert torch.equal(local, mine), "packed shard differs from SkyRL's layout"

    leaf = local.clone().requires_grad_()
    out = gather_from_context_parallel(leaf, group, cu_seqlens_padded=cu, dim=0)
    assert torch.equal(out, full), "packed gather differs"
    upstream = torch.randn(20, generator=torch.Generator().manual_seed(200 + rank))
    (out * upstream).sum().backward()
    theirs = torch.zeros(10)
    for pos, (r, i) in enumerate(zip(owner, local_index)):
        if r == rank:
            theirs[i] = upstream[pos]    # own positions of the own upstream, no all-reduce
    assert torch.equal(leaf.grad, theirs), "packed gather gradient differs"


# ------------------------------------------------------------------------------------ verl


@CASES.register
def verl_skyrl_entropy_tp2(group):
    """Rows verl / SkyRL entropy: +H over every column of the shards (padded): equals
    vocab_parallel_entropy with vocab_size omitted; with vocab_size=V the padding is excluded."""
    full = _full_logits((3, 5))
    shard = _shard(full, group).float().clone().requires_grad_()
    ours = vocab_parallel_entropy(shard, tp_group=group)
    logp = torch.log_softmax(full, -1)
    theirs = -(logp.exp() * logp).sum(-1)
    _close(ours, theirs, what="entropy (padded)")
    real = vocab_parallel_entropy(shard, tp_group=group, vocab_size=VOCAB)
    logp_real = torch.log_softmax(full[..., :VOCAB], -1)
    _close(real, -(logp_real.exp() * logp_real).sum(-1), what="entropy (real vocabulary)")
    _far(real, theirs, at_least=1e-4, what="real vs padded entropy")


@CASES.register
def verl_linear_ce_full_dx(group):
    """Row verl fused: verl's ``linear_cross_entropy`` returns this rank's partial dX (the caller
    all-reduces it over tp); ours returns the full dX on every rank (sequence_parallel=True: this
    rank's rows of it), so it must not be all-reduced again."""
    rank, tp = _rank_size(group)
    tokens, hidden_size, width = 8, 16, PADDED // tp
    hidden = torch.randn(tokens, hidden_size, dtype=torch.float64)
    weight = torch.randn(PADDED, hidden_size, dtype=torch.float64) * 0.5
    labels = torch.randint(0, VOCAB, (tokens,))
    g_lp, g_ent = torch.rand(tokens, dtype=torch.float64), torch.rand(tokens, dtype=torch.float64)

    # float64 reference of verl's forward (over the padded shards) and of its two gradients.
    h_ref = hidden.clone().requires_grad_()
    logits = (h_ref @ weight.T).detach().requires_grad_()
    logp = torch.log_softmax(logits, -1)
    lp_ref = logp.gather(-1, labels[:, None])[:, 0]
    ent_ref = -(logp.exp() * logp).sum(-1)
    (lp_ref * g_lp + ent_ref * g_ent).sum().backward()
    grad_logits = logits.grad
    lo, hi = rank * width, (rank + 1) * width
    partial = grad_logits[:, lo:hi] @ weight[lo:hi]       # what verl's kernel returns as dX
    full_dx = grad_logits @ weight
    summed = partial.clone()
    dist.all_reduce(summed, group=group)                  # what verl's caller does next
    _close(summed, full_dx, rtol=1e-12, atol=1e-12, what="reference: sum of partial dX")

    h = hidden.float().clone().requires_grad_()
    w = weight[lo:hi].float().clone().requires_grad_()
    st = linear_vocab_parallel_stats(h, w, labels, tp_group=group, entropy="grad", chunk_size=3)
    _close(st.logprobs, lp_ref, what="logprobs")
    _close(st.entropy, ent_ref, what="entropy")
    (st.logprobs * g_lp.float() + st.entropy * g_ent.float()).sum().backward()
    _close(h.grad, full_dx, rtol=1e-5, atol=1e-5, what="dX (full on every rank)")
    _far(h.grad, partial, at_least=1e-2, what="ours vs verl's partial dX")
    _close(w.grad, grad_logits[:, lo:hi].T @ hidden, rtol=1e-5, atol=1e-5, what="dW")

    # Sequence parallel: pass the local rows; dX comes back reduce-scattered (this rank's rows).
    rows = slice(rank * tokens // tp, (rank + 1) * tokens // tp)
    h_sp = hidden[rows].float().clone().requires_grad_()
    st_sp = linear_vocab_parallel_stats(h_sp, w.detach(), labels, tp_group=group,
                                        sequence_parallel=True, entropy="grad")
    (st_sp.logprobs * g_lp.float() + st_sp.entropy * g_ent.float()).sum().backward()
    _close(h_sp.grad, full_dx[rows], rtol=1e-5, atol=1e-5, what="sequence-parallel dX")


# ------------------------------------------------------------------------------------ torchtitan


def _titan_ranges(vocab, tp):
    chunk = -(-vocab // tp)
    return [(min(vocab, r * chunk), min(vocab, r * chunk + chunk)) for r in range(tp)]


@CASES.register
def torchtitan_uneven_shards_tp2(group):
    """Row torchtitan: shards of ceil(V/tp) columns, the last shorter (V=37: 19 + 18), loss summed
    with -100 ignored; ours needs vocab_start=rank*ceil(V/tp) and vocab_size=V."""
    _need_vocab_start()
    rank, tp = _rank_size(group)
    lo, hi = _titan_ranges(VOCAB, tp)[rank]
    full = _full_logits((9,), width=VOCAB)
    labels = torch.randint(0, VOCAB, (9,))
    labels[[2, 6]] = -100
    local = full[:, lo:hi].float().clone().requires_grad_()

    leaf = full.clone().requires_grad_()
    nll = torch.nn.functional.cross_entropy(leaf, labels, reduction="none", ignore_index=-100)
    nll.sum().backward()                               # torchtitan: reduction "sum"
    ours = vocab_parallel_cross_entropy(local, labels, tp_group=group, vocab_size=VOCAB,
                                        vocab_start=lo)
    _close(ours, nll, what="per-token loss (reduction 'none')")
    _close(ours.sum(), nll.sum(), what="summed loss (reduction 'sum')")
    ours.sum().backward()
    _close(local.grad, leaf.grad[:, lo:hi], what="logits gradient")

    # compute_logprobs(..., return_entropy=True): -nll and a no-grad entropy at every position.
    st = vocab_parallel_stats(local.detach(), labels, tp_group=group, vocab_size=VOCAB,
                              vocab_start=lo, entropy="metric")
    _close(st.logprobs, -nll.detach(), what="logprobs")
    logp = torch.log_softmax(full, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    keep = labels != -100
    _close(st.entropy[keep], entropy[keep], what="entropy")
    assert not st.entropy.requires_grad
    # Ours reports entropy 0 where the target is ignored; torchtitan reports it everywhere:
    # the target-free entropy op gives every position.
    assert bool((st.entropy[~keep] == 0).all())
    every = vocab_parallel_entropy(local.detach(), tp_group=group, vocab_size=VOCAB,
                                   vocab_start=lo, differentiable=False)
    _close(every, entropy, what="entropy at every position")

    # Without vocab_start the ranks' widths (19, 18) are refused, not silently misread.
    try:
        vocab_parallel_logprobs(local.detach(), labels, tp_group=group, vocab_size=VOCAB)
    except ValueError:
        pass
    else:
        raise AssertionError("uneven shards without vocab_start were accepted")


# ------------------------------------------------------------------------------------ Megatron


def _megatron(group):
    try:
        from megatron.core import parallel_state, tensor_parallel
    except ImportError as exc:
        raise Skip(f"megatron-core not importable: {exc}") from exc
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return tensor_parallel.vocab_parallel_cross_entropy


@CASES.register
def megatron_cross_entropy_tp2(group):
    """Row Megatron: values and gradients equal with vocab_size omitted (Megatron's padded
    vocabulary); Megatron overwrites fp32 logits in place, ours never; a target of -100 is a
    plausible loss (logsumexp - max) with a gradient in Megatron, 0 in ours; equal after the
    loss mask."""
    megatron_ce = _megatron(group)
    full = _full_logits((7, 2)).float()              # Megatron layout [s, b, V_padded]
    target = torch.randint(0, VOCAB, (7, 2))
    target[3, 1] = -100
    mask = (target != -100).float()
    shard = _shard(full, group).contiguous()

    theirs_leaf = shard.clone().requires_grad_()
    theirs = megatron_ce(theirs_leaf, target)         # Megatron's default tensor-parallel group
    ours_leaf = shard.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_leaf, target)  # tp_group=None: Megatron's group too
    keep = mask.bool()
    _close(ours[keep], theirs[keep], what="per-token loss")
    # In place: Megatron's fp32 input now holds its softmax; ours is bitwise untouched.
    assert not torch.equal(theirs_leaf.detach(), shard), "Megatron left fp32 logits untouched?"
    assert torch.equal(ours_leaf.detach(), shard), "ours modified the logits"

    # Target -100: Megatron gives logsumexp - max (a finite, plausible number), ours 0.
    z = full[3, 1].double()
    _close(theirs[3, 1], torch.logsumexp(z, -1) - z.max(), what="Megatron loss at -100")
    assert float(ours[3, 1]) == 0.0
    (theirs * mask).sum().backward()
    (ours * mask).sum().backward()
    _close(ours_leaf.grad, theirs_leaf.grad, rtol=1e-5, atol=1e-6, what="masked gradient")
    # Unmasked, Megatron's -100 row gets the softmax as gradient; ours exactly zero.
    leaf2 = shard.clone().requires_grad_()
    megatron_ce(leaf2, target).sum().backward()
    assert float(leaf2.grad[3, 1].abs().max()) > 0.0
    leaf3 = shard.clone().requires_grad_()
    vocab_parallel_cross_entropy(leaf3, target).sum().backward()
    assert float(leaf3.grad[3, 1].abs().max()) == 0.0

    # Real vocabulary: vocab_size=V removes the padding columns Megatron normalises over.
    real = vocab_parallel_cross_entropy(shard, target, vocab_size=VOCAB)
    logp = torch.log_softmax(full[..., :VOCAB].double(), -1)
    expected = -logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    _close(real[keep], expected[keep], what="loss over the real vocabulary")
    _far(real[keep], theirs[keep], at_least=1e-4, what="real vs padded loss")


@CASES.register
def megatron_verl_logprobs_tp2(group):
    """Row verl logprobs: verl's ``vocab_parallel_log_probs_from_logits`` is -Megatron's loss;
    vocab_parallel_logprobs(..., tp_group=tp) equals it without touching the logits."""
    megatron_ce = _megatron(group)
    full = _full_logits((3, 5)).float()
    labels = torch.randint(0, VOCAB, (3, 5))
    shard = _shard(full, group).contiguous()
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    theirs = -megatron_ce(shard.clone(), labels)
    ours = vocab_parallel_logprobs(shard, labels, tp_group=tp)
    _close(ours, theirs, what="logprobs")


@CASES.register
def megatron_label_smoothing_tp2(group):
    """Row Megatron, label smoothing at tp = 2: Megatron's loss on rank r is
    (1-s) nll - s mean_{j in shard r} log p_j with s = eps K/(K-1), K the shard width, so it
    differs across ranks and its gradient sums to s (1 - tp) per token; ours smooths over the V
    real columns, equal on all ranks, gradient summing to 0."""
    megatron_ce = _megatron(group)
    rank, tp = _rank_size(group)
    eps = 0.1
    full = _full_logits((5, 2)).float()
    target = torch.randint(0, VOCAB, (5, 2))
    shard = _shard(full, group).contiguous()
    width = shard.shape[-1]

    leaf = shard.clone().requires_grad_()
    theirs = megatron_ce(leaf, target, eps)
    logp = torch.log_softmax(full.double(), -1)
    nll = -logp.gather(-1, target[..., None])[..., 0]
    s = eps * width / (width - 1)
    expected = (1 - s) * nll - s * _shard(logp, group).mean(-1)
    _close(theirs, expected, what="Megatron smoothed loss on this rank")
    others = [torch.empty_like(theirs) for _ in range(tp)]
    dist.all_gather(others, theirs.detach(), group=group)
    _far(others[0], others[1], at_least=1e-3, what="Megatron's smoothed loss across ranks")
    theirs.sum().backward()
    gsum = leaf.grad.double().sum(-1)
    dist.all_reduce(gsum, group=group)
    _close(gsum, torch.full_like(gsum, s * (1 - tp)), rtol=1e-4, atol=1e-5,
           what="Megatron gradient summed over the vocabulary")

    ours_leaf = shard.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_leaf, target, eps, vocab_size=VOCAB)
    logp_real = torch.log_softmax(full[..., :VOCAB].double(), -1)
    nll_real = -logp_real.gather(-1, target[..., None])[..., 0]
    _close(ours, (1 - eps) * nll_real - eps * logp_real.mean(-1), what="our smoothed loss")
    mine = [torch.empty_like(ours) for _ in range(tp)]
    dist.all_gather(mine, ours.detach(), group=group)
    assert torch.equal(mine[0], mine[1]), "our smoothed loss differs across ranks"
    ours.sum().backward()
    osum = ours_leaf.grad.double().sum(-1)
    dist.all_reduce(osum, group=group)
    _close(osum, torch.zeros_like(osum), rtol=0, atol=1e-5, what="our gradient sum")


@CASES.register
def megatron_label_smoothing_tp1(group):
    """Row Megatron, label smoothing at tp = 1: Megatron(eps) equals ours with
    label_smoothing = eps K/(K-1), K the padded vocabulary, and vocab_size omitted."""
    megatron_ce = _megatron(group)
    from megatron.core import parallel_state

    eps = 0.1
    full = _full_logits((4, 3)).float()
    target = torch.randint(0, VOCAB, (4, 3))
    ours_eps = eps * PADDED / (PADDED - 1)
    if "tp_group" in inspect.signature(megatron_ce).parameters:
        rank, world = _rank_size(group)
        singles = [dist.new_group([r]) for r in range(world)]
        theirs = megatron_ce(full.clone(), target, eps, singles[rank])
        ours = vocab_parallel_cross_entropy(full, target, ours_eps, singles[rank])
    else:  # releases before tp_group: Megatron's global group, re-initialised at tp = 1
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        try:
            theirs = megatron_ce(full.clone(), target, eps)
            ours = vocab_parallel_cross_entropy(full, target, ours_eps)  # its tp = 1 group
        finally:
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=dist.get_world_size())
    _close(ours, theirs, what="smoothed loss at tp = 1")


if __name__ == "__main__":
    main(CASES)
