"""CPU tests of the GPU suite's pure parts (``tests/gpu``): run.sh, the final table, the GPU-count
skips, the memory bounds, the speed script's arguments, and the NCCL parity cases' logic (run
on gloo with CPU tensors)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import check_case

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "tests", "gpu")
RUN_SH = os.path.join(GPU_DIR, "run.sh")
sys.path.insert(0, GPU_DIR)
import _suite  # noqa: E402

GiB = 1024**3


def _run_suite(tmp_path, **env):
    """``bash tests/gpu/run.sh`` with no visible GPU; (exit code, stdout lines)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env)
    proc = subprocess.run(["bash", RUN_SH, str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=240, env=env)
    return proc.returncode, proc.stdout.strip().splitlines()


def test_run_sh_is_an_executable_bash_script():
    assert os.access(RUN_SH, os.X_OK)
    subprocess.run(["bash", "-n", RUN_SH], check=True)
    text = open(RUN_SH).read()
    assert "set -euo pipefail" in text and "timeout" in text


def test_run_sh_without_cuda_prints_a_table_of_skips_last(tmp_path):
    code, lines = _run_suite(tmp_path)
    assert code == 0, lines
    assert re.fullmatch(r"GPU suite: 0 ok, \d+ skipped, 0 failed", lines[-1]), lines[-1]
    rows = [line for line in lines if line.startswith("| ") and "skipped" in line]
    assert any("::tp2 " in r and "needs 2 GPUs (found 0)" in r for r in rows), lines
    assert any("::tp4 " in r and "needs 4 GPUs (found 0)" in r for r in rows), lines
    assert any("speed" in r and "needs a CUDA device" in r for r in rows), lines
    assert any("single_gpu::cuda_graph" in r for r in rows), lines


def test_run_sh_reports_timed_out_steps_and_fails(tmp_path):
    code, lines = _run_suite(tmp_path, GPU_SUITE_LIMIT="0.05")
    assert code == 1
    assert re.fullmatch(r"GPU suite: 0 ok, 0 skipped, 3 failed", lines[-1]), lines
    for step in ("single", "parity", "speed"):
        assert f"| {step} | (step) | FAIL: timed out after 0.05 s |" in "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The table, from a fixed results directory

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="tests.gpu.test_packing_te"><skipped message="collection skipped">
('/x/tests/gpu/test_packing_te.py', 15, 'Skipped: needs CUDA')</skipped></testcase>
<testcase classname="tests.gpu.test_single_gpu" name="test_graph[core]"/>
<testcase classname="tests.gpu.test_single_gpu" name="test_graph[fused]"/>
<testcase classname="tests.gpu.test_single_gpu" name="test_peak">
<failure message="AssertionError: (5, 3)">trace</failure></testcase>
<testcase classname="tests.gpu.test_single_gpu" name="test_batch[core]">
<skipped type="pytest.skip" message="no batch_invariant"/></testcase>
<testcase classname="tests.gpu.test_single_gpu" name="test_batch[fused]"/>
</testsuite></testsuites>"""

SPEED = {"config": "V=151936", "rows": [
    {"provider": "ours", "mode": "logprob", "tokens": 2048, "time_ms": 4.0,
     "peak_bytes": 2 * GiB, "skipped": None},
    {"provider": "megatron", "mode": "logprob", "tokens": 2048, "time_ms": 8.0,
     "peak_bytes": 4 * GiB, "skipped": None},
    {"provider": "megatron_fused", "mode": "logprob", "tokens": 2048, "time_ms": 5.0,
     "peak_bytes": 3 * GiB, "skipped": None},
    {"provider": "ours", "mode": "logprob+entropy", "tokens": 2048, "time_ms": None,
     "peak_bytes": None, "skipped": "error: RuntimeError: boom"},
]}


def _results_dir(tmp_path, steps):
    (tmp_path / "steps.tsv").write_text("".join(f"{n}\t60\t{c}\t3\n" for n, c in steps))
    (tmp_path / "single.xml").write_text(JUNIT)
    (tmp_path / "speed.json").write_text(json.dumps(SPEED))
    (tmp_path / "parity.log").write_text("Traceback ...\nRuntimeError: NCCL error\n")
    return str(tmp_path)


def test_table_of_a_fixed_run(tmp_path, capsys):
    out = _results_dir(tmp_path, [("single", 1), ("parity", 124), ("speed", 0)])
    speed_text, rows = _suite.read_results(out)
    got = [(r.step, r.check, r.status) for r in rows]
    assert got == [
        ("single", "packing_te (module)", "skipped: needs CUDA"),
        ("single", "single_gpu::graph", "ok (2 cases)"),
        ("single", "single_gpu::peak", "FAIL: AssertionError: (5, 3)"),
        ("single", "single_gpu::batch", "ok (1 ok, 1 skip)"),
        ("parity", "(step)", "FAIL: timed out after 60 s"),
        ("speed", "ours logprob+entropy T=2048", "FAIL: error: RuntimeError: boom"),
    ]
    assert "| 2048 | ours | logprob | 4.00 | 0.50 | 0.80 | 2.00 |" in speed_text
    assert "| 2048 | megatron_fused | logprob | 5.00 | 0.62 | 1.00 | 3.00 |" in speed_text
    assert "| 2048 | ours | logprob+entropy | error: RuntimeError: boom | | | |" in speed_text
    assert _suite.main([out]) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == "GPU suite: 2 ok, 1 skipped, 3 failed"
    header = "| T | provider | mode | ms | / Megatron | / Megatron fused | peak GiB |"
    summary_header = next(i for i, line in enumerate(printed) if line.startswith("| step | check"))
    assert printed.index(header) < summary_header


def test_measured_times_next_to_the_model(tmp_path):
    """With the static model's estimates (run.sh's model step, ``benchmarks/gpu_model.py
    --speed-rows``), each measured row that has one is printed next to it: forward, backward,
    total and measured / model; rows without an estimate or not measured are left out."""
    out = _results_dir(tmp_path, [("single", 0), ("speed", 0), ("model", 0)])
    speed = dict(SPEED, rows=[dict(SPEED["rows"][0], provider="ours_triton",
                                   extra={"fwd_ms": 1.5, "bwd_ms": 2.5, "fwd_tbps": 1.0,
                                          "bwd_tbps": 1.0, "floor_ms": 1.0, "vs_floor": 4.0}),
                             *SPEED["rows"][1:]])
    speed["fused"] = {"config": "c", "rows": [
        {"provider": "liger", "mode": "logprob fwd-grad", "tokens": 8192, "time_ms": 50.0,
         "peak_bytes": GiB, "skipped": None, "extra": {
             "hidden": 4096, "fwd_ms": 50.0, "bwd_ms": 0.0, "fwd_tflops": 0.0, "bwd_tflops": 0.0,
             "tflops": 0.0, "vs_floor": 1.6, "grads_in_forward": True}}]}
    (tmp_path / "speed.json").write_text(json.dumps(speed))
    model = {"rows": [
        {"table": "unfused", "provider": "ours_triton", "mode": "logprob", "tokens": 2048,
         "hidden": None, "fwd_ms": 1.0, "bwd_ms": 2.0, "time_ms": 3.0},
        {"table": "unfused", "provider": "ours", "mode": "logprob+entropy", "tokens": 2048,
         "hidden": None, "fwd_ms": 9.0, "bwd_ms": 9.0, "time_ms": 18.0},
        {"table": "fused", "provider": "liger", "mode": "logprob fwd-grad", "tokens": 8192,
         "hidden": 4096, "fwd_ms": 40.0, "bwd_ms": 0.0, "time_ms": 40.0}]}
    (tmp_path / _suite.MODEL_JSON).write_text(json.dumps(model))
    speed_text, rows = _suite.read_results(out)
    assert ("| unfused | 2048 |  | ours_triton | logprob | 1.50 | 1.00 | 2.50 | 2.00 | 4.00 | "
            "3.00 | 1.33 |") in speed_text
    assert ("| fused | 8192 | 4096 | liger | logprob fwd-grad | 50.00 | 40.00 | 0.00 | 0.00 | "
            "50.00 | 40.00 | 1.25 |") in speed_text
    assert "| ours | logprob+entropy | 9.00" not in speed_text  # not measured (it errored)
    assert ("model", _suite.MODEL_CHECK, "ok (3 rows)") in [(r.step, r.check, r.status)
                                                             for r in rows]
    assert _suite.model_lines(SPEED, {"rows": []}) == []


def test_a_crashed_step_without_a_report_fails(tmp_path):
    out = _results_dir(tmp_path, [("parity", 1)])
    _, rows = _suite.read_results(out)
    assert [r.status for r in rows] == [
        "FAIL: exit code 1: Traceback ... RuntimeError: NCCL error"]
    assert _suite.read_results(str(tmp_path / "missing"))[1][0].failed


def test_speed_skip_is_not_a_failure():
    text, rows = _suite.speed_table({"skipped": "needs a CUDA device"})
    assert text == "" and [r.status for r in rows] == ["skipped: needs a CUDA device"]


CHILD = """import sys, time
sys.path.insert(0, {gpu_dir!r})
import _suite
_suite.exit_with_launcher()
print("ready", flush=True)
time.sleep(60)
"""
LAUNCHER = """import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True,
                         stderr=subprocess.DEVNULL, start_new_session=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[:2] == ["State:", "Z"] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")
def test_a_rank_exits_with_its_launcher():
    # The child sits in a session of its own, as torchrun's ranks do; its launcher exits at once.
    child = CHILD.format(gpu_dir=GPU_DIR)
    out = subprocess.run([sys.executable, "-c", LAUNCHER.format(child=child)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    pid = int(out.split()[-1])
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _gone(pid):
        os.kill(pid, 9)
        pytest.fail("the child outlived its launcher")


# ---------------------------------------------------------------------------------------------
# Skips by GPU count

@pytest.mark.parametrize("count", [0, 1, 2, 3, 4])
def test_gpu_count_skip(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    for needed in (2, 4):
        reason = _suite.gpu_skip_reason(needed)
        assert reason == (None if count >= needed else f"needs {needed} GPUs (found {count})")


def test_parity_test_skips_without_launching(monkeypatch):
    parity = _suite.load_module(os.path.join(GPU_DIR, "test_parity_dist.py"), "gpu_test_parity")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    launched = []
    monkeypatch.setattr(parity._launcher, "check_case", lambda *a: launched.append(a))
    with pytest.raises(pytest.skip.Exception, match=r"needs 2 GPUs \(found 1\)"):
        parity.check_parity(2, "core_fp32_matches_float64")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    parity.check_parity(4, "core_fp32_matches_float64")
    assert launched == [(parity.SCRIPT, 4, "core_fp32_matches_float64")]


# ---------------------------------------------------------------------------------------------
# Memory bounds, against the CPU benchmarks' own results

def _md_rows(name: str, provider: str) -> list[dict]:
    path = os.path.join(ROOT, "benchmarks", "results", f"{name}.md")
    lines = [line for line in open(path) if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|\n").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|\n").split("|"))))
            for line in lines[2:]]
    return [r for r in rows
            if r["provider"] == provider and not r["peak/rank GiB"].startswith("skipped")]


def test_vocab_parallel_bound_is_the_cpu_benchmark_bound():
    from megatron_vocabstats.ops.options import auto_chunk_size

    rows = _md_rows("vocab_parallel", "ours")
    assert rows
    for r in rows:
        tokens, tp = int(r["T"]), int(r["tp"])
        width = -(-151_936 // (tp * 128)) * 128  # the benchmark's Megatron padding
        bound = _suite.vocab_parallel_peak_bound(tokens, width, auto_chunk_size(width,
                                                 torch.device("cpu")), tp) / GiB
        peak, ratio = float(r["peak/rank GiB"]), float(r["bound ratio"])
        slack = 0.0005 / peak + 0.0005 / ratio  # the table's rounding to 3 decimals
        assert abs(peak / ratio / bound - 1) <= slack, (r, bound)


def test_fused_bound_holds_the_cpu_peaks_and_excludes_the_unfused_pair():
    from megatron_vocabstats.ops.engine.linear import auto_linear_chunk_size

    fused = _md_rows("fused_linear", "fused")
    unfused = {(r["H"], r["T"]): float(r["peak/rank GiB"])
               for r in _md_rows("fused_linear", "megatron_pair")}
    assert fused and unfused
    for r in fused:
        hidden, tokens, tp = int(r["H"]), int(r["T"]), int(r["tp"])
        width = -(-151_936 // (tp * 128)) * 128
        chunk = int(r["chunk"]) or auto_linear_chunk_size(width, torch.device("cpu"))
        bound = _suite.fused_peak_bound(tokens, width, hidden, chunk, "upcast") / GiB
        assert float(r["peak/rank GiB"]) <= bound < unfused[(r["H"], r["T"])], (r, bound)
    # The "mm" weight-gradient mode adds one fp32 [W, H] product.
    assert (_suite.fused_peak_bound(8, 100, 10, 4, "mm")
            - _suite.fused_peak_bound(8, 100, 10, 4, "addmm")) == 100 * 10 * 4


# ---------------------------------------------------------------------------------------------
# The speed script's arguments, and the parity cases' logic on gloo

def test_speed_arguments():
    speed = _suite.load_module(os.path.join(GPU_DIR, "speed.py"), "gpu_speed")
    args = speed.parse_args(["--out", "x.json"])
    assert (args.tokens, args.vocab, args.iters, args.warmup) == ([4096, 8192], 151_936, 10, 3)
    assert args.peak_tbps == 4.8
    for bad in (["--tokens", "0"], ["--iters", "-1"], ["--vocab", "0"], ["--warmup", "-1"], []):
        with pytest.raises(SystemExit):
            speed.parse_args(bad + (["--out", "x"] if bad else []))
    assert [p[:2] for p in speed.providers(8)] == [
        ("ours", "logprob"), ("ours", "logprob+entropy"), ("ours_triton", "logprob"),
        ("ours_triton", "logprob+entropy"), ("megatron", "logprob"), ("megatron_fused", "logprob")]


def test_speed_bandwidth_floor_and_its_table():
    """The one-read floor (6 B per logit: 1.56 ms at T=8192, V=151,936, 4.8 TB/s)
    and the suite's forward/backward table of the rows that carry it."""
    speed = _suite.load_module(os.path.join(GPU_DIR, "speed.py"), "gpu_speed")
    x = speed.bandwidth(8192, 151_936, 0.6, 1.2, 4.8)
    assert abs(x["floor_ms"] - 1.5557) < 1e-3
    assert abs(x["fwd_tbps"] - 2 * 8192 * 151_936 / 0.6e9) < 1e-9
    assert abs(x["vs_floor"] - 1.8 / x["floor_ms"]) < 1e-12
    rows = [dict(SPEED["rows"][0], provider="ours_triton", extra=x)]
    text, _ = _suite.speed_table({"config": "c", "rows": rows})
    assert "| 2048 | ours_triton | logprob | 0.60 | 1.20 | 4.15 | 4.15 | 1.56 | 1.16 |" in text
    assert "/ floor" not in _suite.speed_table(SPEED)[0]  # older reports: no second table


def test_speed_without_cuda_writes_a_skip(tmp_path, monkeypatch):
    speed = _suite.load_module(os.path.join(GPU_DIR, "speed.py"), "gpu_speed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert speed.main(["--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == {"skipped": "needs a CUDA device"}


PARITY_ON_CPU = os.path.join(GPU_DIR, "dist", "parity_on_cpu.py")
PARITY_CASES = sorted(_suite.load_module(os.path.join(GPU_DIR, "dist", "parity_cases.py"),
                                         "gpu_parity_cases").CASES)


@pytest.mark.parametrize("name", PARITY_CASES)
def test_parity_case_logic_on_gloo(name):
    check_case(PARITY_ON_CPU, 2, name)


def test_nccl_cases_get_the_nccl_group(monkeypatch):
    nccl = _suite.load_module(os.path.join(GPU_DIR, "dist", "_nccl.py"), "gpu_nccl_harness")
    sentinel = object()
    monkeypatch.setattr(nccl, "nccl_group", lambda: sentinel)
    seen = {}
    cases = nccl.Cases({"a": lambda g: seen.setdefault("a", g),
                        "b": lambda g: seen.setdefault("b", g)})
    wrapped = nccl.on_nccl(cases)
    assert list(wrapped) == ["a", "b"]
    for fn in wrapped.values():
        fn("the harness's gloo group")
    assert seen == {"a": sentinel, "b": sentinel}
