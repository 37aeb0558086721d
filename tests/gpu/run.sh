#!/usr/bin/env bash
# The GPU suite in one command: bash tests/gpu/run.sh [RESULTS_DIR]
#
# Steps, each under its own time limit (GNU timeout: TERM at the limit, KILL 10 s later; at most
# 170 + 100 + 150 + 3 x 10 s = 7.5 minutes in all, then the table):
#   single  pytest tests/gpu (one GPU): float64 parity on the device, CUDA-graph replays,
#           peak memory against the CPU benchmarks' bounds, the fused LM head, batch invariance,
#           the top-k distillation ops (float64 parity, fused = unfused, graph replays, peak),
#           the Triton kernels of the unfused op (test_triton_gpu.py: float64 parity of the CPU
#           interpreter's cases, a 151,936-column row, CUDA-graph replays)
#   parity  pytest tests/gpu/test_parity_dist.py: tp 2 and 4 on NCCL (needs 2 / 4 GPUs)
#   speed   python tests/gpu/speed.py: bf16 speed table (T = 4096, 8192; V = 151,936) of our torch
#           path and Triton kernels against Megatron's cross-entropies, and our rows' forward /
#           backward times, achieved TB/s and ratio to the one-read bandwidth floor
# then prints the speed table and a summary table (tests/gpu/_suite.py), last, even when a step
# failed or timed out. Exit status: 0 if nothing failed (skips are fine), 1 otherwise.
# Without CUDA every check skips with its reason and the run takes seconds.
# Environment: PYTHON (default .venv/bin/python if present, else python), GPU_SUITE_LIMIT
# (seconds, overrides every step's limit).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python
fi
OUT=${1:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX")}
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}

# run_step NAME LIMIT_S COMMAND...: output to $OUT/NAME.log, "name limit rc seconds" to steps.tsv.
run_step() {
  local name=$1 limit=${GPU_SUITE_LIMIT:-$2} start=$SECONDS rc=0
  shift 2
  rm -f "$OUT/$name.log" "$OUT/$name.xml" "$OUT/$name.json"  # nothing stale from an earlier run
  echo "[gpu-suite] $name (limit ${limit}s): $*" >&2
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$((SECONDS - start))" >>"$OUT/steps.tsv"
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o junit_family=xunit2)
run_step single 170 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_parity_dist.py \
  --junitxml="$OUT/single.xml"
run_step parity 100 "${PYTEST[@]}" tests/gpu/test_parity_dist.py --junitxml="$OUT/parity.xml"
run_step speed 150 "$PY" tests/gpu/speed.py --out "$OUT/speed.json"

timeout 60 "$PY" tests/gpu/_suite.py "$OUT"
