"""The NeMo-RL integration on 2 gloo ranks, at tp 1, tp 2 and cp 2 (tp 1): every replaced
function called through the name NeMo-RL's loss or train module binds, before (the stand-in of
``_nemo_rl_standin``, NeMo-RL's conventions) and after ``integrations.nemo_rl.apply()``, on the
same inputs; values and gradients against each other and against float64 references. Run by
tests/unit/test_nemo_rl_dist.py.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/unit
import _nemo_rl_standin
from _harness import Cases, main

CASES = Cases()
V, B, S = 24, 2, 8  # padded vocabulary W·tp (shards of 12 at tp 2), batch, sequence
LOSS, TRAIN = "nemo_rl.algorithms.loss.utils", "nemo_rl.models.megatron.train"


_GROUPS = {}


def _layout(world):
    """``{"tp1": (tp, cp), "tp2": ..., "cp2": ...}``: each rank's groups (every rank creates
    every group, as ``new_group`` requires; once)."""
    if not _GROUPS:
        singles = [dist.new_group([r]) for r in range(world.size())]
        own = singles[world.rank()]
        _GROUPS.update(tp1=(own, None), tp2=(world, None), cp2=(own, world))
    return _GROUPS


def _integration():
    modules = _nemo_rl_standin.install()
    import megatron_vocabstats.integrations.nemo_rl as integration

    integration.remove()
    return modules, integration


def _both(fn_of, call):
    """``call(fn)`` with NeMo-RL's binding (the stand-in) and with the integration's; the
    integration is removed afterwards."""
    modules, integration = _integration()
    theirs = call(fn_of(modules))
    integration.apply()
    try:
        assert integration.is_applied()
        ours = call(fn_of(modules))
        assert fn_of(modules).__wrapped__ is not None
    finally:
        integration.remove()
    return theirs, ours


def _shard(full, tp):
    rank, size = dist.get_rank(tp), dist.get_world_size(tp)
    width = full.shape[-1] // size
    return full[..., rank * width:(rank + 1) * width]


def _cp_shard(full, cp, dim=1):
    if cp is None:
        return full
    return _nemo_rl_standin.cp_split(full, dist.get_world_size(cp), dist.get_rank(cp), dim)


def _close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol}"


def _leaf(x):
    return x.detach().clone().requires_grad_()


def _logprobs_case(world, layout, packed):
    tp, cp = _layout(world)[layout]
    full = torch.randn(B, S, V, dtype=torch.float64)
    ids = torch.randint(0, V, (B, S))
    ids[0, 3] = -5  # outside the shards: 0 in both
    w = torch.randn(B, S - 1, dtype=torch.float64)
    ref = torch.log_softmax(full[:, :-1], -1).gather(-1, ids[:, 1:, None].clamp(min=0))[..., 0]
    ref[0, 2] = 0.0
    logits = _cp_shard(_shard(full, tp), cp).float()
    cu = torch.tensor([0, S, 2 * S])

    def call(fn):
        z = _leaf(logits)
        if packed:
            out = fn(z.reshape(1, -1, z.shape[-1]) if cp is None else
                     torch.cat([_cp_shard(z[i:i + 1], None) for i in range(B)], 1),
                     ids.reshape(1, -1), cu, S, dist.get_rank(tp) * z.shape[-1],
                     (dist.get_rank(tp) + 1) * z.shape[-1], tp, cp_group=cp)
        else:
            out = fn(ids, z, vocab_parallel_rank=dist.get_rank(tp), vocab_parallel_group=tp,
                     context_parallel_group=cp)
        (out * w).sum().backward()
        return out.detach(), z.grad

    name = ("from_parallel_logits_to_logprobs_packed_sequences" if packed
            else "get_next_token_logprobs_from_logits")
    (theirs, g_theirs), (ours, g_ours) = _both(lambda m: getattr(m[LOSS], name), call)
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape == (B, S - 1)
    _close(ours, ref, 2e-5, "logprobs vs float64")
    _close(ours, theirs, 2e-5, "logprobs vs NeMo-RL's")
    leaf = full.clone().requires_grad_()
    picked = torch.log_softmax(leaf[:, :-1], -1).gather(-1, ids[:, 1:, None].clamp(min=0))
    (picked[..., 0] * w * (ids[:, 1:] >= 0)).sum().backward()
    # NeMo-RL's cp gather sums the gradient over cp (a loss every cp rank computes alike)
    g_ref = _cp_shard(_shard(leaf.grad, tp), cp) * (1 if cp is None else dist.get_world_size(cp))
    mask = torch.ones(B, S)
    mask[0, 2] = 0  # NeMo-RL passes -p*g to the row of an out-of-range id; ours gives it none
    mask = _cp_shard(_shard(mask[..., None].expand(B, S, V), tp), cp)
    _close(g_ours * mask, g_ref * mask, 2e-5, "gradient vs float64")
    _close(g_ours * mask, g_theirs * mask, 2e-5, "gradient vs NeMo-RL's")
    assert torch.all(g_ours[mask == 0] == 0), "the out-of-range row has a gradient"


def _packed_cp_case(world, layout):
    """Packed rows under cp: the per-sequence split of NeMo-RL's packing ([1, T] packed row of
    two sequences of S, each split into its load-balanced chunks)."""
    tp, cp = _layout(world)[layout]
    full = torch.randn(2 * S, V)
    ids = torch.randint(0, V, (1, 2 * S))
    cu = torch.tensor([0, S, 2 * S])
    parts = [_cp_shard(full[None, a:a + S], cp) for a in (0, S)]
    logits = torch.cat(parts, 1)

    def call(fn):
        z = _leaf(logits)
        out = fn(z, ids, cu, S + 1, 0, V, tp, cp_group=cp)
        out.sum().backward()
        return out.detach(), z.grad

    name = "from_parallel_logits_to_logprobs_packed_sequences"
    (theirs, g_theirs), (ours, g_ours) = _both(lambda m: getattr(m[TRAIN], name), call)
    assert ours.shape == theirs.shape == (2, S)
    _close(ours, theirs, 2e-5, "packed cp logprobs")
    _close(g_ours, g_theirs, 2e-5, "packed cp gradient (summed over cp as NeMo-RL's)")


def _distill_case(world, layout, zero_outside):
    tp, cp = _layout(world)[layout]
    full = torch.randn(B, S, V)
    teacher = torch.randn(B, S, 4)
    idx = torch.stack([torch.randperm(V)[:4] for _ in range(B * S)]).view(B, S, 4)
    logits = _cp_shard(_shard(full, tp), cp).to(torch.bfloat16)

    def call(fn):
        z = _leaf(logits)
        s, t, h = fn(z, teacher, idx, zero_outside, zero_outside, dist.get_rank(tp), tp, cp)
        loss = (s * t.exp()).sum() + (h.sum() if h is not None else 0)
        loss.backward()
        return (s.detach(), t, h.detach() if h is not None else None), z.grad

    name = "get_distillation_topk_logprobs_from_logits"
    (theirs, g_theirs), (ours, g_ours) = _both(lambda m: getattr(m[LOSS], name), call)
    z64 = full.to(torch.bfloat16).double()
    ref = (torch.log_softmax(z64, -1).gather(-1, idx) if zero_outside
           else torch.log_softmax(z64.gather(-1, idx), -1))[:, :-1]
    _close(ours[0], ref, 2e-5, "student top-k logprobs vs float64")
    _close(ours[0], theirs[0], 2e-5, "student top-k logprobs vs NeMo-RL's")
    _close(ours[1], theirs[1], 0, "teacher logprobs")
    if zero_outside:
        p = torch.softmax(z64, -1)
        _close(ours[2], (p * p.log()).sum(-1)[:, :-1], 2e-5, "H_all = sum p log p")
        _close(ours[2], theirs[2], 2e-5, "H_all vs NeMo-RL's")
    assert g_ours.dtype == torch.bfloat16
    _close(g_ours, g_theirs.to(torch.bfloat16), 2e-2, "student gradient vs NeMo-RL's")


def _topk_case(world, layout):
    tp, _ = _layout(world)[layout]
    logits = _shard(torch.randn(B, S, V), tp).to(torch.bfloat16)
    rank, width = dist.get_rank(tp), logits.shape[-1]

    def call(fn):
        return fn(logits, 5, tp, vocab_start_index=rank * width,
                  vocab_end_index=(rank + 1) * width)

    theirs, ours = _both(lambda m: m[TRAIN].distributed_vocab_topk, call)
    assert ours[0].dtype == torch.float32, ours[0].dtype
    assert torch.equal(ours[0], theirs[0]), (ours[0], theirs[0])
    full = torch.cat([torch.empty_like(logits) for _ in range(dist.get_world_size(tp))], -1)
    dist.all_gather(list(full.chunk(dist.get_world_size(tp), -1)), logits, group=tp)
    # the same logits at the ids (bf16 ties: ours lowest id first, NeMo-RL's torch.topk's order)
    assert torch.equal(full.float().gather(-1, ours[1]), theirs[0])


def _hidden_case(world, layout):
    tp, _ = _layout(world)[layout]
    size, H = dist.get_world_size(tp), 16
    hidden_full = torch.randn(S, B, H, dtype=torch.float64)
    weight_full = torch.randn(V, H, dtype=torch.float64) / 4
    ids = torch.randint(0, V, (B, S))
    rank, width = dist.get_rank(tp), V // size
    hidden = hidden_full.chunk(size)[rank].float()  # sequence-parallel shard
    weight = weight_full[rank * width:(rank + 1) * width].float()
    w = torch.randn(B, S - 1)

    def call(fn):
        h, wt = _leaf(hidden), _leaf(weight)
        out = fn(h, wt, False, ids, rank * width, (rank + 1) * width, tp, chunk_size=S // 2)
        (out * w).sum().backward()
        return out.detach(), h.grad, wt.grad

    theirs, ours = _both(lambda m: m["nemo_rl.distributed.model_utils"]
                         .from_parallel_hidden_states_to_logprobs, call)
    logits = (hidden_full @ weight_full.T).transpose(0, 1)
    ref = torch.log_softmax(logits, -1).gather(-1, ids.roll(-1, -1)[..., None])[..., 0][:, :-1]
    assert ours[0].shape == (B, S - 1) and ours[0].dtype == torch.float32
    _close(ours[0], ref, 5e-5, "fused logprobs vs float64")
    _close(ours[0], theirs[0], 5e-5, "fused logprobs vs NeMo-RL's")
    _close(ours[1], theirs[1], 5e-5, "dX of the sequence-parallel shard vs NeMo-RL's")
    _close(ours[2], theirs[2], 5e-5, "dW vs NeMo-RL's")


for _layout_name in ("tp1", "tp2", "cp2"):
    for _packed in (False, True):
        if _layout_name == "cp2" and _packed:
            continue  # the packed cp layout: packed_cp2 below
        CASES[f"logprobs_{'packed_' if _packed else ''}{_layout_name}"] = (
            lambda g, _l=_layout_name, _p=_packed: _logprobs_case(g, _l, _p))
    for _zero in (True, False):
        CASES[f"distill_{'zero' if _zero else 'gather'}_{_layout_name}"] = (
            lambda g, _l=_layout_name, _z=_zero: _distill_case(g, _l, _z))
for _layout_name in ("tp1", "tp2"):
    CASES[f"topk_{_layout_name}"] = lambda g, _l=_layout_name: _topk_case(g, _l)
    CASES[f"hidden_{_layout_name}"] = lambda g, _l=_layout_name: _hidden_case(g, _l)
for _layout_name in ("tp1", "cp2"):
    CASES[f"packed_cp_{_layout_name}"] = lambda g, _l=_layout_name: _packed_cp_case(g, _l)


if __name__ == "__main__":
    main(CASES, timeout_s=120.0)
