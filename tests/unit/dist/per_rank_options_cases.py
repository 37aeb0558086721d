"""Every op at tp 2 with each per-rank option differing: every rank raises promptly.

One case per op (and per loss that passes options to one). In each, every option that changes
the results, or the collective schedule or its sizes (forward and backward), is given a
different value on rank 1 than on rank 0, one at a time: every rank must raise a ``ValueError``
naming the option (the one agreement exchange of ``validate=True``), within ``PROMPT_S``
seconds, before any collective of the op could pair with another rank's. The gloo timeout of
this script is short (``TIMEOUT_S``), so that an option that slips through (a hang: one rank in
a collective the other never joins) fails this test in seconds instead of holding CI. Options
that change neither (``chunk_size`` outside the forward-gradient mode) must give equal results.

Not here: ``validate`` itself differing (the exchange is what ``validate`` turns on: the rank
without it is not in the exchange; gloo aborts on the mismatch), documented as "must be equal
on all ranks". Run by tests/unit/test_per_rank_options_dist.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main  # noqa: E402

import megatron_vocabstats as mv  # noqa: E402

CASES = Cases()
TIMEOUT_S = 45  # gloo: a hang fails the launch in this long, not in pytest's 600 s
PROMPT_S = 15  # every rank raises within this (on a loaded 2-core machine)
T, W, H = 4, 8, 4


def _rank(group):
    rank, tp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    if tp != 2:
        raise Skip("written for tp = 2")
    return rank


def _data(rank):
    g = torch.Generator().manual_seed(7)
    full = torch.randn(T, 2 * W, generator=g)
    hidden = torch.randn(T, H, generator=g)
    weight_full = torch.randn(2 * W, H, generator=g)
    target = torch.randint(0, 2 * W - 2, (T,), generator=g)  # (vocab_size 15 holds them)
    target[0] = full[0, :2 * W - 2].argmax()
    return dict(logits=full[:, rank * W:(rank + 1) * W].contiguous(), hidden=hidden,
                weight=weight_full[rank * W:(rank + 1) * W].contiguous(), target=target,
                indices=torch.randint(0, 2 * W, (T, 2), generator=g))


def _run(out):
    """Backward through the op's outputs when they have a gradient (the dX reduction of a fused
    op is a collective)."""
    tensors = [t for t in (out if isinstance(out, tuple) else (out,))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        sum(torch.where(torch.isfinite(t), t, 0.0).sum() for t in tensors).backward()


def _problem(name, call, fragment) -> str | None:
    """Why ``call()`` did not raise a ``ValueError`` holding one of the ``|``-separated
    ``fragment`` s within ``PROMPT_S`` (None: it did)."""
    start = time.monotonic()
    try:
        _run(call())
    except ValueError as exc:
        elapsed = time.monotonic() - start
        if not any(f in str(exc) for f in fragment.split("|")):
            return f"{name}: unexpected message: {exc}"
        if elapsed >= PROMPT_S:
            return f"{name}: raised after {elapsed:.1f} s"
        return None
    return f"{name}: no error"


def _check(group, options):
    """``options``: ``(name, fragment, call(rank))``; each must raise on every rank. The ranks
    meet after every option (a barrier), whatever happened, so that one rank's failure is
    reported without desynchronising the next option's collectives."""
    rank = _rank(group)
    failures = []
    for name, fragment, call in options:
        if os.environ.get("RANK_OPTIONS_TRACE"):
            print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        problem = _problem(name, lambda: call(rank), fragment)
        if problem:
            failures.append(problem)
        torch.distributed.barrier(group)
    assert not failures, f"rank {rank}: " + "; ".join(failures)


def _grad_leaves(d, hidden=True, weight=True):
    return (d["hidden"].clone().requires_grad_(hidden), d["weight"].clone().requires_grad_(weight))


def _differing(rank, a, b):
    return a if rank == 0 else b


# ---------------------------------------------------------------------------------------------
# The ops on logits


def _core(op, **fixed):
    def call(rank, **kw):
        d = _data(rank)
        leaf = d["logits"].clone().requires_grad_()
        return op(leaf, d["target"], **{**fixed, **kw})
    return call


CORE_OPTIONS = [
    ("vocab_size", "vocab_size differs", lambda r: dict(vocab_size=_differing(r, 16, 15))),
    ("vocab_start", "vocab_start differs",
     lambda r: dict(vocab_start=_differing(r, None, 8), vocab_size=16)),
    ("temperature", "temperature differs", lambda r: dict(temperature=_differing(r, 1.0, 2.0))),
    ("ignore_index", "ignore_index differs", lambda r: dict(ignore_index=_differing(r, -100, -1))),
    ("label_smoothing", "label_smoothing differs",
     lambda r: dict(label_smoothing=_differing(r, 0.0, 0.1))),
    ("batch_invariant", "batch_invariant differs",
     lambda r: dict(batch_invariant=_differing(r, False, True))),
]


@CASES.register
def vocab_parallel_stats_and_wrappers(group):
    def stats(rank, **kw):
        return _core(lambda x, t, **o: mv.vocab_parallel_stats(x, t, tp_group=group, **o))(
            rank, **kw)

    options = [(name, frag, lambda r, f=make: stats(r, **f(r))) for name, frag, make in
               CORE_OPTIONS]
    options += [
        ("entropy", "entropy mode differs",
         lambda r: stats(r, entropy=_differing(r, "grad", "off"))),
        ("target", "target (token ids) differs",
         lambda r: mv.vocab_parallel_stats(_data(r)["logits"], (_data(r)["target"] + r) % 14,
                                           tp_group=group)),
        ("target given", "target (token ids) differs",
         lambda r: mv.vocab_parallel_stats(_data(r)["logits"], _differing(r, _data(r)["target"],
                                                                          None), tp_group=group)),
        ("token count", "token count differs",
         lambda r: mv.vocab_parallel_stats(_data(r)["logits"][:T - r], None, tp_group=group)),
        ("logits dtype", "logits dtype differs",
         lambda r: mv.vocab_parallel_stats(_data(r)["logits"].to(_differing(
             r, torch.float32, torch.bfloat16)), None, tp_group=group)),
        ("entropy differentiable", "entropy mode differs",
         lambda r: mv.vocab_parallel_entropy(_data(r)["logits"], tp_group=group,
                                             differentiable=_differing(r, True, False))),
        ("cross_entropy label_smoothing", "label_smoothing differs",
         lambda r: mv.vocab_parallel_cross_entropy(_data(r)["logits"], _data(r)["target"],
                                                   _differing(r, 0.0, 0.2), group)),
        ("logprobs temperature", "temperature differs",
         lambda r: mv.vocab_parallel_logprobs(_data(r)["logits"], _data(r)["target"],
                                              tp_group=group,
                                              temperature=_differing(r, 1.0, 0.5))),
    ]
    _check(group, options)


@CASES.register
def vocab_parallel_topk_ops(group):
    def topk(r, **kw):
        return mv.vocab_parallel_topk(_data(r)["logits"], kw.pop("k", 2), tp_group=group, **kw)

    def picked(r, **kw):
        d = _data(r)
        return mv.vocab_parallel_topk_logprobs(d["logits"].clone().requires_grad_(),
                                               kw.pop("indices", d["indices"]), tp_group=group,
                                               **kw)

    def gather(r, **kw):
        d = _data(r)
        return mv.vocab_parallel_gather_logits(d["logits"].clone().requires_grad_(),
                                               kw.pop("indices", d["indices"]), tp_group=group,
                                               **kw)

    mask = torch.tensor([1, 1, 0, 1])
    _check(group, [
        ("topk k", "k differs", lambda r: topk(r, k=_differing(r, 2, 3))),
        ("topk temperature", "temperature differs",
         lambda r: topk(r, temperature=_differing(r, 1.0, 3.0))),
        ("topk vocab_size", "vocab_size differs",
         lambda r: topk(r, vocab_size=_differing(r, 16, 14))),
        ("topk_logits k", "k differs",
         lambda r: mv.vocab_parallel_topk_logits(_data(r)["logits"], _differing(r, 1, 4),
                                                 tp_group=group)),
        ("topk_logprobs k", "k differs",
         lambda r: picked(r, indices=_data(r)["indices"][:, :_differing(r, 2, 1)])),
        ("topk_logprobs indices", "indices differs",
         lambda r: picked(r, indices=(_data(r)["indices"] + r) % 16)),
        ("topk_logprobs mask", "mask differs",
         lambda r: picked(r, mask=_differing(r, None, mask))),
        ("topk_logprobs temperature", "temperature differs",
         lambda r: picked(r, temperature=_differing(r, 1.0, 0.7))),
        ("gather indices", "indices differs",
         lambda r: gather(r, indices=(_data(r)["indices"] + r) % 16)),
        ("gather mask", "mask differs", lambda r: gather(r, mask=_differing(r, mask, 1 - mask))),
    ])


@CASES.register
def vocab_parallel_sampling_logprobs(group):
    def sampled(r, **kw):
        d = _data(r)
        return mv.vocab_parallel_sampling_logprobs(d["logits"].clone().requires_grad_(),
                                                   kw.pop("target", d["target"]),
                                                   tp_group=group, **kw).logprobs

    _check(group, [
        ("top_k", "top_k differs", lambda r: sampled(r, top_k=_differing(r, None, 3))),
        ("top_p", "top_p differs", lambda r: sampled(r, top_p=_differing(r, 0.9, 0.8))),
        ("min_p", "min_p differs", lambda r: sampled(r, min_p=_differing(r, None, 0.1))),
        ("temperature", "temperature differs",
         lambda r: sampled(r, temperature=_differing(r, 0.3, 1.0))),
        ("ignore_index", "ignore_index differs",
         lambda r: sampled(r, ignore_index=_differing(r, -100, -7))),
        ("target", "target (token ids) differs",
         lambda r: sampled(r, target=(_data(r)["target"] + r) % 16)),
    ])


# ---------------------------------------------------------------------------------------------
# The fused LM head


def _fused_grad_options(op):
    """The options of a differentiable fused op that change its backward's collectives."""
    return [
        ("hidden requires_grad", "gradients asked",
         lambda r: op(r, leaves=_grad_leaves(_data(r), hidden=r == 0))),
        ("weight requires_grad", "gradients asked",
         lambda r: op(r, leaves=_grad_leaves(_data(r), weight=r == 0))),
        ("grad mode on one rank", "gradients asked", lambda r: op(r, no_grad=r == 1)),
        # (rank 1's target then misses its gathered sequence: its own error, named there)
        ("sequence_parallel", "sequence_parallel|shape|rejected their inputs",
         lambda r: op(r, sequence_parallel=r == 1)),
        ("accumulate_into_main_grad", "accumulate_into_main_grad differs",
         lambda r: op(r, accumulate_into_main_grad=r == 1)),
        # (section 4: a hidden size that differs sized the dX all-reduce apart: gloo aborted)
        ("hidden size H", "hidden size H",
         lambda r: op(r, leaves=(torch.randn(T, H + r, requires_grad=True),
                                 torch.randn(W, H + r, requires_grad=True)))),
    ]


def _fused(fn):
    def call(r, leaves=None, no_grad=False, **kw):
        d = _data(r)
        h, w = leaves or _grad_leaves(d)
        if kw.get("accumulate_into_main_grad"):
            w.main_grad = torch.zeros(w.shape)
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            return fn(h, w, d, **kw)
    return call


@CASES.register
def linear_vocab_parallel_stats_and_cross_entropy(group):
    stats = _fused(lambda h, w, d, **kw: mv.linear_vocab_parallel_stats(
        h, w, d["target"], tp_group=group, **kw).logprobs)
    weights = torch.tensor([1.0, 1.0, 0.0, 1.0])
    ce = _fused(lambda h, w, d, **kw: mv.linear_vocab_parallel_cross_entropy(
        h, w, d["target"], tp_group=group, **kw))
    options = [(name, frag, lambda r, f=make: stats(r, **f(r))) for name, frag, make in
               CORE_OPTIONS if name != "vocab_start"]
    options += _fused_grad_options(stats)
    options += [
        ("entropy", "entropy mode differs",
         lambda r: stats(r, entropy=_differing(r, "grad", "metric"))),
        ("grad_weights given", "grad_weights differs",
         lambda r: stats(r, entropy="off", grad_weights=_differing(r, weights, None))),
        ("grad_weights values", "grad_weights values differs",
         lambda r: stats(r, entropy="off", grad_weights=weights * (1 + r))),
        ("forward-gradient chunk_size", "chunk_size in the forward-gradient mode",
         lambda r: ce(r, loss_weights=weights, chunk_size=_differing(r, 2, 3))),
        ("forward-gradient hidden requires_grad", "gradients asked",
         lambda r: ce(r, loss_weights=weights, leaves=_grad_leaves(_data(r), hidden=r == 1))),
        ("cross_entropy loss_weights", "grad_weights differs",
         lambda r: ce(r, loss_weights=_differing(r, None, weights))),
    ]
    _check(group, options)


@CASES.register
def linear_vocab_parallel_topk_ops(group):
    picked = _fused(lambda h, w, d, **kw: mv.linear_vocab_parallel_topk_logprobs(
        h, w, kw.pop("indices", d["indices"]), tp_group=group, **kw))
    _check(group, _fused_grad_options(picked) + [
        ("indices", "indices differs", lambda r: picked(r, indices=(_data(r)["indices"] + r) % 16)),
        ("mask", "mask differs",
         lambda r: picked(r, mask=_differing(r, None, torch.tensor([0, 1, 1, 1])))),
        ("temperature", "temperature differs",
         lambda r: picked(r, temperature=_differing(r, 1.0, 2.0))),
        ("teacher k", "k differs",
         lambda r: mv.linear_vocab_parallel_topk(_data(r)["hidden"], _data(r)["weight"],
                                                 _differing(r, 2, 3), tp_group=group)),
        ("teacher sequence_parallel", "token count differs",
         lambda r: mv.linear_vocab_parallel_topk(_data(r)["hidden"], _data(r)["weight"], 2,
                                                 tp_group=group, sequence_parallel=r == 0)),
        ("teacher hidden size H under sequence_parallel", "hidden size H",
         lambda r: mv.linear_vocab_parallel_topk(torch.randn(T, H + r), torch.randn(W, H + r), 2,
                                                 tp_group=group, sequence_parallel=True)),
    ])


@CASES.register
def linear_vocab_parallel_sampling_logprobs(group):
    sampled = _fused(lambda h, w, d, **kw: mv.linear_vocab_parallel_sampling_logprobs(
        h, w, d["target"], tp_group=group, **kw).logprobs)
    _check(group, _fused_grad_options(sampled) + [
        ("top_k", "top_k differs", lambda r: sampled(r, top_k=_differing(r, 2, 5))),
        ("top_p", "top_p differs", lambda r: sampled(r, top_p=_differing(r, None, 0.5))),
        ("temperature", "temperature differs",
         lambda r: sampled(r, temperature=_differing(r, 1.0, 0.25))),
    ])


# ---------------------------------------------------------------------------------------------
# Losses that pass options to an op (with validate: their default is off)


@CASES.register
def losses(group):
    mask = torch.ones(T)

    def sft(r, **kw):
        d = _data(r)
        return mv.sft_loss(d["logits"].clone().requires_grad_(), d["target"], kw.pop("mask", mask),
                           tp_group=group, validate=True, **kw).loss_sum

    def distill(r, **kw):
        d = _data(r)
        teacher = mv.TopK(torch.log_softmax(torch.ones(T, 2), -1) - 1.0, d["indices"])
        return mv.distillation_loss(d["logits"].clone().requires_grad_(), teacher, mask,
                                    tp_group=group, validate=True, **kw).loss_sum

    _check(group, [
        ("sft temperature", "temperature differs",
         lambda r: sft(r, temperature=_differing(r, 1.0, 2.0))),
        ("sft label_smoothing", "label_smoothing differs",
         lambda r: sft(r, label_smoothing=_differing(r, 0.1, 0.0))),
        ("sft loss_mask", "target (token ids) differs",
         lambda r: sft(r, mask=torch.tensor([1.0, 1, 1, r]))),
        ("distill divergence", "divergence",
         lambda r: distill(r, divergence=_differing(r, "forward_kl", "reverse_kl"))),
        ("distill beta", "beta", lambda r: distill(r, divergence="jsd",
                                                   beta=_differing(r, 0.5, 0.3))),
        ("distill temperature", "temperature differs",
         lambda r: distill(r, temperature=_differing(r, 1.0, 2.0))),
    ])


@CASES.register
def missing_or_wrong_group(group):
    """The full logits (or weight) replicated on every rank where that is known (``vocab_size``
    no wider than the shard; without it equal shards are computed as shards, with a warning:
    identical_shards_cases.py) raise on every rank naming tp_group; so does the drop-in's
    tp_group=None before Megatron's parallel state is initialised, and any op's tp_group=None
    once it is initialised with tp = 2 (was: per-shard statistics, up to 1.85 nats off,
    without an error)."""
    rank = _rank(group)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(T, 2 * W, generator=g)
    target = torch.randint(0, 2 * W, (T,), generator=g)
    _check(group, [
        ("replicated logits, padded vocabulary", "tp_group holds the same",
         lambda r: mv.vocab_parallel_stats(full, target.clamp(max=2 * W - 2), tp_group=group,
                                           vocab_size=2 * W - 1)),
        ("replicated logits, vocab_size", "tp_group holds the same",
         lambda r: mv.vocab_parallel_logprobs(full, target, tp_group=group, vocab_size=2 * W)),
        ("replicated logits, top-k", "tp_group holds the same",
         lambda r: mv.vocab_parallel_topk(full[:, :W], 2, tp_group=group, vocab_size=W)),
        ("the full weight on every rank", "tp_group holds the same",
         lambda r: mv.linear_vocab_parallel_stats(_data(r)["hidden"], torch.randn(
             2 * W, H, generator=torch.Generator().manual_seed(5)), target, tp_group=group,
             vocab_size=2 * W)),
    ])
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
    shard = full[:, rank * W:(rank + 1) * W]
    expect = "tp_group=None means Megatron's tensor-parallel group"
    problem = _problem("drop-in before Megatron", lambda: mv.vocab_parallel_cross_entropy(
        shard, target), expect)
    assert problem is None, problem
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        for name, call in (
                ("stats", lambda: mv.vocab_parallel_stats(shard, target)),
                ("sampling", lambda: mv.vocab_parallel_sampling_logprobs(shard, target)),
                ("fused", lambda: mv.linear_vocab_parallel_stats(_data(rank)["hidden"],
                                                                 _data(rank)["weight"], target))):
            problem = _problem(name, call, "Megatron's tensor-parallel group has 2 ranks")
            assert problem is None, problem
        # vocab_size says these logits hold the whole vocabulary; the drop-in takes the group
        mv.vocab_parallel_stats(full, target, vocab_size=2 * W)
        ref = mv.vocab_parallel_cross_entropy(shard, target, tp_group=group)
        assert torch.equal(mv.vocab_parallel_cross_entropy(shard, target), ref)
    finally:
        parallel_state.destroy_model_parallel()


@CASES.register
def options_that_change_nothing_may_differ(group):
    """chunk_size outside the forward-gradient mode changes neither the results nor the
    collectives: ranks may differ, and every op still runs in step afterwards."""
    rank = _rank(group)
    d = _data(rank)
    ref = mv.vocab_parallel_stats(d["logits"], d["target"], tp_group=group)
    got = mv.vocab_parallel_stats(d["logits"], d["target"], tp_group=group, chunk_size=1 + rank)
    assert torch.equal(ref.logprobs, got.logprobs) and torch.equal(ref.entropy, got.entropy)
    h, w = _grad_leaves(d)
    out = mv.linear_vocab_parallel_stats(h, w, d["target"], tp_group=group, chunk_size=1 + rank)
    _run(out.logprobs)
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    # A top_k of V or more keeps everything, a huge one too (was refused at tp > 1: the
    # agreement compared it as an int64)
    plain = mv.vocab_parallel_sampling_logprobs(d["logits"], d["target"], tp_group=group)
    for k in (2 * W, 2**70, 10**400):
        huge = mv.vocab_parallel_sampling_logprobs(d["logits"], d["target"], tp_group=group,
                                                   top_k=k)
        assert torch.equal(huge.logprobs, plain.logprobs), k


if __name__ == "__main__":
    main(CASES, timeout_s=TIMEOUT_S)
