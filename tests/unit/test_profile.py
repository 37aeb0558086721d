"""The profiler (megatron_vocabstats.profiling, examples/gsm8k/profile.py): selection parsing, the
CUDA snapshot grouping and the trace splitting on hand-made inputs, summaries from raw files, and
(dist/profile_cases.py, one torchrun launch on 2 gloo ranks) a tiny profile of the GSM8K example
end to end.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from conftest import check_case
from examples.gsm8k import profile as runner
from examples.gsm8k.profile import main
from megatron_vocabstats.profiling import (
    classify_frames,
    default_ranks,
    memory,
    parse_ranks,
    parse_steps,
    parse_trials,
    replay_trace,
    split_trace,
    summarize,
    summary,
    trace_stats,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dist.profile_cases import CASES


@pytest.mark.megatron
@pytest.mark.parametrize("name", sorted(CASES))
def test_profile_under_torchrun(name):
    pytest.importorskip("megatron.core")
    pytest.importorskip("mistral_common")
    pytest.importorskip("matplotlib")
    check_case("profile_cases.py", 2, name)


# --------------------------------------------------------------------------- selection


def test_rank_lists():
    assert parse_ranks("0,2-4", 5) == [0, 2, 3, 4]
    assert parse_ranks(" 3, 1 ,1-2", 4) == [1, 2, 3]
    assert parse_ranks("", 3) == [0, 1, 2]
    assert parse_ranks(None, 8) == [0]
    assert parse_ranks(None, 8, pipeline_stages=4) == [0, 2, 4, 6] == default_ranks(8, 4)


@pytest.mark.parametrize("spec, needle", [("0,4", "rank(s) 4 but"), ("2-9", "rank(s) 4-9 "),
                                          ("0,3-5,7", "rank(s) 4-5,7 "),
                                          ("1,,2", "empty item"), ("x", "'x'"),
                                          ("3-1", "'3-1'"), ("-1", "'-1'")])
def test_bad_rank_lists(spec, needle):
    with pytest.raises(ValueError, match="--ranks") as info:
        parse_ranks(spec, 4)
    assert needle in str(info.value)


def test_huge_ranges_are_refused_without_expanding_them():
    """``0-99999999999`` used to build the whole set of numbers first (the process was killed
    for memory); now ranges stop at the limit, so refusing one costs nothing."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"rank\(s\) 2-1000000 but the world has 2"):
            parse_ranks("0-1000000", 2)
        with pytest.raises(ValueError, match=r"step\(s\) 4-1000000 beyond .* --steps 3"):
            parse_steps("1-1000000", 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    with pytest.raises(ValueError, match="2-99999999999"):
        parse_ranks("1-99999999999", 2)


def test_steps_and_trials():
    assert parse_steps("2,4-5", 5) == [2, 4, 5]
    assert parse_steps(" 3 ,1-2,2", 3) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"--profile-steps '6'.*step\(s\) 6.*--steps 5"):
        parse_steps("6", 5)
    with pytest.raises(ValueError, match="count from 1"):
        parse_steps("0-2", 5)
    assert parse_trials("kernels,memory,kernels") == ["kernels", "memory"]
    with pytest.raises(ValueError, match="--trials"):
        parse_trials("memory,")
    with pytest.raises(ValueError, match="pipeline"):
        default_ranks(6, 4)


# --------------------------------------------------------------------------- CUDA snapshots

MiB = 1 << 20


def frame(filename, name, line=1):
    return {"filename": filename, "line": line, "name": name}


TRAIN = frame("/repo/examples/gsm8k/sft.py", "train")
PARAM = [frame("/x/megatron/core/tensor_parallel/layers.py", "__init__"),
         frame("/repo/examples/gsm8k/model.py", "build_model"), TRAIN]
OPT = [frame("/x/torch/optim/adamw.py", "_init_group"), frame("/x/torch/optim/adamw.py", "step"),
       TRAIN]
ACT = [frame("/x/megatron/core/transformer/mlp.py", "forward"),
       frame("/x/megatron/core/pipeline_parallel/schedules.py", "forward_step"), TRAIN]
LOGITS = [frame("/x/torch/nn/functional.py", "linear"),
          frame("/x/megatron/core/tensor_parallel/layers.py", "forward"),
          frame("/x/megatron/core/models/gpt/gpt_model.py", "_postprocess"), TRAIN]
DLOGITS = [frame("/repo/megatron_vocabstats/ops/stats/from_logits.py", "backward"),
           frame("/x/megatron/core/pipeline_parallel/schedules.py", "backward_step"), TRAIN]
WGRAD = [frame("/x/megatron/core/pipeline_parallel/schedules.py", "backward_step"), TRAIN]
CLIP = [frame("/repo/examples/gsm8k/model.py", "clip_grad_norm_"), TRAIN]


def test_classify_frames():
    assert classify_frames(PARAM) == "parameters"
    assert classify_frames(OPT) == "optimizer state"
    assert classify_frames(ACT) == "activations"
    assert classify_frames(LOGITS) == "logits and their gradients"
    assert classify_frames(DLOGITS) == "logits and their gradients"
    assert classify_frames(WGRAD) == "gradients"
    assert classify_frames(CLIP) == "workspace"


def test_frameless_blocks_are_the_backward_not_workspace():
    """On CUDA the backward of built-in operators runs on the autograd engine's device thread,
    which has no Python stack (pytorch/pytorch#82146): its blocks have no frames. They are a
    kind of their own, not mixed into the workspace."""
    assert classify_frames([]) == memory.NO_STACK != memory.WORKSPACE
    raw = replay_trace([], [entry("alloc", 1, 2 * MiB, ACT, 1), entry("alloc", 2, 3 * MiB, [], 2),
                            entry("alloc", 3, MiB, CLIP, 3)])
    s = summary.memory_summary({"trial": "t", "kind": "memory", "rank": 0, "step": 1}, raw)
    kinds = {r["kind"]: r["bytes"] for r in s["at_peak_by_kind"]}
    assert kinds[memory.NO_STACK] == 3 * MiB and kinds[memory.WORKSPACE] == MiB


def test_wrapped_history_is_reported():
    old = [entry("alloc", 1, MiB, ACT, 10)]
    kept = snapshot([], old + [entry("alloc", 2, MiB, ACT, 11)])
    lost = snapshot([], [entry("alloc", 3, MiB, ACT, 12), entry("free_completed", 2, MiB, ACT, 13)])
    assert not memory.history_wrapped(snapshot([], old), kept, 0)
    assert memory.history_wrapped(snapshot([], old), lost, 0)
    raw = replay_trace([], memory.events_after(snapshot([], old), lost, 0))
    raw["history_wrapped"] = True
    s = summary.memory_summary({"trial": "t", "kind": "memory", "rank": 0, "step": 1}, raw)
    assert s["history_wrapped"] and s["unmatched_frees"] == 1
    assert "--max-entries" in summary.memory_markdown(s)


def snapshot(blocks, trace):
    """A ``torch.cuda.memory._snapshot()`` dict (documented format) on device 0."""
    return {"segments": [{"device": 0, "address": 0, "total_size": 1 << 40, "stream": 0,
                          "segment_type": "large", "allocated_size": 0, "active_size": 0,
                          "blocks": blocks}],
            "device_traces": [trace]}


def block(addr, size, frames, state="active_allocated"):
    return {"address": addr, "size": size, "requested_size": size, "state": state,
            "frames": frames}


def entry(action, addr, size, frames, t):
    return {"action": action, "addr": addr, "size": size, "frames": frames, "stream": 0,
            "time_us": t}


def test_replay_trace_peak_and_groups():
    old = [entry("alloc", 1, 8 * MiB, PARAM, 10), entry("alloc", 2, 16 * MiB, OPT, 20),
           entry("alloc", 9, 5 * MiB, CLIP, 25), entry("free_completed", 9, 5 * MiB, CLIP, 26)]
    before = snapshot([block(1, 8 * MiB, PARAM), block(2, 16 * MiB, OPT),
                       block(9, 5 * MiB, CLIP, state="inactive")], old)
    step = [entry("segment_alloc", 50, 64 * MiB, [], 30),
            entry("alloc", 3, 4 * MiB, ACT, 31),
            entry("alloc", 4, 32 * MiB, LOGITS, 32),
            entry("alloc", 5, 32 * MiB, DLOGITS, 33),       # peak: 8 + 16 + 4 + 32 + 32 = 92
            entry("free_requested", 4, 32 * MiB, LOGITS, 34),  # still in use until completed
            entry("free_completed", 4, 32 * MiB, LOGITS, 35),
            entry("alloc", 6, 8 * MiB, WGRAD, 36),
            entry("free_completed", 5, 32 * MiB, DLOGITS, 37),
            entry("free_completed", 3, 4 * MiB, ACT, 38),
            entry("alloc", 7, 1 * MiB, CLIP, 39)]
    after = snapshot([], old + step)
    events = memory.events_after(before, after, 0)
    assert events == step
    raw = replay_trace(memory.live_blocks(before, 0), events)
    total = raw["timeline"]["total"]
    assert total == [m * MiB for m in (24, 28, 60, 92, 60, 68, 36, 32, 33)]
    assert raw["timeline"]["x"] == [0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # from t=30
    s = summary.memory_summary({"trial": "t", "kind": "memory", "rank": 0, "step": 1}, raw)
    assert s["peak_bytes"] == 92 * MiB == max(total)
    kinds = {r["kind"]: r["bytes"] for r in s["at_peak_by_kind"]}
    assert kinds["logits and their gradients"] == 64 * MiB
    assert (kinds["parameters"], kinds["optimizer state"], kinds["activations"]) == \
        (8 * MiB, 16 * MiB, 4 * MiB)
    assert sum(kinds.values()) == s["peak_bytes"]
    largest = s["largest_at_peak"]
    assert [r["bytes"] for r in largest] == [32 * MiB, 32 * MiB, 16 * MiB, 8 * MiB, 4 * MiB]
    # Where: the innermost frame outside torch itself.
    assert sorted(r["where"] for r in largest[:2]) == [
        "/repo/megatron_vocabstats/ops/stats/from_logits.py:1 backward",
        "/x/megatron/core/tensor_parallel/layers.py:1 forward"]


def test_events_without_timestamps_and_unmatched_frees():
    strip = [{k: v for k, v in e.items() if k != "time_us"}
             for e in (entry("alloc", 1, 10, ACT, 0), entry("alloc", 2, 20, ACT, 0))]
    assert memory.events_after(snapshot([], strip[:1]), snapshot([], strip), 0) == strip[1:]
    raw = replay_trace([], strip[1:] + [entry("free_completed", 77, 5, [], 1)])
    assert raw["unmatched_frees"] == 1 and raw["timeline"]["total"] == [0, 20]
    assert raw["timeline"]["x_label"] == "allocator action"


def test_long_timeline_is_thinned_keeping_the_peak():
    n = memory.MAX_TIMELINE_POINTS * 3 + 7
    values = [i % 1000 for i in range(n)]
    values[12345] = 10 ** 9
    raw = memory.raw_record(backend="t", x=list(range(n)), x_label="i", phase=["p"] * n,
                            by_kind={"a": values})
    assert len(raw["timeline"]["total"]) <= memory.MAX_TIMELINE_POINTS + 1
    assert max(raw["timeline"]["total"]) == 10 ** 9 and raw["timeline"]["samples"] == n


def test_thinning_keeps_the_end_and_every_phase_peak():
    """The summary's end-of-step number and phase peaks come from the thinned timeline: the
    last sample and each phase's maximum must survive the thinning."""
    n = memory.MAX_TIMELINE_POINTS * 3 + 2  # the stride (4) does not reach the last sample
    values = [100] * n
    phase = ["forward"] * (n // 2) + ["backward"] * (n - n // 2)
    values[7], values[n // 2 + 5], values[-1] = 500, 300, 42
    raw = memory.raw_record(backend="t", x=list(range(n)), x_label="i", phase=phase,
                            by_kind={"a": values})
    s = summary.memory_summary({"trial": "t", "kind": "memory", "rank": 0, "step": 1}, raw)
    assert s["end_bytes"] == 42 and s["peak_bytes"] == 500
    assert s["phase_peak_bytes"] == {"forward": 500, "backward": 300}


# --------------------------------------------------------------------------- Chrome traces

TRACE = {
    "schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "GPU"}],
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 100, "args": {"name": "python"}},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 1, "args": {"name": "main"}},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 100, "tid": 1, "ts": 0,
         "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 100, "tid": 1,
         "ts": 60, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 1,
         "ts": 10, "dur": 5},
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "pid": 0, "tid": 7, "ts": 20,
         "dur": 40},
        {"ph": "X", "cat": "kernel", "name": "sm90_gemm", "pid": 0, "tid": 7, "ts": 70,
         "dur": 40},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "pid": 0, "tid": 8, "ts": 115,
         "dur": 5},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 100, "tid": 1, "ts": 10},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 20},
    ],
}


def test_split_trace_views():
    original = copy.deepcopy(TRACE)
    device, host = split_trace(TRACE)
    assert TRACE == original
    assert device["deviceProperties"] == host["deviceProperties"] == TRACE["deviceProperties"]
    names = lambda v: [(e["ph"], e["name"]) for e in v["traceEvents"]]  # noqa: E731
    assert names(device) == [("M", "process_name"), ("X", "sm90_gemm"), ("X", "sm90_gemm"),
                             ("X", "Memcpy DtoH")]
    assert names(host) == [("M", "process_name"), ("M", "thread_name"), ("X", "aten::mm"),
                           ("X", "c10d::allreduce_"), ("X", "cudaLaunchKernel")]


def test_trace_stats():
    st = trace_stats(TRACE)
    assert st["device"]["kernels"] == 2 and st["device"]["busy_us"] == 80.0
    assert st["device"]["span_us"] == 100.0  # 20 .. 120, the memcpy included
    assert st["device"]["top_kernels"] == [{"name": "sm90_gemm", "count": 2, "total_us": 80.0}]
    assert st["host"]["operators"] == 2 and st["host"]["span_us"] == 90.0
    assert [r["name"] for r in st["host"]["collectives"]] == ["c10d::allreduce_"]


# --------------------------------------------------------------------------- summaries


def write_trial(root, name, kind, raw_name, raw):
    d = root / name
    d.mkdir()
    (d / summary.TRIAL_FILE).write_text(json.dumps({"trial": name, "kind": kind, "rank": 0,
                                                    "step": 1, "world": 1}))
    (d / raw_name).write_text(json.dumps(raw))
    return d


def test_summarize_regenerates_from_raw(tmp_path):
    pytest.importorskip("matplotlib")
    raw = replay_trace([], [entry("alloc", 1, 3 * MiB, LOGITS, 1),
                            entry("alloc", 2, MiB, ACT, 2),
                            entry("free_completed", 1, 3 * MiB, LOGITS, 3)])
    mem = write_trial(tmp_path, "memory-step1-rank0", "memory", memory.RAW_FILE, raw)
    ker = write_trial(tmp_path, "kernels-step1-rank0", "kernels", "trace.json", TRACE)
    (tmp_path / "not-a-trial").mkdir()
    assert main(["summarize", str(tmp_path)]) == 0
    s = json.loads((mem / summary.SUMMARY_JSON).read_text())
    assert s["peak_bytes"] == 4 * MiB and (mem / summary.TIMELINE_PNG).stat().st_size > 0
    assert "logits and their gradients" in (mem / summary.SUMMARY_MD).read_text()
    assert json.loads((ker / "trace.device.json").read_text()) == split_trace(TRACE)[0]
    first = {p: p.read_bytes() for d in (mem, ker) for p in d.glob("summary.*")}
    index = (tmp_path / "index.md").read_text()
    assert "memory-step1-rank0" in index and "kernels-step1-rank0" in index
    summarize(str(tmp_path))
    assert {p: p.read_bytes() for p in first} == first


def test_summarize_bad_directories(tmp_path, capsys):
    with pytest.raises(ValueError, match="not a directory"):
        summarize(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="holds no trial"):
        summarize(str(tmp_path))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / summary.TRIAL_FILE).write_text(json.dumps(
        {"trial": "t", "kind": "memory", "rank": 0, "step": 1}))
    assert main(["summarize", str(tmp_path)]) == 2
    assert "memory.raw.json missing" in capsys.readouterr().err


def test_summarize_partial_and_corrupt_trials(tmp_path, capsys):
    """An interrupted or damaged run: every broken trial is named in one error (exit 2, no
    traceback), and the good trials still get their summaries and the index."""
    pytest.importorskip("matplotlib")
    good = write_trial(tmp_path, "kernels-step1-rank0", "kernels", "trace.json", TRACE)
    cut = write_trial(tmp_path, "kernels-step1-rank1", "kernels", "trace.json", TRACE)
    (cut / "trace.json").write_text(json.dumps(TRACE)[:200])  # stopped while writing
    write_trial(tmp_path, "memory-step1-rank0", "memory", memory.RAW_FILE, {"backend": "x"})
    odd = tmp_path / "weird"
    odd.mkdir()
    (odd / summary.TRIAL_FILE).write_text(json.dumps({"trial": "weird", "kind": "flops",
                                                      "rank": 0, "step": 1}))
    assert main(["summarize", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 of 4 trial(s)") and "Traceback" not in err, err
    assert f"{cut / 'trace.json'} is not valid JSON" in err
    assert f"{tmp_path / 'memory-step1-rank0' / memory.RAW_FILE} does not have the layout" in err
    assert "weird" in err and "kind one of memory, kernels" in err
    assert (good / summary.SUMMARY_MD).is_file()
    index = (tmp_path / "index.md").read_text()
    assert "kernels-step1-rank0" in index and "rank1" not in index


def test_errors_after_the_checks_are_not_swallowed(monkeypatch, capsys):
    """Only the checks' ValueErrors are bad input (status 2, printed by rank 0). A ValueError in
    training on rank 1 used to end that rank with status 2 and no message at all."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(runner, "plan", lambda opts, world, rank: (None, None))

    def fails(plan, args):
        raise ValueError("target id out of range in the loss")

    monkeypatch.setattr(runner, "execute", fails)
    with pytest.raises(ValueError, match="out of range"):
        main(["run", "--out", "x", "--", "sft"])

    def unwritable(opts, world, rank):
        raise runner.OutDirError("--out x is not writable (Read-only file system)")

    monkeypatch.setattr(runner, "plan", unwritable)
    assert main(["run", "--out", "x", "--", "sft"]) == 2
    assert capsys.readouterr().err == ("error (rank 1): --out x is not writable (Read-only file "
                                       "system)\n")


def test_previous_profile_is_found_and_removed(tmp_path):
    assert runner.previous_profile(str(tmp_path / "missing")) == []
    assert runner.previous_profile(str(tmp_path)) == []
    write_trial(tmp_path, "kernels-step1-rank0", "kernels", "trace.json", TRACE)
    for name in ("settings.json", "settings.log", "index.md", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "data").mkdir()
    assert runner.previous_profile(str(tmp_path)) == [
        "index.md", "kernels-step1-rank0", "settings.json", "settings.log"]
    runner.remove_previous_profile(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_matplotlib_is_required_up_front(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ValueError, match="pip install matplotlib"):
        summary.require_matplotlib()


def test_import_needs_no_megatron_or_example():
    code = ("import sys, megatron_vocabstats.profiling; "
            "bad = [m for m in sys.modules if m.startswith(('megatron.core', 'examples', "
            "'matplotlib'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plugin_run_says_where_it_moved(capsys):
    """The plugin's command line has no ``run`` (the plugin never imports the example): it says
    where the command is."""
    from megatron_vocabstats.profiling.cli import main as plugin_main

    assert plugin_main(["run", "--out", "x", "--", "sft"]) == 2
    assert "python -m examples.gsm8k.profile run" in capsys.readouterr().err
