# Sourced by tests/gpu/run.sh and tests/gpu/fetch_wheels.sh: ROOT, the repository root, made the
# working directory, and PY, the interpreter: PYTHON if set, else .venv/bin/python if present,
# else python3 (a device machine's, which holds torch), else python.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
elif command -v python3 >/dev/null; then
  PY=python3
else
  PY=python
fi
