"""Identical shards on every rank of the tp group: legitimate input, computed as tp
vocabulary shards with one warning per process, refused only where the logits are known to hold
the whole vocabulary. Run by tests/unit/test_identical_shards_dist.py at tp 2 and 4.

The patterns of the peers' own suites: Megatron's ``test_vocab_parallel_cross_entropy`` (the
same ``arange`` logits on every rank) and NeMo-RL's packed-sequence log-prob test (every rank
draws its shard from the same seed). Each result is compared with the float64 reference of the
sharded definition: the full logits are the rank's shard repeated tp times.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType, SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, main  # noqa: E402

from _reference import assert_within, reference_stats, stats_bounds  # noqa: E402
import megatron_vocabstats as mv  # noqa: E402
from megatron_vocabstats.ops._replicated import IdenticalShardsWarning  # noqa: E402

CASES = Cases()


def _tp(group):
    return dist.get_world_size(group)


def _check_sharded(shard, target, got_lp, got_ent, grad, tp, what):
    """``got_*`` (and ``grad``: of ``sum(logprobs)``, plus ``sum(entropy)`` where ``got_ent`` is
    given, w.r.t. this rank's shard) against the float64 reference over ``tp`` copies of
    ``shard``."""
    width = shard.shape[-1]
    full = torch.cat([shard.detach().double()] * tp, dim=-1).requires_grad_()
    lp, ent, _ = reference_stats(full, target)
    (lp.sum() + (0 if got_ent is None else ent.sum())).backward()
    b = stats_bounds(full.detach().reshape(-1, width * tp), width=width, parts=tp)
    lp_bound = b.logp.gather(-1, target.reshape(-1, 1).clamp(min=0)).reshape(target.shape)
    assert_within(got_lp, lp, lp_bound, f"{what}: logprobs")
    if got_ent is not None:
        assert_within(got_ent, ent, b.entropy.reshape(ent.shape), f"{what}: entropy")
    if grad is not None:  # every rank's shard gets the gradient of its own copy
        rank = dist.get_rank()
        ref = full.grad[..., rank * width:(rank + 1) * width]
        assert_within(grad, ref, 1e-5 * (1 + ref.abs()), f"{what}: gradient")


@CASES.register
def megatron_same_logits_on_every_rank(group):
    """Megatron's pattern: ``arange(0, 8).repeat(16, 4)`` on every rank; the drop-in's loss equals
    the reference of the sharded definition and its values (10.2309, 8.2309, ... at tp 4); the
    first such call of the process warns once, the second does not."""
    tp = _tp(group)
    logits = torch.arange(0, 8, dtype=torch.float32).repeat(16, 4).requires_grad_()
    target = torch.arange(0, 32, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = mv.vocab_parallel_cross_entropy(logits, target, tp_group=group)
        mv.vocab_parallel_cross_entropy(logits.detach(), target, tp_group=group)
    ours = [w for w in seen if issubclass(w.category, IdenticalShardsWarning)]
    assert len(ours) == 1, [str(w.message) for w in seen]
    assert "tp_group holds the same" in str(ours[0].message), str(ours[0].message)
    loss.sum().backward()
    _check_sharded(logits, target, -loss, None, -logits.grad, tp, "megatron pattern")
    if tp == 4:
        expected = torch.tensor([10.2309, 8.2309, 6.2309, 4.2309] * 4)
        assert torch.equal(torch.round(loss.detach()), torch.round(expected)), loss


@CASES.register
def nemo_rl_same_seed_shards(group):
    """NeMo-RL's pattern: every rank draws its ``[B, S, V/tp]`` shard from the same seed; the
    log-probs and entropy (and their gradient) are the sharded definition's."""
    tp = _tp(group)
    g = torch.Generator().manual_seed(42)
    shard = (torch.randn(2, 5, 16, generator=g) * 2).requires_grad_()
    target = torch.randint(0, 16 * tp, (2, 5), generator=g)
    st = mv.vocab_parallel_stats(shard, target, tp_group=group)
    (st.logprobs.sum() + st.entropy.sum()).backward()
    _check_sharded(shard, target, st.logprobs, st.entropy, shard.grad, tp, "nemo-rl pattern")


@CASES.register
def same_shard_narrower_than_vocab_size(group):
    """``vocab_size`` given but wider than a shard: the logits cannot be the whole vocabulary,
    so equal shards are shards (also the fused head's equal weight shards)."""
    tp = _tp(group)
    g = torch.Generator().manual_seed(7)
    shard = torch.randn(6, 16, generator=g)
    target = torch.randint(0, 16 * tp, (6,), generator=g)
    st = mv.vocab_parallel_stats(shard, target, tp_group=group, vocab_size=16 * tp)
    _check_sharded(shard, target, st.logprobs, st.entropy, None, tp, "vocab_size given")
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(16, 8, generator=g)
    fused = mv.linear_vocab_parallel_stats(hidden, weight, target, tp_group=group)
    _check_sharded(hidden.double() @ weight.double().T, target, fused.logprobs, fused.entropy,
                   None, tp, "fused head, the same weight shard")


def _refused(call, what):
    try:
        call()
    except ValueError as exc:
        text = str(exc)
        assert "tp_group holds the same" in text and "replicated" in text, f"{what}: {text}"
    else:
        raise AssertionError(f"{what}: the full logits replicated on every rank were accepted")


@CASES.register
def replicated_full_logits_refused_where_known(group):
    """Logits at least as wide as the vocabulary (``vocab_size`` given, or Megatron-LM's
    ``args.padded_vocab_size``) and equal on every rank are the full logits replicated: refused
    on every rank naming tp_group, the fused head's full weight too."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(4, 40, generator=g)
    target = torch.randint(0, 37, (4,), generator=g)
    _refused(lambda: mv.vocab_parallel_stats(full, target, tp_group=group, vocab_size=40),
             "vocab_size = width")
    _refused(lambda: mv.vocab_parallel_logprobs(full, target, tp_group=group, vocab_size=37),
             "vocab_size < width (padded)")
    hidden, weight = torch.randn(4, 8, generator=g), torch.randn(40, 8, generator=g)
    _refused(lambda: mv.linear_vocab_parallel_stats(hidden, weight, target, tp_group=group,
                                                    vocab_size=37), "the full weight")
    name = "megatron.training.global_vars"
    saved = sys.modules.get(name)
    fake = ModuleType(name)
    fake._GLOBAL_ARGS = SimpleNamespace(padded_vocab_size=40)
    sys.modules[name] = fake
    try:
        _refused(lambda: mv.vocab_parallel_stats(full, target, tp_group=group),
                 "Megatron's padded_vocab_size")
        fake._GLOBAL_ARGS.padded_vocab_size = 40 * _tp(group)  # a shard of it: computed
        mv.vocab_parallel_stats(full, target, tp_group=group)
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved


if __name__ == "__main__":
    main(CASES, timeout_s=120.0)
