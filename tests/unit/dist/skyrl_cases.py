"""SkyRL's real functions (the installed ``skyrl==0.3.0`` wheel, loaded by ``_framework_stubs``)
against the SkyRL integration on 2 gloo ranks, at tp 1, tp 2 and cp 2 (Megatron's
``parallel_state`` re-initialised per layout); run by tests/unit/test_skyrl_dist.py.

Each case calls SkyRL's own functions (``model_utils``) on the same inputs before and after
``integrations.skyrl.apply()``, and compares both with float64 references from the unpacked
batch: values, and gradients of the logits, hidden states (this rank's shares summed over tp)
and weight. Tolerances: fp32 arithmetic on logits of magnitude ``m``, ``1e-5 (1 + m)`` for
values and ``2e-5`` for gradients (numerics.md's fp32 1e-5 on the terms, which are <= 1.5 here).
Edges: ids outside the vocabulary, a ``-inf``-masked vocabulary (SkyRL #2259: its entropy is
NaN, ours must not be), an empty micro-batch and a packed sequence of padding only.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import Cases, Skip, main  # noqa: E402

from _reference import assert_within  # noqa: E402

CASES = Cases()
V = 24  # vocabulary: shards of 12 at tp = 2
H = 16
MU = "skyrl.backends.skyrl_train.distributed.megatron.model_utils"
LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, cp)


def _setup(tp, cp):
    """SkyRL's model_utils (real code), Megatron's parallel state at ``tp`` x ``cp``, and the
    integration (removed: each case applies it itself). Returns (module, integration, eager,
    tp group, cp group or None)."""
    import _framework_stubs

    try:
        from megatron.core import parallel_state as ps
    except ImportError as exc:
        raise Skip(f"megatron-core not importable: {exc}") from exc
    try:
        module = _framework_stubs.load("skyrl")[MU]
    except ImportError as exc:
        raise Skip(str(exc)) from exc
    if ps.model_parallel_is_initialized() and (
            ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()) != (
            tp, cp):
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    import megatron_vocabstats.integrations.skyrl as integration

    integration.remove()
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    return module, integration, _framework_stubs.eager, ps.get_tensor_model_parallel_group(), \
        cp_group


def _vshard(full, tp_group):
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    width = full.shape[-1] // tp
    return full[..., rank * width:(rank + 1) * width]


def _both(integration, call):
    """``call()`` with SkyRL's functions, then with the integration applied."""
    theirs = call()
    integration.apply()
    try:
        ours = call()
    finally:
        integration.remove()
    return theirs, ours


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    assert_within(actual, expected.to(actual.dtype), tol, what)


def _batch(cp):
    """An unpacked batch (left and right padding, a row of padding only, ids outside the
    vocabulary) and its SkyRL packing: (sequences [3, 8], mask, cu_seqlens_padded, packed
    positions [3, 8] (-1 at padding), total T)."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    seqs = torch.randint(0, V, (3, 8))
    seqs[0, 2], seqs[1, 4] = V + 3, -7  # outside the vocabulary: log-prob 0
    align = 2 * cp
    lens = mask.sum(1)
    padded = [max(align, -(-int(n) // align) * align) for n in lens]  # row 2: padding only
    cu = torch.tensor([0] + padded).cumsum(0)
    pos = torch.full((3, 8), -1)
    for b in range(3):
        where = mask[b].nonzero().squeeze(1)
        pos[b, where] = cu[b] + torch.arange(len(where))
    return seqs, mask, cu, pos, int(cu[-1])


def _packed_local(full, cu, total, cp, cp_group, module):
    """This CP rank's tokens of the packed ``full [T, ...]`` (SkyRL's load-balanced split)."""
    if cp == 1:
        return full
    cu, _, seq, off, lens = module._packed_sequence_indices(cu, total, full.device)
    owner, local = module._packed_cp_rank_and_local_indices(cu, seq, off, lens, cp)
    mine = owner == dist.get_rank(cp_group)
    out = torch.empty((total // cp,) + full.shape[1:], dtype=full.dtype)
    out[local[mine]] = full[mine]
    return out


def _reference_logprobs(z, seqs, mask):
    """float64 [B, S-1]: log p(next real token) at each real position with one, else 0."""
    lp = torch.log_softmax(z.double(), -1)
    nxt = seqs[:, 1:].clamp(0, V - 1)
    out = lp[:, :-1].gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    valid = mask[:, :-1] & mask[:, 1:] & (seqs[:, 1:] >= 0) & (seqs[:, 1:] < V)
    return torch.where(valid, out, 0.0)


@CASES.register
def logits_logprobs_unpacked(group):
    """from_parallel_logits_to_logprobs at tp 1 and 2 (fwd + bwd) and cp 2 (forward: SkyRL's
    CP gather's backward is CUDA-only): theirs, ours and float64; ids outside the vocabulary give
    0 on both (ours with no gradient), and an empty micro-batch works."""
    for tp, cp in LAYOUTS:
        module, integration, eager, tp_group, cp_group = _setup(tp, cp)
        z = torch.randn(2, 8, V, dtype=torch.float64) * 3
        seqs = torch.randint(0, V, (2, 8))
        seqs[0, 3], seqs[1, 6] = V + 1, -2
        w = torch.rand(2, 7, dtype=torch.float64) + 0.5
        rank = 0 if cp_group is None else dist.get_rank(cp_group)
        local = _vshard(z.float(), tp_group)
        if cp > 1:
            local = module._get_tokens_on_this_cp_rank(local, rank, cp, seq_dim=1)
        leaves = []

        def call():
            leaf = _leaf(local)
            leaves.append(leaf)
            start = dist.get_rank(tp_group) * leaf.shape[-1]
            out = module.from_parallel_logits_to_logprobs(
                leaf, seqs, start, start + leaf.shape[-1], tp_group, cp_group=cp_group,
                chunk_size=3)
            if cp == 1:
                (out * w).sum().backward()
            return out
        with eager():
            theirs, ours = _both(integration, call)
        ref = _reference_logprobs(z, seqs, torch.ones_like(seqs, dtype=torch.bool))
        tol = 1e-5 * (1 + z.abs().max())
        assert ours.dtype == theirs.dtype == torch.float32
        _close(ours, ref, tol, f"ours tp{tp} cp{cp}")
        _close(theirs, ref, tol, f"SkyRL's tp{tp} cp{cp}")
        if cp == 1:
            leaf = z.detach().clone().requires_grad_()
            (torch.log_softmax(leaf, -1)[:, :-1].gather(
                -1, seqs[:, 1:].clamp(0, V - 1).unsqueeze(-1)).squeeze(-1)
             * w * ((seqs[:, 1:] >= 0) & (seqs[:, 1:] < V))).sum().backward()
            g_ref = _vshard(leaf.grad, tp_group)
            _close(leaves[1].grad, g_ref, 2e-5, f"ours gradient tp{tp}")
            rows = (seqs.roll(-1, -1) >= 0) & (seqs.roll(-1, -1) < V)  # SkyRL: -p elsewhere
            _close(leaves[0].grad[rows], g_ref[rows].float(), 2e-5, f"SkyRL's gradient tp{tp}")
            # empty micro-batch: [0, S - 1] on both
            empty = torch.zeros(0, 8, local.shape[-1])
            ids = torch.zeros(0, 8, dtype=torch.long)
            start = dist.get_rank(tp_group) * local.shape[-1]
            shapes = _both(integration, lambda: module.from_parallel_logits_to_logprobs(
                empty, ids, start, start + local.shape[-1], tp_group).shape)
            assert shapes[0] == shapes[1] == (0, 7), shapes


def _packed_call(module, fn, local, seqs, mask, cu, tp_group, cp_group, mode, **extra):
    total = int(cu[-1])
    target = torch.zeros(total, dtype=torch.long)
    sel = mask.clone()
    target[_positions(mask, cu)[sel]] = seqs[sel]
    kwargs = {"attention_mask": mask} if mode == "mask" else {}
    width = local.shape[-1] if fn.endswith("logits") else extra["lm_head_weight"].shape[0]
    start = dist.get_rank(tp_group) * width
    name = ("from_parallel_logits_to_logprobs_packed_sequences" if fn.endswith("logits")
            else "from_parallel_hidden_to_logprobs_packed_sequences")
    args = (local.unsqueeze(0),) + ((extra["lm_head_weight"],) if "lm_head_weight" in extra
                                    else ())
    return getattr(module, name)(*args, target.unsqueeze(0), cu, 8, start, start + width,
                                 tp_group, cp_group=cp_group, chunk_size=5, **kwargs,
                                 **{k: v for k, v in extra.items() if k == "temperature"})


def _positions(mask, cu):
    pos = torch.full(mask.shape, -1)
    for b in range(mask.shape[0]):
        where = mask[b].nonzero().squeeze(1)
        pos[b, where] = cu[b] + torch.arange(len(where))
    return pos


def _unpacked_z(zp, pos):
    """[B, S, V] of the packed [T, V] (zeros at padding)."""
    return torch.where((pos >= 0).unsqueeze(-1), zp[pos.clamp(min=0)], 0.0)


@CASES.register
def packed_logprobs(group):
    """from_parallel_logits_to_logprobs_packed_sequences and its fused variant at tp 1, tp 2 and
    cp 2, scattered by attention_mask and by the padded offsets: theirs, ours and float64,
    values and gradients (logits; hidden summed over tp, weight), a sequence of padding only."""
    for tp, cp in LAYOUTS:
        module, integration, eager, tp_group, cp_group = _setup(tp, cp)
        seqs, mask, cu, pos, total = _batch(cp)
        zp = torch.randn(total, V, dtype=torch.float64) * 3
        hp = torch.randn(total, H, dtype=torch.float64)
        weight = torch.randn(V, H, dtype=torch.float64) / 2
        ref_mask = _reference_logprobs(_unpacked_z(zp, pos), seqs, mask)
        for mode in ("mask", "offsets"):
            w = torch.rand(3, 7, dtype=torch.float64) + 0.5
            local = _packed_local(_vshard(zp.float(), tp_group), cu, total, cp, cp_group, module)
            leaves = []

            def call():
                leaf = _leaf(local)
                leaves.append(leaf)
                out = _packed_call(module, "logits", leaf, seqs, mask, cu, tp_group, cp_group,
                                   mode)
                (out * w).sum().backward()
                return out
            theirs, ours = _both(integration, call)
            tol = 1e-5 * (1 + zp.abs().max())
            _close(ours, theirs, tol, f"ours vs SkyRL's tp{tp} cp{cp} {mode}")
            if mode == "mask":
                _close(ours, ref_mask, tol, f"ours vs float64 tp{tp} cp{cp}")
                assert (ours[2] == 0).all(), "the row of padding only"
            valid = ((target_rows := _next_ids(seqs, mask, cu, total, cp, cp_group, module))
                     >= 0) & (target_rows < V)
            _close(leaves[1].grad[valid], leaves[0].grad[valid], 2e-5,
                   f"logits gradient tp{tp} cp{cp} {mode}")
            assert (leaves[1].grad[~valid] == 0).all()
        # fused: hidden [1, T/cp, H] and the weight shard, temperature 0.7
        hid = _packed_local(hp.float(), cu, total, cp, cp_group, module)
        wshard = _vshard(weight.float().T, tp_group).T.contiguous()
        # weights 0 where the next id is outside the vocabulary (SkyRL's gradient there is -p)
        w = (torch.rand(3, 7, dtype=torch.float64) + 0.5) * ((seqs[:, 1:] >= 0) & (seqs[:, 1:] < V))
        grads = []

        def fused():
            h, wt = _leaf(hid), _leaf(wshard)
            out = _packed_call(module, "hidden", h, seqs, mask, cu, tp_group, cp_group, "mask",
                               lm_head_weight=wt, temperature=0.7)
            (out * w).sum().backward()
            dx = h.grad.clone()
            dist.all_reduce(dx, group=tp_group)  # SkyRL's SP gather's backward sums the shares
            dw = wt.grad.clone()
            if cp_group is not None:  # each CP rank's tokens: Megatron's grad reduce sums them
                dist.all_reduce(dw, group=cp_group)
            grads.append((dx, dw))
            return out
        theirs, ours = _both(integration, fused)
        zf = (hp @ weight.T) / 0.7
        tol = 1e-5 * (1 + zf.abs().max())
        _close(ours, theirs, tol, f"fused ours vs SkyRL's tp{tp} cp{cp}")
        _close(ours, _reference_logprobs(_unpacked_z(zf, pos), seqs, mask), tol,
               f"fused ours vs float64 tp{tp} cp{cp}")
        hl, wl = _leaf(hp), _leaf(weight)
        (_reference_logprobs(_unpacked_z(hl @ wl.T / 0.7, pos), seqs, mask) * w).sum().backward()
        refs = (_packed_local(hl.grad, cu, total, cp, cp_group, module),
                _vshard(wl.grad.T, tp_group).T)
        for i, what in enumerate(("d hidden", "d weight")):
            tol = 2e-5 * (1 + hp.abs().max())
            _close(grads[1][i], grads[0][i], tol, f"fused {what} ours vs SkyRL's tp{tp} cp{cp}")
            _close(grads[1][i], refs[i], tol, f"fused {what} ours vs float64 tp{tp} cp{cp}")


def _next_ids(seqs, mask, cu, total, cp, cp_group, module):
    """The rolled packed targets of this CP rank's tokens [T/cp] (the ids each row scores)."""
    target = torch.zeros(total, dtype=torch.long)
    target[_positions(mask, cu)[mask]] = seqs[mask]
    cu_, _, seq, off, lens = module._packed_sequence_indices(cu, total, target.device)
    rolled = target[cu_[seq] + torch.remainder(off + 1, lens[seq])]
    return _packed_local(rolled, cu, total, cp, cp_group, module)


def _entropy_ref(z):
    """float64 entropy; a -inf logit counts as -1e4 (probability 0 in float64, exactly, and
    a zero gradient, where autograd through -inf gives NaN)."""
    logp = torch.log_softmax(z.double().clamp(min=-1e4), -1)
    return -(logp.exp() * logp).sum(-1)


@CASES.register
def entropy_unfused(group):
    """vocab_parallel_entropy at tp 1 and 2: fp32 and bf16 values, fp32 gradients, theirs vs
    ours vs float64; a -inf-masked vocabulary: SkyRL's NaN (#2259), ours finite and exact;
    vocab_parallel_entropy_packed_sequences (SkyRL's own on ours) at tp 1, 2 and cp 2."""
    for tp, cp in LAYOUTS:
        module, integration, eager, tp_group, cp_group = _setup(tp, cp)
        z = torch.randn(2, 5, V, dtype=torch.float64) * 3
        z[1, :, 1::3] = float("-inf")  # masked columns on both shards
        w = torch.rand(2, 5, dtype=torch.float64) + 0.5
        ref = _entropy_ref(z)
        for dtype in (torch.float32, torch.bfloat16):
            local = _vshard(z.to(dtype), tp_group).contiguous()
            leaves = []

            def call():
                leaf = _leaf(local)
                leaves.append(leaf)
                out = module.vocab_parallel_entropy(leaf)
                if dtype == torch.float32:
                    (torch.nan_to_num(out) * w).sum().backward()
                return out
            with eager():
                theirs, ours = _both(integration, call)
            assert ours.dtype == theirs.dtype == dtype
            assert torch.isnan(theirs[1]).all(), "SkyRL's entropy of a masked vocabulary"
            u = 1e-5 if dtype == torch.float32 else 2.0**-8 * 4
            _close(ours, ref.to(dtype), u * (1 + ref.abs()), f"ours entropy tp{tp} {dtype}")
            _close(theirs[0], ref[0].to(dtype), 8 * u * (1 + z[0].abs().max()),
                   f"SkyRL's entropy tp{tp} {dtype}")
            if dtype == torch.float32:
                leaf = z.detach().clone().requires_grad_()
                (_entropy_ref(leaf) * w).sum().backward()
                g_ref = _vshard(leaf.grad, tp_group)
                _close(leaves[1].grad, g_ref, 2e-5, f"ours entropy gradient tp{tp}")
                _close(leaves[0].grad[0], g_ref[0], 2e-5, f"SkyRL's entropy gradient tp{tp}")
        # packed: SkyRL's own weighting on the replaced per-token entropy
        seqs, mask, cu, pos, total = _batch(cp)
        zp = torch.randn(total, V) * 3
        local = _packed_local(_vshard(zp, tp_group), cu, total, cp, cp_group, module)
        loss_mask = (torch.rand(3, 4) > 0.3).float()
        leaves = []

        def packed():
            leaf = _leaf(local.unsqueeze(0))
            leaves.append(leaf)
            metric, term = module.vocab_parallel_entropy_packed_sequences(
                leaf, cu, 8, 4, mask, loss_mask, cp_group)
            term.backward()
            return torch.stack([metric, term])
        with eager():
            theirs, ours = _both(integration, packed)
        _close(ours, theirs, 1e-5 * (1 + zp.abs().max()), f"packed entropy tp{tp} cp{cp}")
        _close(leaves[1].grad, leaves[0].grad, 2e-5, f"packed entropy gradient tp{tp} cp{cp}")


@CASES.register
def entropy_fused(group):
    """_fused_vocab_parallel_entropy_from_hidden at tp 1 and 2 and its packed caller at tp 1,
    2 and cp 2: values theirs vs ours vs float64 without gradients; with gradients enabled
    (SkyRL's use_entropy_loss) ours has the exact gradient (d hidden summed over tp, d weight)."""
    for tp, cp in LAYOUTS:
        module, integration, eager, tp_group, cp_group = _setup(tp, cp)
        hidden = torch.randn(2, 6, H, dtype=torch.float64)
        weight = torch.randn(V, H, dtype=torch.float64) / 2
        wshard = _vshard(weight.float().T, tp_group).T.contiguous()
        zf = hidden @ weight.T / 0.7
        with torch.no_grad():
            theirs, ours = _both(integration, lambda: module._fused_vocab_parallel_entropy_from_hidden(
                hidden.float(), wshard, tp_group, chunk_size=4, temperature=0.7))
        tol = 1e-5 * (1 + zf.abs().max())
        _close(ours, _entropy_ref(zf), tol, f"fused entropy tp{tp}")
        _close(theirs, _entropy_ref(zf), tol, f"SkyRL's fused entropy tp{tp}")
        integration.apply()
        try:
            h, wt = _leaf(hidden.float()), _leaf(wshard)
            w = torch.rand(2, 6, dtype=torch.float64) + 0.5
            (module._fused_vocab_parallel_entropy_from_hidden(h, wt, tp_group, temperature=0.7)
             * w).sum().backward()
        finally:
            integration.remove()
        hl, wl = _leaf(hidden), _leaf(weight)
        (_entropy_ref(hl @ wl.T / 0.7) * w).sum().backward()
        dx = h.grad.clone()
        dist.all_reduce(dx, group=tp_group)
        _close(dx, hl.grad, 2e-5 * (1 + zf.abs().max()), f"fused entropy d hidden tp{tp}")
        _close(wt.grad, _vshard(wl.grad.T, tp_group).T, 2e-5 * (1 + zf.abs().max()),
               f"fused entropy d weight tp{tp}")
        # packed, SkyRL's own weighting on ours (no grad, as SkyRL's metric)
        seqs, mask, cu, pos, total = _batch(cp)
        hp = torch.randn(total, H)
        local = _packed_local(hp, cu, total, cp, cp_group, module)
        loss_mask = (torch.rand(3, 4) > 0.3).float()
        with torch.no_grad():
            theirs, ours = _both(integration, lambda: torch.stack(
                module.from_parallel_hidden_to_entropy_packed_sequences(
                    local.unsqueeze(0), wshard, cu, 8, 4, mask, loss_mask, cp_group,
                    tp_group=tp_group, chunk_size=3, temperature=0.7)))
        _close(ours, theirs, tol, f"fused packed entropy tp{tp} cp{cp}")


if __name__ == "__main__":
    main(CASES, timeout_s=300.0)
