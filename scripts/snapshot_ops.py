"""Bitwise snapshots of every public op and loss: proof that a refactor changes no output bit.

Usage (repository root, CPU, gloo; ``--standalone`` picks a free port, plain torchrun works too)::

    python scripts/snapshot_ops.py save /tmp/snap/tp1 && \
        torchrun --standalone --nproc_per_node 2 scripts/snapshot_ops.py save /tmp/snap/tp2
    # refactor; the same two commands into /tmp/snap_new/{tp1,tp2}; then
    python scripts/snapshot_ops.py compare /tmp/snap/tp1 /tmp/snap_new/tp1 && \
        python scripts/snapshot_ops.py compare /tmp/snap/tp2 /tmp/snap_new/tp2

``save DIR`` runs every case (fp32 and bf16; seeded inputs: T = 12 tokens as [4, 3], V = 50 real
columns of 52, H = 16; 250 of 256 for ``batch_invariant="tp"``; V = 49 in unequal
``vocab_start`` shards) and writes ``DIR/rank<r>.pt`` = ``{case: {entry: tensor | str}}``:
outputs ``out.*`` (NamedTuples, dicts, dataclasses flattened; Python scalars and None as
``repr``), gradients ``grad.*`` of every differentiable input after backward of a fixed weighted
sum of the differentiable outputs (or the case's own objective, e.g. forward-gradient mode's
``c * w``), and ``after.*`` (``main_grad``). A raising case records ``{"error": "Type: msg"}``.
Under torchrun each rank holds its vocabulary (and with ``sequence_parallel`` sequence) shard of
the same full tensors; the tp group (and the packing cases' cp group) is the world group.
Megatron's ``parallel_state`` is initialised with tp = world size (at tp = 1 on a one-process
gloo group, while the ops get ``tp_group=None``).

``compare DIR_A DIR_B`` checks every entry bitwise (dtype, shape, raw bits: NaN payloads and -0.0
count; strings by ``==``), prints one line per case (``-q``: only differing ones) and
``snapshot: N cases, M tensors, K differ`` (all rank files; M = entries; K = differing or missing
entries, cases, files); exit 1 if K > 0.

Covered: every callable of ``megatron_vocabstats.__all__`` (see TABLE and packing_cases:
the unfused and linear_* stats / logprobs / entropy / cross-entropy / sampling / top-k / gather
ops, distillation_loss, topk_divergence, nll/policy/sft losses, score_tokens, token_loss,
logprobs_step, make_forward_step with a toy model, correction_weights, mismatch_diagnostics, the
packing utilities, and the workspace functions: cache off, reset). Its classes are covered
through the calls that build or return them. Not covered: ``megatron_vocabstats.patch`` (not in
``__all__``; it patches Megatron's training loop), fp16, CUDA / graph capture, and error paths
beyond the cases that raise (``bi_tp_narrow`` at tp = 2).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace as NS
from typing import NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_vocabstats as mv  # noqa: E402

torch.set_num_threads(1)
S, B, H, WF, V = 4, 3, 16, 52, 50  # tokens [S, B]; the full width WF holds V real columns
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RANK, TP, GROUP, STORE = 0, 1, None, None  # set by setup()
RC = mv.RolloutCorrection


class R(NamedTuple):
    out: object
    leaves: dict | None = None  # name -> differentiable input
    loss: torch.Tensor | None = None  # objective (default: a weighted sum of the outputs)
    after: object = None  # callable -> state to record after backward


def setup():
    global RANK, TP, GROUP, STORE
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    else:
        STORE = tempfile.mkdtemp(prefix="snapshot_ops_")
        dist.init_process_group("gloo", init_method=f"file://{STORE}/store", rank=0, world_size=1)
    RANK, TP = dist.get_rank(), dist.get_world_size()
    GROUP = dist.group.WORLD if TP > 1 else None
    try:
        from megatron.core import parallel_state
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    except Exception as exc:  # noqa: BLE001 - only the default-group cases need it
        print(f"megatron parallel_state not initialised: {exc!r}", file=sys.stderr)


# ----------------------------------------------------------------------------- inputs

def rand(*shape, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def ints(high, *shape, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def rows(x):  # this rank's sequence shard (dim 0)
    n = x.shape[0] // TP
    return x[RANK * n:(RANK + 1) * n]


def leaf(x):
    return x.detach().clone().requires_grad_()


LOGITS, TEACHER = rand(S, B, WF, seed=1, scale=3.0), rand(S, B, WF, seed=9, scale=3.0)
HIDDEN, WEIGHT = rand(S, B, H, seed=2), rand(WF, H, seed=3, scale=0.6)
WIDE_LOGITS, WIDE_WEIGHT = rand(S, B, 256, seed=5, scale=3.0), rand(256, H, seed=6, scale=0.6)
TARGET = ints(V, S, B, seed=4)
TARGET[0, 1] = TARGET[2, 2] = -100
MASK = (torch.rand(S, B, generator=torch.Generator().manual_seed(8)) > 0.25).float()
IDX = ints(V, S, B, 4, seed=10)
IDX[1, 0, 3] = IDX[1, 0, 0]  # a duplicate id


def problem(dt, kind="pad"):
    """This rank's shards in ``dt``. kind: pad (V=50 of 52), nopad (no vocab_size: V=52), wide
    (250 of 256, shards of 128 at tp 2), uneven (V=49, shards of ceil(49/tp), vocab_start)."""
    logits, weight, vocab, target, idx = LOGITS, WEIGHT, V, TARGET, IDX
    if kind == "wide":
        logits, weight, vocab = WIDE_LOGITS, WIDE_WEIGHT, 250
    width = -(-49 // TP) if kind == "uneven" else logits.shape[-1] // TP
    lo, hi = RANK * width, (RANK + 1) * width
    kw = {} if kind == "nopad" else dict(vocab_size=vocab)
    if kind == "uneven":
        vocab, hi, target, idx = 49, min(49, hi), torch.where(TARGET >= 0, TARGET % 49, TARGET), IDX % 49
        kw = dict(vocab_size=vocab, vocab_start=lo)
    return NS(logits=logits.to(dt)[..., lo:hi], teacher=TEACHER.to(dt)[..., lo:hi],
              weight=weight.to(dt)[lo:hi], hidden=HIDDEN.to(dt), target=target, idx=idx, kw=kw, V=vocab)


def tokens(dt):
    """Per-token loss inputs ``[S, B]`` in ``dt``, the same on every rank."""
    lp = -rand(S, B, seed=20).abs() * 2
    old = lp + rand(S, B, seed=21, scale=0.1)
    return NS(lp=lp.to(dt), old=old.to(dt), adv=rand(S, B, seed=22).to(dt),
              ent=(rand(S, B, seed=23).abs() * 3).to(dt), ref=(lp + rand(S, B, seed=24, scale=0.2)).to(dt),
              roll=(old + rand(S, B, seed=25, scale=0.3)).to(dt), outside=rand(S, B, seed=26) > 1.0)


# ----------------------------------------------------------------------------- case runners

def op_case(fn, dt, kind="pad", args=lambda p: (p.target,), **kw):
    """An unfused op on this rank's logits shard, differentiated w.r.t. it."""
    p = problem(dt, kind)
    x = leaf(p.logits)
    kw.setdefault("tp_group", GROUP)
    return R(fn(x, *args(p), **p.kw, **kw), {"logits": x})


def linear_case(fn, dt, kind="pad", args=lambda p: (p.target,), sp=False, main_grad=False,
                objective=None, **kw):
    """A fused op on (hidden, or its sequence shard with ``sp``; this rank's weight shard)."""
    p = problem(dt, kind)
    h, w = leaf(rows(p.hidden) if sp else p.hidden), leaf(p.weight)
    if sp:
        kw["sequence_parallel"] = True
    if main_grad:  # Megatron's gradient-accumulation fusion; main_grad already holds a sum
        w.main_grad = rand(*w.shape, seed=7, scale=0.01).float()
        w.grad_added_to_main_grad, w.zero_out_wgrad = False, True
        kw["accumulate_into_main_grad"] = True
    out = fn(h, w, *args(p), tp_group=GROUP, **p.kw, **kw)
    after = (lambda: {"main_grad": w.main_grad, "added": w.grad_added_to_main_grad}) if main_grad else None
    return R(out, {"hidden": h, "weight": w}, objective(out) if objective else None, after)


def token_case(fn, dt, entropy=True, **kw):
    """A per-token loss; ``"@name"`` values are taken from :func:`tokens`."""
    t = tokens(dt)
    lp, ent = leaf(t.lp), leaf(t.ent)
    kw = {k: getattr(t, v[1:]) if isinstance(v, str) and v[:1] == "@" else v for k, v in kw.items()}
    pos = (t.old, t.adv) if fn is mv.policy_loss else ()
    leaves = {"logprobs": lp, **({"entropy": ent} if entropy else {})}
    return R(fn(lp, *pos, MASK, **({"entropy": ent} if entropy else {}), **kw), leaves)


def divergence_case(dt, teacher_inf=False, **kw):
    s, t = (torch.log_softmax(rand(S, B, V, seed=sd, scale=2.0), -1)[..., :4].to(dt) for sd in (30, 31))
    if teacher_inf:
        t[0, 0, 3] = -math.inf
    s = leaf(s)
    return R(mv.topk_divergence(s, t, MASK, **kw), {"student": s})


def distill_case(dt, fused=False, **kw):
    p = problem(dt)
    teacher = mv.vocab_parallel_topk(p.teacher, 4, tp_group=GROUP, vocab_size=V,
                                     temperature=kw.get("temperature", 1.0))
    h, w, x = leaf(p.hidden), leaf(p.weight), leaf(p.logits)
    student = functools.partial(mv.linear_vocab_parallel_topk_logprobs, h, w) if fused else x
    leaves = {"hidden": h, "weight": w} if fused else {"logits": x}
    return R(mv.distillation_loss(student, teacher, MASK, tp_group=GROUP, vocab_size=V, **kw), leaves)


def token_loss_case(dt, source="logits", loss_fn=mv.nll_loss, opts=(), **kw):
    p = problem(dt)
    opts = mv.StatsOptions(vocab_size=V, **dict(opts))
    h, w, x = leaf(p.hidden), leaf(p.weight), leaf(p.logits)
    leaves, out = {"logits": x}, x
    if source == "callable":
        leaves, out = {"hidden": h, "weight": w}, functools.partial(mv.linear_vocab_parallel_stats, h, w)
    elif source == "stats":
        out = mv.vocab_parallel_stats(x, torch.where(MASK > 0, p.target, -100), tp_group=GROUP,
                                      vocab_size=V, entropy=opts.entropy)
    if loss_fn is mv.policy_loss:
        t = tokens(torch.float32)
        loss_fn = functools.partial(mv.policy_loss, kl_coef=0.05, entropy_coef=0.01)
        kw["loss_inputs"] = dict(old_logprobs=t.old, advantages=t.adv, ref_logprobs=t.ref)
    return R(mv.token_loss(out, p.target, MASK, loss_fn=loss_fn, tp_group=GROUP, options=opts, **kw), leaves)


def step_case(fn, dt, **kw):  # sft_loss, logprobs_step (the latter under no_grad, as documented)
    x = leaf(problem(dt).logits)
    with torch.no_grad() if fn is mv.logprobs_step else torch.enable_grad():
        return R(fn(x, TARGET, MASK, tp_group=GROUP, vocab_size=V, **kw), {"logits": x})


class ToyModel(torch.nn.Module):  # hidden [b, s, H] -> this rank's logits [b, s, W]
    def __init__(self, weight):
        super().__init__()
        self.weight, self.tp_group = torch.nn.Parameter(weight.clone()), GROUP

    def forward(self, hidden):
        return hidden @ self.weight.t()


def forward_step_case(dt, policy=False):
    p, t = problem(dt), tokens(torch.float32)
    model, h = ToyModel(p.weight), leaf(p.hidden)
    inputs = dict(old_logprobs=t.old, advantages=t.adv) if policy else None
    batch_fn = lambda it: mv.StepBatch({"hidden": next(it)}, p.target, MASK, inputs)  # noqa: E731
    loss_fn = functools.partial(mv.policy_loss, entropy_coef=0.01) if policy else mv.nll_loss
    stats = mv.StatsOptions(vocab_size=V, entropy="grad" if policy else "metric")
    output, loss = mv.make_forward_step(batch_fn, loss_fn, stats=stats)(iter([h]), model)
    return R(loss(output), {"hidden": h, "weight": model.weight})


def workspace_case(dt):
    mv.configure_workspace(max_buffers=0)
    try:
        r = op_case(mv.vocab_parallel_stats, dt, chunk_size=5)
    finally:
        mv.configure_workspace(max_buffers=8, max_bytes=2 * 1024**3)  # the documented defaults
    mv.with_workspace_reset(lambda: None)()
    mv.reset_workspace()
    return r


def diagnostics_case(dt, corrected=False):
    t = tokens(dt)
    if not corrected:
        return R(mv.mismatch_diagnostics(t.old, t.roll, MASK))
    w, f = mv.correction_weights(t.old, t.roll, MASK, RC(mode="mis"))
    return R(mv.mismatch_diagnostics(t.old, t.roll, MASK, w, f, flag_name="masked", outside=t.outside))


def walk(x, name):
    """(name, leaf) pairs of a result: tensors, Python scalars, None, other objects."""
    if isinstance(x, torch.Tensor) or x is None or isinstance(x, (bool, int, float, str)):
        yield name, x
    elif isinstance(x, tuple) and hasattr(x, "_fields") or hasattr(x, "__dataclass_fields__"):
        for f in getattr(x, "_fields", None) or x.__dataclass_fields__:
            yield from walk(getattr(x, f), f"{name}.{f}")
    elif isinstance(x, (list, tuple, dict)):
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
            yield from walk(v, f"{name}.{k}")
    else:
        yield name, f"<{type(x).__name__}>"  # e.g. a process group: its presence only


def snap(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else repr(v)


def weighted_sum(items):
    diff = [t for _, t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    terms = [(t.float() * (torch.rand(t.shape, generator=torch.Generator().manual_seed(100 + i)) + 0.5)).sum()
             for i, t in enumerate(diff)]
    return sum(terms[1:], terms[0]) if terms else None


def run_case(fn) -> dict:
    torch.manual_seed(0)
    try:
        r = fn()
        items = list(walk(r.out, "out"))
        rec = {k: snap(v) for k, v in items}
        if r.leaves:
            loss = r.loss if r.loss is not None else weighted_sum(items)
            if loss is not None and loss.requires_grad:
                loss.backward()
            rec.update({f"grad.{k}": snap(v.grad) for k, v in r.leaves.items()})
        if r.after is not None:
            rec.update({k: snap(v) for k, v in walk(r.after(), "after")})
        return rec
    except Exception as exc:  # noqa: BLE001 - recorded and compared like any output
        return {"error": f"{type(exc).__name__}: {exc}"}


# ----------------------------------------------------------------------------- the cases

NO_TARGET, IGNORE3 = (lambda p: (None,)), (lambda p: (torch.where(p.target < 0, 3, p.target),))
K5, IDS = (lambda p: (5,)), (lambda p: (p.idx,))
GW, CW = (lambda out: (out.logprobs * MASK).sum() * -0.37), (lambda out: (out * MASK).sum() * 0.5)
STATS = {  # shared by vocab_parallel_stats and linear_vocab_parallel_stats
    "base": {}, "nopad": dict(kind="nopad"), "ent_off": dict(entropy="off"),
    "ent_metric": dict(entropy="metric"), "temp0.7": dict(temperature=0.7),
    "smooth0.1": dict(label_smoothing=0.1), "chunk5": dict(chunk_size=5),
    "ignore3": dict(ignore_index=3, args=IGNORE3), "notarget": dict(args=NO_TARGET),
    "novalidate": dict(validate=False), "bi": dict(batch_invariant=True),
    "mix": dict(temperature=1.3, label_smoothing=0.05, chunk_size=3, batch_invariant=True),
    "bi_tp": dict(kind="wide", batch_invariant="tp"),
    "bi_tp_smooth": dict(kind="wide", batch_invariant="tp", label_smoothing=0.1, chunk_size=4),
    "bi_tp_narrow": dict(batch_invariant="tp"),  # tp 2: shard width 26, raises
    "uneven": dict(kind="uneven"), "uneven_smooth": dict(kind="uneven", label_smoothing=0.1, temperature=0.9),
}
SAMPLING = {
    "plain": {}, "temp0.8": dict(temperature=0.8), "top_k5": dict(top_k=5), "top_p0.9": dict(top_p=0.9),
    "min_p0.05": dict(min_p=0.05), "top_k60": dict(top_k=60), "top_p1": dict(top_p=1.0),
    "all": dict(temperature=1.2, top_k=10, top_p=0.8, min_p=0.02),
    "all_chunk5": dict(top_k=8, top_p=0.7, chunk_size=5), "novalidate": dict(top_p=0.9, validate=False),
    "uneven_all": dict(kind="uneven", top_k=10, top_p=0.8), "nopad_top_k5": dict(kind="nopad", top_k=5),
    "ignore3": dict(ignore_index=3, args=IGNORE3, top_p=0.9),
}
ROLL = dict(rollout_logprobs="@roll")
DIVERGENCES = {"forward_kl": {}, "reverse_kl": dict(divergence="reverse_kl"), "jsd": dict(divergence="jsd"),
               "jsd_beta0.2": dict(divergence="jsd", beta=0.2), "tail": dict(tail_bucket=True),
               "rkl_tail": dict(divergence="reverse_kl", tail_bucket=True),
               "jsd_renorm": dict(divergence="jsd", renormalize=True)}
TABLE = [  # (name, runner, leading args, {variant: kwargs}); every entry runs in fp32 and bf16
    ("vocab_parallel_stats", op_case, (mv.vocab_parallel_stats,), STATS),
    ("linear_vocab_parallel_stats", linear_case, (mv.linear_vocab_parallel_stats,), {
        **STATS, "sp": dict(sp=True, temperature=0.9), "sp_notarget": dict(sp=True, args=NO_TARGET),
        "grad_weights": dict(entropy="metric", grad_weights=MASK, objective=GW, label_smoothing=0.05),
        "grad_weights_sp": dict(sp=True, entropy="off", grad_weights=MASK, objective=GW),
        "main_grad": dict(main_grad=True, chunk_size=5),
        "main_grad_gw_sp": dict(main_grad=True, sp=True, entropy="off", grad_weights=MASK, objective=GW)}),
    ("linear_vocab_parallel_cross_entropy", linear_case, (mv.linear_vocab_parallel_cross_entropy,), {
        "base": {}, "smooth": dict(label_smoothing=0.1), "chunk3": dict(chunk_size=3), "sp": dict(sp=True),
        "bi": dict(batch_invariant=True), "main_grad": dict(main_grad=True), "uneven": dict(kind="uneven"),
        "loss_weights": dict(loss_weights=MASK, objective=CW),
        "loss_weights_sp_main": dict(loss_weights=MASK, objective=CW, sp=True, main_grad=True)}),
    ("vocab_parallel_logprobs", op_case, (mv.vocab_parallel_logprobs,), {
        "base": {}, "temp_chunk": dict(temperature=0.8, chunk_size=5), "bi": dict(batch_invariant=True),
        "uneven": dict(kind="uneven"), "bi_tp": dict(kind="wide", batch_invariant="tp"), "ignore3": STATS["ignore3"]}),
    ("vocab_parallel_entropy", functools.partial(op_case, args=lambda p: ()), (mv.vocab_parallel_entropy,), {
        "base": {}, "metric": dict(differentiable=False), "temp1.5": dict(temperature=1.5),
        "bi": dict(batch_invariant=True, chunk_size=5), "uneven": dict(kind="uneven"),
        "bi_tp": dict(kind="wide", batch_invariant="tp")}),
    ("vocab_parallel_cross_entropy", op_case, (mv.vocab_parallel_cross_entropy,), {
        "base": {}, "smooth0.1": dict(label_smoothing=0.1), "chunk5": dict(chunk_size=5),
        "ignore3": STATS["ignore3"], "bi": dict(batch_invariant=True),
        "uneven_smooth": dict(kind="uneven", label_smoothing=0.2), "megatron_default_group": dict(tp_group=None)}),
    ("vocab_parallel_sampling_logprobs", op_case, (mv.vocab_parallel_sampling_logprobs,), SAMPLING),
    ("linear_vocab_parallel_sampling_logprobs", linear_case, (mv.linear_vocab_parallel_sampling_logprobs,), {
        "plain": {}, "all": SAMPLING["all"], "sp_all": dict(SAMPLING["all"], sp=True),
        "main_grad_top_p": dict(top_p=0.85, main_grad=True, chunk_size=5),
        "uneven_top_k5": dict(kind="uneven", top_k=5)}),
    ("vocab_parallel_topk", op_case, (mv.vocab_parallel_topk,), {
        "k5": dict(args=K5), "k1": dict(args=lambda p: (1,)), "kV": dict(args=lambda p: (p.V,)),
        "temp_chunk": dict(args=K5, temperature=0.6, chunk_size=5), "uneven": dict(args=K5, kind="uneven"),
        "nopad": dict(args=K5, kind="nopad")}),
    ("vocab_parallel_topk_logits", op_case, (mv.vocab_parallel_topk_logits,), {
        "k5": dict(args=K5), "chunk5": dict(args=K5, chunk_size=5), "uneven": dict(args=K5, kind="uneven")}),
    ("vocab_parallel_topk_logprobs", functools.partial(op_case, args=IDS), (mv.vocab_parallel_topk_logprobs,), {
        "base": {}, "mask": dict(mask=MASK), "temp_chunk": dict(temperature=1.4, chunk_size=5),
        "uneven_mask": dict(kind="uneven", mask=MASK.bool()), "novalidate": dict(validate=False)}),
    ("vocab_parallel_gather_logits", functools.partial(op_case, args=IDS), (mv.vocab_parallel_gather_logits,), {
        "base": {}, "mask": dict(mask=MASK), "uneven": dict(kind="uneven")}),
    ("linear_vocab_parallel_topk", functools.partial(linear_case, args=K5), (mv.linear_vocab_parallel_topk,), {
        "k5": {}, "sp_temp": dict(sp=True, temperature=0.7), "chunk5": dict(chunk_size=5),
        "uneven": dict(kind="uneven")}),
    ("linear_vocab_parallel_topk_logprobs", functools.partial(linear_case, args=IDS),
     (mv.linear_vocab_parallel_topk_logprobs,), {
        "base": {}, "mask_temp": dict(mask=MASK, temperature=0.8), "sp": dict(sp=True),
        "main_grad_chunk": dict(main_grad=True, chunk_size=5), "uneven": dict(kind="uneven")}),
    ("topk_divergence", divergence_case, (), {**DIVERGENCES, "teacher_inf_tail": dict(teacher_inf=True, tail_bucket=True)}),
    ("distillation_loss", distill_case, (), {
        **DIVERGENCES, "temp2_scaled": dict(temperature=2.0, temperature_scale=True), "validate": dict(validate=True),
        "chunk3_teacher_vocab": dict(chunk_size=3, teacher_vocab_size=V), "fused": dict(fused=True),
        "fused_jsd_tail": dict(fused=True, divergence="jsd", tail_bucket=True)}),
    ("policy_loss", token_case, (mv.policy_loss,), {
        "base": {}, "clip_high_dual": dict(clip_eps=0.1, clip_eps_high=0.3, dual_clip=3.0, ref_logprobs="@ref"),
        "kl_k1": dict(kl_coef=0.05, kl_estimator="k1", ref_logprobs="@ref"),
        "kl_k3": dict(kl_coef=0.05, ref_logprobs="@ref"), "entropy_bonus": dict(entropy_coef=0.01),
        "seq_mean": dict(aggregation="sequence-mean", kl_coef=0.02, entropy_coef=0.01, ref_logprobs="@ref"),
        "rollout_diag": ROLL, "outside": dict(rollout_outside="@outside"),
        "tis": dict(ROLL, rollout_correction=RC(mode="tis")),
        "tis_seq": dict(ROLL, rollout_correction=RC(mode="tis", level="sequence", threshold=1.5)),
        "mis": dict(ROLL, rollout_correction=RC(mode="mis"), rollout_outside="@outside"),
        "mis_seq": dict(ROLL, rollout_correction=RC(mode="mis", level="sequence")),
        "icepop": dict(ROLL, rollout_correction=RC(mode="icepop", low=0.8, high=1.3))}),
    ("nll_loss", token_case, (mv.nll_loss,), {"plain": dict(entropy=False), "entropy": {}}),
    ("score_tokens", token_case, (mv.score_tokens,), {"plain": dict(entropy=False),
                                                       "entropy_non_loss": dict(non_loss_data=True)}),
    ("token_loss", token_loss_case, (), {
        "logits": {}, "stats": dict(source="stats", opts=dict(entropy="metric")),
        "callable": dict(source="callable", opts=dict(entropy="grad", chunk_size=5)),
        "policy_validate": dict(loss_fn=mv.policy_loss, opts=dict(entropy="grad", validate=True, temperature=0.9)),
        "score_non_loss": dict(loss_fn=mv.score_tokens, non_loss_data=True, opts=dict(entropy="metric")),
        "bi_smooth": dict(opts=dict(batch_invariant=True, label_smoothing=0.1))}),
    ("sft_loss", step_case, (mv.sft_loss,), {
        "base": {}, "smooth_temp": dict(label_smoothing=0.1, temperature=0.8),
        "entropy_grad_chunk": dict(entropy="grad", chunk_size=4), "bi_validate": dict(batch_invariant=True, validate=True)}),
    ("logprobs_step", step_case, (mv.logprobs_step,), {
        "entropy": {}, "no_entropy_temp": dict(entropy=False, temperature=0.7),
        "non_loss_bi": dict(non_loss_data=True, batch_invariant=True)}),
    ("make_forward_step", forward_step_case, (), {"nll": {}, "policy": dict(policy=True)}),
    ("workspace", workspace_case, (), {"cache_off_reset": {}}),
    ("correction_weights", lambda dt, cfg: R(mv.correction_weights(tokens(dt).old, tokens(dt).roll, MASK, cfg)), (), {
        "tis": dict(cfg=RC()), "tis_seq": dict(cfg=RC(level="sequence", threshold=1.2)), "mis": dict(cfg=RC(mode="mis")),
        "mis_seq": dict(cfg=RC(mode="mis", level="sequence", low=0.7, high=1.5)), "icepop": dict(cfg=RC(mode="icepop"))}),
    ("mismatch_diagnostics", diagnostics_case, (), {"plain": {}, "weights_flags_outside": dict(corrected=True)}),
]
SEQS = [torch.arange(1, 6), torch.arange(10, 13), torch.arange(20, 27)]  # lengths 5, 3, 7


def packing_cases(add):
    b = mv.pack_sequences(SEQS, alignment=4)  # T = 20; padded lengths multiples of 2 * cp
    cu, cu_p, T = b.cu_seqlens, b.cu_seqlens_padded, b.tokens.shape[-1]
    padded = torch.nn.utils.rnn.pad_sequence(SEQS, batch_first=True)
    add("sequence_alignment", lambda: R([mv.sequence_alignment(*a) for a in
                                         ((1, 1, False, 1), (2, 4, True, 1), (2, 2, False, 16), (3, 2, True, 32))]))
    add("pack_sequences/list", lambda: R(mv.pack_sequences(SEQS)))
    add("pack_sequences/align4_total24", lambda: R(mv.pack_sequences(
        SEQS, alignment=4, total_length=24, pad_token_id=99, ignore_index=-1)))
    add("pack_sequences/padded_tensor", lambda: R(mv.pack_sequences(padded, torch.tensor([5, 3, 7]), alignment=2)))
    add("pack_sequences/padded_ints_noparams", lambda: R(mv.pack_sequences(padded, [5, 3, 7], seq_params=False)))
    add("shift_packed_labels/padded", lambda: R(mv.shift_packed_labels(b.tokens, cu, cu_seqlens_padded=cu_p)))
    add("shift_packed_labels/unpadded", lambda: R(mv.shift_packed_labels(
        torch.cat(SEQS), torch.tensor([0, 5, 8, 15], dtype=torch.int32), ignore_index=-7)))
    add("make_packed_seq_params", lambda: R(mv.make_packed_seq_params(cu, cu_p, 8)))
    add("make_packed_seq_params/no_pad_between", lambda: R(mv.make_packed_seq_params(
        cu, cu_p, 8, pad_between_seqs=False)))
    for r in (0, 1):
        add(f"context_parallel_indices/cp2_rank{r}", lambda r=r: R(mv.context_parallel_indices(
            cu_p, T, cp_size=2, cp_rank=r)))
    add("context_parallel_indices/none_cp3", lambda: R(mv.context_parallel_indices(None, 12, cp_size=3, cp_rank=1)))
    add("shard_for_context_parallel/batch", lambda: R(mv.shard_for_context_parallel(b, GROUP)))
    add("shard_for_context_parallel/tensor_dim0", lambda: R(mv.shard_for_context_parallel(
        rand(T, 3, seed=40), GROUP, cu_seqlens_padded=cu_p, dim=0)))
    add("shard_for_context_parallel/bs", lambda: R(mv.shard_for_context_parallel(rand(2, 8, seed=41), GROUP)))
    for dn, dt in DTYPES.items():
        def gather(dt=dt):
            x = leaf(mv.shard_for_context_parallel(rand(1, T, seed=42).to(dt), GROUP, cu_seqlens_padded=cu_p))
            return R(mv.gather_from_context_parallel(x, GROUP, cu_seqlens_padded=cu_p), {"x": x})

        def unpack(dt=dt, dim=-1):
            x = leaf(rand(1, T, seed=43).to(dt) if dim == -1 else rand(T, 2, seed=44).to(dt))
            return R(mv.unpack_sequences(x, cu, max_seqlen=8, cu_seqlens_padded=cu_p, dim=dim,
                                         padding_value=-1.5), {"x": x})
        add(f"gather_from_context_parallel/{dn}", gather)
        add(f"unpack_sequences/{dn}", unpack)
        add(f"unpack_sequences/{dn}/dim0", functools.partial(unpack, dim=0))


def build_cases() -> dict:
    cases = {}

    def add(name, fn):
        assert name not in cases, name
        cases[name] = fn
    packing_cases(add)
    for dn, dt in DTYPES.items():
        for name, runner, lead, variants in TABLE:
            for v, kw in variants.items():
                add(f"{name}/{dn}/{v}", functools.partial(runner, *lead, dt, **kw))
    return cases


# ----------------------------------------------------------------------------- save / compare

def save(out_dir):
    setup()
    cases, start = build_cases(), time.perf_counter()
    results = {}
    for name, fn in cases.items():
        results[name] = run_case(fn)
        if TP > 1:
            dist.barrier()
    results["__meta__"] = {"world_size": TP, "rank": RANK, "torch": str(torch.__version__)}
    os.makedirs(out_dir, exist_ok=True)
    torch.save(results, os.path.join(out_dir, f"rank{RANK}.pt"))
    if RANK == 0:
        errors = {k: v["error"] for k, v in results.items() if "error" in v}
        for k, v in errors.items():
            print(f"  recorded error: {k}: {v[:150]}")
        entries = sum(len(v) for k, v in results.items() if k != "__meta__")
        print(f"saved {len(cases)} cases ({entries} entries, {len(errors)} recorded errors) per rank, "
              f"{TP} rank(s), to {out_dir} in {time.perf_counter() - start:.1f} s")
    dist.destroy_process_group()
    if STORE:
        shutil.rmtree(STORE, ignore_errors=True)


def bits(t):  # the raw bits of a float (complex: its real view) as an int tensor
    t = torch.view_as_real(t) if t.is_complex() else t
    if t.is_floating_point():
        t = t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def same(a, b):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    return type(a) is type(b) and a == b


def compare(dir_a, dir_b, quiet=False) -> int:
    files = sorted(f for f in set(os.listdir(dir_a)) | set(os.listdir(dir_b))
                   if f.startswith("rank") and f.endswith(".pt"))
    n_cases = n_entries = n_diff = n_added = 0
    for f in files:
        paths = [os.path.join(d, f) for d in (dir_a, dir_b)]
        if not all(map(os.path.exists, paths)):
            print(f"MISSING file {f} in {dir_b if os.path.exists(paths[0]) else dir_a}")
            n_diff += 1
            continue
        a, b = (torch.load(p, weights_only=True) for p in paths)
        for case in (c for c in dict.fromkeys([*a, *b]) if c != "__meta__"):
            n_cases += 1
            if case not in a or case not in b:
                print(f"MISSING {f}:{case} (only in {dir_a if case in a else dir_b})")
                n_diff += 1
                continue
            # A result field that B added and leaves None (an optional output not asked for)
            # is not a difference in value.
            added = [k for k in b[case] if k not in a[case] and b[case][k] == "None"]
            n_added += len(added)
            keys = [k for k in dict.fromkeys([*a[case], *b[case]]) if k not in added]
            bad = [k for k in keys if k not in a[case] or k not in b[case] or not same(a[case][k], b[case][k])]
            n_entries, n_diff = n_entries + len(keys), n_diff + len(bad)
            if bad or not quiet:
                print(f"{'DIFF' if bad else 'ok  '} {f}:{case} ({len(keys)} entries)"
                      + (f": {', '.join(bad)}" if bad else ""))
    print(f"snapshot: {n_cases} cases, {n_entries} tensors, {n_diff} differ"
          + (f" ({n_added} added result fields, None in {dir_b})" if n_added else ""))
    return 1 if n_diff or not files else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sub.add_parser("save").add_argument("dir")
    cmp = sub.add_parser("compare")
    cmp.add_argument("dir_a")
    cmp.add_argument("dir_b")
    cmp.add_argument("-q", "--quiet", action="store_true", help="print only the differing cases")
    args = parser.parse_args()
    if args.mode == "save":
        save(args.dir)
    else:
        sys.exit(compare(args.dir_a, args.dir_b, args.quiet))


if __name__ == "__main__":
    main()
