"""The profiler (``python -m examples.gsm8k.profile``) on 2 gloo ranks, tp = 2.

Run by tests/unit/test_profile.py. A tiny SFT run profiles step 2 on both ranks (memory and
kernel trials); its summaries are checked against the raw files they come from, and the
``summarize`` command must rewrite them byte for byte. Bad selections must stop every rank with
exit status 2 before any model is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # repo root
from _harness import Cases, Skip, main  # noqa: E402

CASES = Cases()
EXAMPLE = ["sft", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "384", "--seed", "11", "--steps", "2", "--train-examples", "8",
           "--test-examples", "2", "--vocab-parallel-stats", "--lm-head-chunk-size", "64"]
SUMMARIES = ("summary.json", "summary.md")


def shared_dir() -> str:
    path = [tempfile.mkdtemp(prefix="profile_case_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def profile(argv) -> tuple[int, str]:
    """``main(argv)`` on every rank; the common exit status and rank 0's stderr."""
    from examples.gsm8k.profile import main as profile_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = profile_main(argv)
    codes = [None] * dist.get_world_size()
    dist.all_gather_object(codes, code)
    assert len(set(codes)) == 1, f"ranks returned different exit codes {codes}"
    return code, err.getvalue()


def load(path):
    with open(path) as f:
        return json.load(f)


def digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_memory_trial(d: str) -> None:
    raw, s = load(os.path.join(d, "memory.raw.json")), load(os.path.join(d, "summary.json"))
    total = raw["timeline"]["total"]
    assert s["peak_bytes"] == max(total) > 0, (s["peak_bytes"], max(total))
    # MemTracker's own peak is the timeline's maximum (sampled where it updates its peak).
    assert s["instrument_peak_bytes"] == s["peak_bytes"] == raw["reported_peak"]
    # Total = sum of kinds at every sample; the kinds at the peak add up to no more than it.
    for i, t in enumerate(total):
        assert t == sum(raw["timeline"]["by_kind"][k][i] for k in raw["kinds"]), i
    assert sum(r["bytes"] for r in s["at_peak_by_kind"]) <= s["peak_bytes"]
    assert all(r["bytes"] >= 0 for r in s["at_peak_by_kind"])
    assert max(s["phase_peak_bytes"].values()) == s["peak_bytes"]
    # From step 2 on, AdamW holds two fp32 moments per parameter plus a 4-byte step counter
    # per parameter tensor.
    kinds = {r["kind"]: r["bytes"] for r in s["at_peak_by_kind"]}
    extra = kinds["optimizer state"] - 2 * kinds["parameters"]
    assert kinds["parameters"] > 0 and 0 < extra < 4096 and extra % 4 == 0, kinds
    # Per-module numbers are MemTracker's: no module peaks above the step's peak, and the model
    # (root module) holds the peak when the peak is inside its forward or backward.
    modules = {m["name"]: m for m in s["modules"]}
    assert s["modules"] == raw["modules"] and "GPTModel" in modules, list(modules)[:5]
    assert all(max(m["peak_forward"], m["peak_backward"]) <= s["peak_bytes"]
               for m in s["modules"])
    root = modules["GPTModel"]
    if s["peak_at"]["phase"] in ("forward", "backward"):
        assert max(root["peak_forward"], root["peak_backward"]) == s["peak_bytes"], root
    assert os.path.getsize(os.path.join(d, "timeline.png")) > 0
    md = open(os.path.join(d, "summary.md")).read()
    assert f"({s['peak_bytes']} bytes)" in md and "GPTModel.decoder" in md


def check_kernel_trial(d: str) -> None:
    trace = load(os.path.join(d, "trace.json"))
    device, host = (load(os.path.join(d, f)) for f in ("trace.device.json", "trace.host.json"))
    events = [e for e in trace["traceEvents"] if e.get("ph") != "M" and e.get("cat") != "ac2g"]
    views = [e for v in (device, host) for e in v["traceEvents"] if e.get("ph") != "M"]
    assert len(views) == len(events) > 0
    assert sorted(json.dumps(e, sort_keys=True) for e in views) == \
        sorted(json.dumps(e, sort_keys=True) for e in events)
    s = load(os.path.join(d, "summary.json"))
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    assert s["host"]["operators"] == len(ops) > 0
    names = {e["name"] for e in ops}
    assert any("aten::mm" in n for n in names), sorted(names)[:20]
    assert any("LinearVocabParallelStats" in n for n in names), "the fused LM head is missing"
    marker = [e for e in trace["traceEvents"] if e.get("name") == f"vocabstats profile step "
              f"{s['step']}"]
    assert marker, "the step marker is missing"


@CASES.register
def tiny_profile_writes_consistent_summaries(group):
    out = shared_dir()
    code, err = profile(["run", "--out", out, "--ranks", "", "--profile-steps", "2", "--",
                         *EXAMPLE])
    assert code == 0, err
    dist.barrier()
    if dist.get_rank() != 0:
        return
    trials = sorted(d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d)))
    assert trials == ["kernels-step2-rank0", "kernels-step2-rank1", "memory-step2-rank0",
                      "memory-step2-rank1"], trials
    settings = load(os.path.join(out, "settings.json"))
    assert settings["plan"]["ranks"] == [0, 1] and settings["plan"]["steps"] == [2]
    assert "memory trial: done" in open(os.path.join(out, "settings.log")).read()
    for t in trials:
        d = os.path.join(out, t)
        assert load(os.path.join(d, "trial.json"))["rank"] == int(t[-1])
        (check_memory_trial if t.startswith("memory") else check_kernel_trial)(d)
    before = {(t, f): digest(os.path.join(out, t, f)) for t in trials for f in SUMMARIES}
    for t in trials:
        for f in SUMMARIES + ("timeline.png", "trace.device.json", "trace.host.json"):
            if os.path.exists(os.path.join(out, t, f)):
                os.remove(os.path.join(out, t, f))
    from examples.gsm8k.profile import main as profile_main

    assert profile_main(["summarize", out]) == 0
    after = {(t, f): digest(os.path.join(out, t, f)) for t in trials for f in SUMMARIES}
    assert after == before
    for t in trials:
        names = ("timeline.png",) if t.startswith("memory") else ("trace.device.json",
                                                                   "trace.host.json")
        assert all(os.path.isfile(os.path.join(out, t, n)) for n in names), t
    shutil.rmtree(out)


@CASES.register
def rerun_into_the_same_out_is_refused_or_replaced(group):
    """A second run into an --out that holds a profile would mix its trials with the old ones
    (and index both): it is refused before training, or replaced with --overwrite."""
    out = shared_dir()
    first = ["run", "--out", out, "--trials", "kernels", "--ranks", "1"]
    with slow_checks_on_rank1():  # rank 0 must not write into --out before rank 1 checked it
        assert profile([*first, "--", *EXAMPLE])[0] == 0
    dist.barrier()
    unrelated = os.path.join(out, "notes.txt")
    if dist.get_rank() == 0:
        with open(unrelated, "w") as f:
            f.write("not the profiler's")
    dist.barrier()
    with count_training() as calls:
        code, err = profile(["run", "--out", out, "--trials", "kernels", "--ranks", "0", "--",
                             *EXAMPLE])
    assert code == 2 and calls == [], (code, calls)
    if dist.get_rank() == 0:
        assert "already holds a profile" in err and "--overwrite" in err, err
    assert os.path.isdir(os.path.join(out, "kernels-step2-rank1"))
    code, err = profile(["run", "--out", out, "--overwrite", "--trials", "kernels", "--ranks",
                         "0", "--", *EXAMPLE])
    assert code == 0, err
    dist.barrier()
    if dist.get_rank() == 0:
        assert sorted(os.listdir(out)) == ["index.md", "kernels-step2-rank0", "notes.txt",
                                           "settings.json", "settings.log"], os.listdir(out)
        index = open(os.path.join(out, "index.md")).read()
        assert "kernels-step2-rank0" in index and "rank1" not in index, index
        assert load(os.path.join(out, "settings.json"))["plan"]["ranks"] == [0]
        assert open(os.path.join(out, "settings.log")).read().count("trial: done") == 1
        shutil.rmtree(out)


@contextlib.contextmanager
def slow_checks_on_rank1(delay_s: float = 5.0):
    """Rank 1 starts its checks of the request ``delay_s`` late (the process group and Megatron's
    parallel state already exist, as after the first case, so nothing else holds rank 0 back)."""
    from examples.gsm8k import profile as profile_module

    saved = profile_module.plan

    def plan(*args, **kwargs):
        if dist.get_rank() == 1:
            time.sleep(delay_s)
        return saved(*args, **kwargs)

    profile_module.plan = plan
    try:
        yield
    finally:
        profile_module.plan = saved


@contextlib.contextmanager
def count_training():
    """Count calls of the example's model builder and training loop inside the block."""
    from examples.gsm8k import model, sft

    calls = []
    saved = (model.build_model, sft.train)

    def spy(name, fn):
        def wrapper(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapper

    model.build_model, sft.train = spy("build_model", saved[0]), spy("train", saved[1])
    try:
        yield calls
    finally:
        model.build_model, sft.train = saved


def refused(out, flags, *needles) -> None:
    """The run stops on every rank with status 2 and an error naming the flag; no model is
    built, no step runs, and ``out`` is not created as a directory."""
    with count_training() as calls:
        code, err = profile(["run", "--out", out, *flags, "--", *EXAMPLE])
    assert code == 2, (flags, code)
    assert calls == [], calls
    if dist.get_rank() == 0:
        assert err.startswith("error: ") and all(n in err for n in needles), err
    assert not os.path.isdir(out), flags  # not even the output directory


def root_writes_anyway(locked: str) -> bool:
    """Whether this user writes into the 0500 directory ``locked`` (root does), on any rank."""
    try:
        with open(os.path.join(locked, f"probe{dist.get_rank()}"), "w"):
            ok = True
    except OSError:
        ok = False
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, ok)
    return any(seen)


@CASES.register
def bad_selection_stops_every_rank_before_training(group):
    base = shared_dir()
    out = os.path.join(base, "out")
    refused(out, ["--ranks", "0,3-4"], "--ranks", "rank(s) 3-4", "2 rank(s)")
    refused(out, ["--ranks", "1-x"], "--ranks", "'1-x'")
    refused(out, ["--ranks", "0-99999999999"], "--ranks", "2-99999999999")  # not expanded
    refused(out, ["--profile-steps", "3"], "--profile-steps", "step(s) 3", "--steps 2")
    refused(out, ["--profile-steps", ""], "--profile-steps ''")
    refused(out, ["--trials", "memory,flops"], "--trials")
    # matplotlib (the timeline PNG) is checked before training, not when the first trial ends.
    saved = sys.modules.get("matplotlib")
    sys.modules["matplotlib"] = None
    try:
        refused(out, [], "matplotlib")
        refused(out, ["--trials", "kernels", "--profile-steps", "9"], "step(s) 9")
    finally:
        if saved is None:
            del sys.modules["matplotlib"]
        else:
            sys.modules["matplotlib"] = saved
    if dist.get_rank() == 0:
        with open(os.path.join(base, "file"), "w") as f:
            f.write("a file, not a directory")
    dist.barrier()
    refused(os.path.join(base, "file", "out"), [], "--out", "not writable")
    refused(os.path.join(base, "file"), [], "--out", "not a directory")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(base)


@CASES.register
def unwritable_out_stops_every_rank_before_training(group):
    base = shared_dir()
    locked = os.path.join(base, "locked")
    if dist.get_rank() == 0:
        os.mkdir(locked, 0o500)
    dist.barrier()
    try:
        if root_writes_anyway(locked):
            raise Skip("mode bits do not stop this user (root) from writing, so an unwritable "
                       "--out cannot be made here")
        refused(os.path.join(locked, "sub"), [], "--out", "not writable")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            os.chmod(locked, 0o700)
            shutil.rmtree(base)


if __name__ == "__main__":
    main(CASES)
