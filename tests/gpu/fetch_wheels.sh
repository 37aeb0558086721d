#!/usr/bin/env bash
# The wheels the GPU suite needs on a machine without a package index, downloaded here (where pip
# reaches one) into .whl/ of the repo root (ignored: .gitignore's /.whl/), which
# tests/gpu/run.sh installs with pip --no-index --no-deps when it finds it:
#
#   bash tests/gpu/fetch_wheels.sh [DIR]     # DIR defaults to .whl; prints each size and the total
#
# Prerequisites on the GPU machine: Python 3.12 on x86-64 Linux (the wheels are cp312 /
# manylinux) with torch, triton, numpy, packaging and pytest installed; it then lacks only
# megatron-core and liger-kernel. Our package itself needs no wheel: run.sh puts the checkout on
# PYTHONPATH. Fetched (--no-deps: their declared needs are those prerequisites):
#   megatron-core 0.19.2  cp312 manylinux_2_28, 2.26 MiB: torch >= 2.6, numpy, packaging;
#                         the Megatron rows of the speed tables
#   liger-kernel 0.8.5    pure Python, 0.87 MiB: torch >= 2.1.2, triton >= 2.3.1;
#                         the Liger rows of the fused speed table
# Together 3.13 MiB: copy .whl/ with the checkout (run.sh reads .whl/ only, whatever DIR was).
# Not fetched: nvidia-cutlass-dsl (Liger's differentiable entropy runs as a CuTe DSL kernel on
# sm90; its nvidia-cutlass-dsl-libs-cu13 wheel alone is 92 MB), so the Liger entropy row reports
# it missing unless the machine has it. torch and triton stay the machine's own.
# Environment: PYTHON (default .venv/bin/python if present, else python3, else python): the pip
# that downloads.
set -euo pipefail

# shellcheck source=tests/gpu/_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"  # ROOT (now the working directory), PY
DIR=${1:-.whl}
WHEELS=(megatron-core==0.19.2 liger-kernel==0.8.5)
# The device's interpreter and platform (device README: pip matches manylinux_2_N exactly).
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

mkdir -p "$DIR"
# One version of each: two of one package stop the whole install there.
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  rm -f "$DIR/${name//-/_}"-*.whl
done
"$PY" -m pip download -q --no-deps --disable-pip-version-check "${TARGET[@]}" -d "$DIR" \
  "${WHEELS[@]}"

# Sizes in MiB, each and in all.
for f in "$DIR"/*.whl; do
  printf '%s %s\n' "$(stat -c %s "$f")" "$(basename "$f")"
done | awk -v dir="$DIR" '{ total += $1; printf "%8.2f MiB  %s\n", $1 / 1048576, $2 }
  END { printf "%8.2f MiB  total in %s\n", total / 1048576, dir }'
