#!/usr/bin/env bash
# The GPU suite in one command: bash tests/gpu/run.sh [RESULTS_DIR]
#
# Time budget, worst case 465 s = 7 min 45 s (the suite must stay under 8 minutes): the wheel install
# (30 s + 5 s to KILL), three steps each under its own limit (GNU timeout: TERM at the limit, KILL
# 10 s later) of 170 + 40 + 170 s + 3 x 10 s, then the table (20 s):
#   wheels  with a .whl/ folder (bash tests/gpu/fetch_wheels.sh, for a machine without a package
#           index: megatron-core, liger-kernel): pip install --no-index --no-deps of .whl/*.whl
#           into a --target folder put on PYTHONPATH (GPU_SUITE_SITE, default
#           ${TMPDIR:-/tmp}/gpu-suite-site); a failed install is reported and the steps run on
#   single  pytest tests/gpu (one GPU): float64 parity on the device, CUDA-graph replays,
#           peak memory against the CPU benchmarks' bounds, the fused LM head, batch invariance,
#           the top-k distillation ops (float64 parity, fused = unfused, graph replays, peak),
#           the Triton kernels of the unfused op (test_triton_gpu.py: float64 parity of the CPU
#           interpreter's cases, a 151,936-column row, CUDA-graph replays) and of the fused LM
#           head (test_triton_linear_gpu.py: float64 parity, a Qwen-width row, a graph replay)
#   parity  pytest tests/gpu/test_parity_dist.py: tp 2 and 4 on NCCL (needs 2 / 4 GPUs; on one GPU
#           it skips in seconds)
#   speed   python tests/gpu/speed.py --iters 5 --warmup 2: bf16 speed table (T = 4096, 8192;
#           V = 151,936) of our torch path and Triton kernels against Megatron's cross-entropies,
#           and our rows' forward / backward times, achieved TB/s and ratio to the one-read
#           bandwidth floor; then the fused LM-head table (tests/gpu/speed_fused.py: T = 8192,
#           H = 4096) of ours (torch, Triton) against Megatron's two pairs and Liger's fused linear
#           cross-entropy: forward / backward ms, TFLOP/s and ratio to the matmul floor
#   model   (with a GPU, in the background from the start, limit 300 s: within the steps' own
#           time, so the worst case stays as above) python benchmarks/gpu_model.py --speed-rows:
#           the static model's estimate of each speed-table row (docs/gpu-model.md)
# then prints the speed tables, the measured times next to the model's, and a summary table
# (tests/gpu/_suite.py), last, even when a step failed or timed out. Exit status: 0 if nothing failed (skips are fine), 1 otherwise.
# Without CUDA every check skips with its reason and the run takes seconds.
# Environment: PYTHON (default .venv/bin/python if present, else python3, else python),
# GPU_SUITE_LIMIT (seconds, overrides every step's limit), GPU_SUITE_SITE (see wheels).
set -euo pipefail

# shellcheck source=tests/gpu/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"  # ROOT (now the working directory), PY
OUT=${1:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX")}
mkdir -p "$OUT"
: >"$OUT/steps.tsv"
rm -f "$OUT/gpu_model.json"  # the model's estimates of an earlier run (see model below)
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
# The package from this checkout, installed or not (a device machine has only the files).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Wheels carried in .whl/ (tests/gpu/fetch_wheels.sh): installed without an index or their
# dependencies, in front of everything else on PYTHONPATH. Output to stderr: RESULTS_DIR holds the
# step files only (7 of them).
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${GPU_SUITE_SITE:-${TMPDIR:-/tmp}/gpu-suite-site}
  echo "[gpu-suite] wheels (limit 30s): $(cd .whl && echo *.whl) -> $SITE" >&2
  if timeout --kill-after=5 30 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --disable-pip-version-check --target "$SITE" .whl/*.whl >&2; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
  else
    echo "[gpu-suite] wheels: install failed; the steps run without them" >&2
  fi
fi

# run_step NAME LIMIT_S COMMAND...: output to $OUT/NAME.log, "name limit rc seconds" to steps.tsv.
run_step() {
  local name=$1 limit=${GPU_SUITE_LIMIT:-$2} start=$SECONDS rc=0
  shift 2
  rm -f "$OUT/$name.log" "$OUT/$name.xml" "$OUT/$name.json"  # nothing stale from an earlier run
  echo "[gpu-suite] $name (limit ${limit}s): $*" >&2
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$((SECONDS - start))" >>"$OUT/steps.tsv"
}

# The static model's estimates of the speed tables' rows (benchmarks/gpu_model.py: compiles the
# kernels for sm_90 on the CPU and reads their SASS; docs/gpu-model.md), alongside the GPU steps
# and only with a GPU (nothing is measured without one); the table prints them next to the
# measured times. GPU_SUITE_MODEL=0 turns it off.
MODEL_PID=
if [[ ${GPU_SUITE_MODEL:-1} != 0 ]] &&
   "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  run_step model 300 "$PY" benchmarks/gpu_model.py --summary --tokens 4096 8192 \
    --speed-rows "$OUT/gpu_model.json" &
  MODEL_PID=$!
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o junit_family=xunit2)
run_step single 170 "${PYTEST[@]}" tests/gpu --ignore=tests/gpu/test_parity_dist.py \
  --junitxml="$OUT/single.xml"
run_step parity 40 "${PYTEST[@]}" tests/gpu/test_parity_dist.py --junitxml="$OUT/parity.xml"
run_step speed 170 "$PY" tests/gpu/speed.py --iters 5 --warmup 2 --out "$OUT/speed.json"

if [[ -n $MODEL_PID ]]; then wait "$MODEL_PID" || true; fi
timeout 20 "$PY" tests/gpu/_suite.py "$OUT"
