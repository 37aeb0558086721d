#!/usr/bin/env bash
# Main job. Until the GSM8K example lands this runs the vocab-parallel benchmark:
#   bash scripts/main.sh [benchmark args, e.g. --tokens 1024 --tp 1 2]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/_env.sh
source scripts/_env.sh

ensure_venv .venv 3.12 requirements/py312.txt

exec .venv/bin/python benchmarks/bench_vocab_parallel.py "$@"
