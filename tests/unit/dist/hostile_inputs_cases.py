"""Core ops under tensor parallelism (gloo): every rank raises promptly on a bad input
of any one rank, agreement errors print values, and extreme logits stay exact across shards.
Run by tests/unit/test_hostile_inputs_dist.py.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main, needs_tp2  # noqa: E402
from _reference import reference_stats  # noqa: E402
from megatron_vocabstats import (  # noqa: E402
    vocab_parallel_stats,
    vocab_parallel_topk,
    vocab_parallel_topk_logprobs,
)
from megatron_vocabstats.ops._checks import checked_config  # noqa: E402
from megatron_vocabstats.ops.agreement import target_checksum as _target_checksum  # noqa: E402
from megatron_vocabstats.testing import forbid_host_sync  # noqa: E402

CASES = Cases()
OPTIONS = dict(entropy="off")  # the other options: the defaults checked_config declares


def _own(group) -> int:
    """An offset that makes each rank's random logits its own shard (the same logits on every
    rank are refused as a wrong group)."""
    return torch.distributed.get_rank(group)


def expect_error(fn, *fragments, kind=ValueError):
    try:
        fn()
    except kind as exc:
        assert any(f in str(exc) for f in fragments), str(exc)
        return str(exc)
    raise AssertionError(f"no error (expected one of {fragments})")


@CASES.register
def one_rank_local_error_raises_on_every_rank(group):
    """A list for logits, a width-0 shard, a bad option type, or any other exception on the last
    rank: that rank raises its own error, the others name it (no rank left in a collective)."""
    rank, tp = needs_tp2(group)
    last = rank == tp - 1
    logits, target = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    cases = [
        (lambda: vocab_parallel_stats(logits.tolist() if last else logits, None, tp_group=group),
         "logits must be a tensor"),
        (lambda: vocab_parallel_stats(torch.randn(4, 0) if last else logits, target,
                                      tp_group=group), "is empty"),
        (lambda: vocab_parallel_stats(logits, target, tp_group=group,
                                      temperature="2" if last else 2.0), "temperature"),
        (lambda: vocab_parallel_stats(logits, target, tp_group=group,
                                      ignore_index=1.5 if last else -100), "ignore_index"),
        (lambda: vocab_parallel_topk(torch.randn(4, 0) if last else logits, 2, tp_group=group),
         "is empty"),
        (lambda: vocab_parallel_topk_logprobs(logits.tolist() if last else logits,
                                              torch.zeros(4, 1, dtype=torch.long),
                                              tp_group=group), "logits must be a tensor"),
        (lambda: checked_config(logits, None, group,
                                agree=(("x", (lambda: 1 // 0) if last else (lambda: 1)),),
                                **OPTIONS), "division"),
    ]
    for fn, own in cases:
        expect_error(fn, own if last else "rejected their inputs", kind=Exception)


@CASES.register
def agreement_errors_print_values_per_rank(group):
    rank, tp = needs_tp2(group)
    logits, target = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    expect_error(lambda: vocab_parallel_stats(logits, target, tp_group=group,
                                              temperature=1.0 + (rank == 1)),
                 "temperature differs across the ranks of tp_group: [1.0, 2.0")
    expect_error(lambda: vocab_parallel_stats(logits, target, tp_group=group,
                                              entropy="off" if rank == 1 else "grad"),
                 "entropy mode differs across the ranks of tp_group: ['grad', 'off'")
    expect_error(lambda: vocab_parallel_stats(logits.to(torch.float32 if rank else torch.bfloat16),
                                              target, tp_group=group),
                 "logits dtype differs across the ranks of tp_group: [torch.bfloat16, "
                 "torch.float32")
    expect_error(lambda: vocab_parallel_stats(logits, target, tp_group=group,
                                              batch_invariant=True if rank else False),
                 "batch_invariant differs across the ranks of tp_group: [False, True")
    mine = torch.full((4,), 3 + rank % 2)
    message = expect_error(lambda: vocab_parallel_stats(logits, mine, tp_group=group),
                           "target (token ids) differs across the ranks of tp_group")
    odd = [r for r in range(tp) if r % 2]
    assert f"ranks {odd} differ from rank 0" in message, message
    assert str(_target_checksum(mine)) not in message, message


def _check_exact(st, full, target, **kw):
    z = full.double()
    lp, ent, lse = reference_stats(torch.where(z <= -1e30, float("-inf"), z), target, **kw)
    for name, actual, expected in (("logprobs", st.logprobs, lp), ("entropy", st.entropy, ent),
                                   ("logsumexp", st.logsumexp, lse)):
        assert torch.isfinite(actual).all(), f"{name}: {actual}"
        err = (actual.double() - expected).abs()
        assert bool((err <= 1e-5 + 1e-5 * expected.abs()).all()), f"{name}: {actual} vs {expected}"


@CASES.register
def extreme_shards_are_exact(group):
    """One shard all -9e29, another at 3e38 (was: NaN entropy); label smoothing at 3e38 (was:
    +inf logprob); batch-invariant blocks at 3e38 and -9e29."""
    rank, tp = needs_tp2(group)
    width = 128
    full = torch.full((4, width * tp), -9e29)
    full[0, width:2 * width] = 3e38           # shard 1 all at 3e38, shard 0 all at -9e29
    full[1, :] = 3e38                          # every shard at 3e38
    full[2, ::2] = 3e38                        # mixed within each shard
    full[3, 5] = 3e38                          # one column
    target = torch.tensor([3, width + 1, 2, 5])
    shard = full[:, rank * width:(rank + 1) * width]
    for mode in (False, True, "tp"):
        for smoothing in (0.0, 0.1):
            st = vocab_parallel_stats(shard, target, tp_group=group, label_smoothing=smoothing,
                                      batch_invariant=mode)
            _check_exact(st, full, target, label_smoothing=smoothing)


@CASES.register
def out_of_range_target_without_validate_is_nan_on_every_rank(group):
    rank, tp = needs_tp2(group)
    torch.manual_seed(3)
    full = torch.randn(3, 16 * tp)
    vocab = 16 * tp - 3
    target = torch.tensor([vocab + 1, 16 * tp + 4, 2])  # padding column, outside, fine
    leaf = full[:, rank * 16:(rank + 1) * 16].clone().requires_grad_()
    with forbid_host_sync():
        lp = vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=vocab, entropy="off",
                                  validate=False).logprobs
        lp.nan_to_num(0.0).sum().backward()
    assert torch.isnan(lp[:2]).all() and torch.isfinite(lp[2]), lp
    assert torch.equal(leaf.grad[:2], torch.zeros(2, 16)), leaf.grad
    expect_error(lambda: vocab_parallel_stats(leaf, target, tp_group=group, vocab_size=vocab),
                 "target holds id")




@CASES.register
def one_rank_loss_input_error_raises_on_every_rank(group):
    """The losses' own checks (labels, loss_mask, per-token inputs, the teacher) run before the
    op's collectives: with validate a bad input of the last rank raises on every rank (was: a
    hang of the others until the gloo timeout)."""
    from megatron_vocabstats import TopK, distillation_loss, policy_loss, sft_loss, token_loss
    from megatron_vocabstats.losses import StatsOptions

    rank, tp = needs_tp2(group)
    last = rank == tp - 1
    logits, labels = torch.randn(2, 3, 8) + _own(group), torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 3)
    indices = torch.tensor([0, 1]).expand(2, 3, 2)
    teacher = TopK(torch.full((2, 3, 2), -1.0), indices)
    bad_teacher = TopK(torch.full((2, 3, 2), 0.5 if last else -1.0), indices)
    cases = [
        (lambda: sft_loss(logits, labels.float() if last else labels, mask, tp_group=group,
                          validate=True), "labels"),
        (lambda: sft_loss(logits, labels, torch.ones(3, 2) if last else mask, tp_group=group,
                          validate=True), "loss_mask"),
        (lambda: token_loss(logits, labels, mask, loss_fn=policy_loss, tp_group=group,
                            options=StatsOptions(validate=True),
                            loss_inputs=dict(old_logprobs=torch.zeros(2, 2 if last else 3),
                                             advantages=torch.zeros(2, 3))), "old_logprobs"),
        (lambda: distillation_loss(logits, teacher, torch.ones(3, 2) if last else mask,
                                   tp_group=group, validate=True), "loss_mask"),
        (lambda: distillation_loss(logits, bad_teacher, mask, tp_group=group, validate=True),
         "teacher.logprobs"),
    ]
    for fn, own in cases:
        expect_error(fn, own if last else "rejected their inputs", kind=Exception)


@CASES.register
def teacher_differing_across_ranks_is_refused(group):
    from megatron_vocabstats import TopK, distillation_loss

    rank, _ = needs_tp2(group)
    logits, mask = torch.randn(2, 3, 8) + _own(group), torch.ones(2, 3)
    indices = torch.tensor([0, 1]).expand(2, 3, 2)
    mine = TopK(torch.full((2, 3, 2), -1.0 - 0.5 * rank), indices)
    message = expect_error(lambda: distillation_loss(logits, mine, mask, tp_group=group,
                                                     validate=True),
                           "teacher.logprobs differs across the ranks of tp_group")
    assert "ranks [1] differ from rank 0" in message, message
    # Masked rows are not compared (as the op compares ids at counted rows only).
    masked = mask.clone()
    masked[0, 0] = 0
    lp = torch.full((2, 3, 2), -1.0)
    lp[0, 0] = -1.0 - rank
    distillation_loss(logits, TopK(lp, indices), masked, tp_group=group, validate=True)



@CASES.register
def loss_fn_errors_and_differing_loss_inputs_raise_everywhere(group):
    """token_loss with validate: an error of loss_fn itself on one rank (a non-float input, an
    option out of range) and per-token inputs that differ across ranks raise on every rank (was:
    one rank raised after the op, the others went on into backward)."""
    import functools

    from megatron_vocabstats import policy_loss, token_loss
    from megatron_vocabstats.losses import StatsOptions

    rank, tp = needs_tp2(group)
    last = rank == tp - 1
    logits, labels = torch.randn(2, 3, 8) + _own(group), torch.tensor([[1, 5, 7], [0, -100, 3]])
    mask, zeros = torch.ones(2, 3), torch.zeros(2, 3)

    def loss(loss_fn=policy_loss, **inputs):
        return token_loss(logits, labels, mask, loss_fn=loss_fn, tp_group=group,
                          options=StatsOptions(validate=True),
                          loss_inputs=dict(dict(old_logprobs=zeros, advantages=zeros + 1),
                                           **inputs))

    cases = [
        (lambda: loss(old_logprobs=zeros.long() if last else zeros), "old_logprobs"),
        (lambda: loss(old_logprobs=None if last else zeros), "old_logprobs"),
        (lambda: loss(functools.partial(policy_loss, clip_eps=2.0 if last else 0.2)), "clip_eps"),
    ]
    for fn, own in cases:
        expect_error(fn, own if last else "rejected their inputs", kind=Exception)
    expect_error(lambda: loss(advantages=zeros + 1 + rank),
                 "loss_inputs differs across the ranks of tp_group")
    # Differences at tokens that do not count are not compared.
    other = zeros + 1
    other[1, 1] = rank
    loss(advantages=other)


@CASES.register
def distillation_options_differing_across_ranks_raise_everywhere(group):
    from megatron_vocabstats import distillation_loss, vocab_parallel_topk

    rank, tp = needs_tp2(group)
    torch.manual_seed(0)
    full = torch.randn(3, 8 * tp)
    shard = full[:, rank * 8:(rank + 1) * 8]
    teacher = vocab_parallel_topk(full, 3)
    mask = torch.ones(3)
    cases = [
        (dict(divergence=["forward_kl", "reverse_kl"][rank % 2]),
         "divergence differs across the ranks of tp_group: ['forward_kl', 'reverse_kl'"),
        (dict(divergence="jsd", beta=0.25 + 0.5 * (rank % 2)),
         "beta differs across the ranks of tp_group: [0.25, 0.75"),
        (dict(tail_bucket=rank % 2 == 1), "tail_bucket differs"),
        (dict(renormalize=rank % 2 == 1), "renormalize differs"),
        (dict(temperature_scale=rank % 2 == 1, temperature=2.0), "temperature_scale differs"),
    ]
    for options, message in cases:
        expect_error(lambda: distillation_loss(shard, teacher, mask, tp_group=group,
                                               validate=True, **options), message)


if __name__ == "__main__":
    main(CASES)
