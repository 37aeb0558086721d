"""Multi-process cases for the loss functions; run by tests/unit/test_losses_dist.py.

Every rank builds the same full logits from the same seed and keeps its vocabulary shard; the
losses computed from the shards under tensor parallelism must equal the float64 single-process
losses on the full vocabulary (fp32 tolerances of docs/numerics.md), gradients included.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main  # noqa: E402

from _reference import reference_stats  # noqa: E402
from megatron_vocabstats.losses import (  # noqa: E402
    StatsOptions,
    StepBatch,
    logprobs_step,
    make_forward_step,
    policy_loss,
    sft_loss,
    token_loss,
)

CASES = Cases()
VOCAB = 37  # odd: the last shard carries padding for tp = 2


def _shard_bounds(group):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    width = -(-VOCAB // tp)
    return rank * width, (rank + 1) * width, width * tp


def _case(group, shape=(3, 6)):
    lo, hi, padded = _shard_bounds(group)
    full = torch.randn(*shape, padded, dtype=torch.float64) * 3
    labels = torch.randint(0, VOCAB, shape)
    mask = torch.ones(shape)
    mask[0, :2] = 0
    mask[2] = 0  # an all-masked row
    shard = full[..., lo:hi].float().clone().requires_grad_()
    return full, shard, labels, mask


def _close(actual, expected, *, rtol=1e-5, atol=1e-5, what):
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).abs()
    assert bool((err <= atol + rtol * expected.abs()).all()), (
        f"rank {dist.get_rank()}: {what}: max error {err.max().item():.3g}"
    )


def _my_columns(grad_full, group):
    lo, hi, _ = _shard_bounds(group)
    return grad_full[..., lo:hi]


@CASES.register
def sft_loss_equals_single_process(group):
    full, shard, labels, mask = _case(group)
    out = sft_loss(shard, labels, mask, tp_group=group, vocab_size=VOCAB, chunk_size=4,
                   label_smoothing=0.1, temperature=0.8, entropy="metric")
    (out.loss_sum / out.num_tokens).backward()

    leaf = full.detach().requires_grad_()
    keep = mask != 0
    nll = F.cross_entropy(leaf[..., :VOCAB].flatten(0, 1) / 0.8, labels.flatten(),
                          reduction="none", label_smoothing=0.1)
    ref_sum = (nll * keep.flatten()).sum()
    (ref_sum / keep.sum()).backward()
    assert int(out.num_tokens) == int(keep.sum())
    _close(out.loss_sum, ref_sum, what="loss_sum")
    _close(out.report["lm loss"], torch.stack([ref_sum.detach(), keep.sum().double()]),
           what="report")
    _close(shard.grad, _my_columns(leaf.grad, group), atol=1e-6, what="gradient")

    with torch.no_grad():
        scores = logprobs_step(shard, labels, mask, tp_group=group, vocab_size=VOCAB).report
    ref_lp, ref_ent, _ = reference_stats(full, torch.where(keep, labels, -100), vocab_size=VOCAB)
    _close(scores["logprobs"], ref_lp, what="scored logprobs")
    _close(scores["entropy"], ref_ent, what="scored entropy")


POLICY = dict(clip_eps=0.2, clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.05, kl_estimator="k3",
              entropy_coef=0.01, aggregation="sequence-mean")


def _rollout(labels):
    gen = torch.Generator().manual_seed(7)
    shape = labels.shape
    return dict(old_logprobs=torch.randn(shape, generator=gen, dtype=torch.float64) - 3.5,
                advantages=torch.randn(shape, generator=gen, dtype=torch.float64),
                ref_logprobs=torch.randn(shape, generator=gen, dtype=torch.float64) - 3.5)


@CASES.register
def policy_loss_equals_single_process(group):
    full, shard, labels, mask = _case(group)
    rollout = _rollout(labels)
    out = token_loss(shard, labels, mask, loss_fn=functools.partial(policy_loss, **POLICY),
                     loss_inputs={k: v.float() for k, v in rollout.items()}, tp_group=group,
                     options=StatsOptions(vocab_size=VOCAB, entropy="grad", chunk_size=5))
    (out.loss_sum / out.num_tokens).backward()

    leaf = full.detach().requires_grad_()
    keep = mask != 0
    lp, ent, _ = reference_stats(leaf, torch.where(keep, labels, -100), vocab_size=VOCAB)
    ref = policy_loss(lp, rollout["old_logprobs"], rollout["advantages"], mask, entropy=ent,
                      ref_logprobs=rollout["ref_logprobs"], **POLICY)
    (ref.loss_sum / ref.num_tokens).backward()
    assert int(out.num_tokens) == int(ref.num_tokens) == 2  # rows, for sequence-mean
    _close(out.loss_sum, ref.loss_sum, what="loss_sum")
    assert set(out.report) == set(ref.report)
    for key in out.report:
        _close(out.report[key], ref.report[key], what=f"report {key}")
    _close(shard.grad, _my_columns(leaf.grad, group), atol=1e-6, what="gradient")


class ShardedHead(torch.nn.Module):
    """Embedding + this rank's rows of a vocab-parallel output layer, with a ``tp_group``."""

    def __init__(self, group, full_weight, embedding):
        super().__init__()
        lo, hi, _ = _shard_bounds(group)
        self.embedding = torch.nn.Embedding.from_pretrained(embedding, freeze=True)
        self.weight = torch.nn.Parameter(full_weight[lo:hi].clone())
        self.tp_group = group

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        return self.embedding(input_ids) @ self.weight.t()


@CASES.register
def forward_step_reads_tp_group_from_model(group):
    _, _, padded = _shard_bounds(group)
    hidden = 8
    weight = torch.randn(padded, hidden)
    embedding = torch.randn(VOCAB, hidden)
    tokens = torch.randint(0, VOCAB, (2, 7))
    mask = torch.ones(2, 6)
    mask[1, 3:] = 0
    batch = StepBatch({"input_ids": tokens[:, :-1]}, tokens[:, 1:], mask)
    model = ShardedHead(group, weight, embedding)
    step = make_forward_step(lambda it: next(it), functools.partial(policy_loss, entropy_coef=0.1),
                             stats=StatsOptions(vocab_size=VOCAB, entropy="grad"))
    rollout = _rollout(batch.labels)
    batch = batch._replace(loss_inputs={"old_logprobs": rollout["old_logprobs"].float(),
                                        "advantages": rollout["advantages"].float()})
    output, loss_func = step(iter([batch]), model)
    out = loss_func(output)
    (out.loss_sum / out.num_tokens).backward()

    leaf = weight.double().requires_grad_()
    logits = embedding.double()[tokens[:, :-1]] @ leaf.t()
    lp, ent, _ = reference_stats(logits, batch.labels, vocab_size=VOCAB)
    ref = policy_loss(lp, rollout["old_logprobs"], rollout["advantages"], mask, entropy=ent,
                      entropy_coef=0.1)
    (ref.loss_sum / ref.num_tokens).backward()
    lo, hi, _ = _shard_bounds(group)
    _close(out.loss_sum, ref.loss_sum, what="loss_sum")
    _close(model.weight.grad, leaf.grad[lo:hi], atol=1e-6, what="weight gradient")


if __name__ == "__main__":
    main(CASES)
