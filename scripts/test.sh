#!/usr/bin/env bash
# The project's one test command:  bash scripts/test.sh [extra pytest args]
#
#  0. lint:               .venv/bin/ruff check on the package, examples/ and benchmarks/
#                         (rules in pyproject.toml [tool.ruff])
#  1. primary run:        .venv       (Python 3.12, requirements/py312.txt, and
#                         requirements/py312-nodeps.txt with --no-deps: verl), all of tests/unit
#  2. compatibility run:  .venv-py311 (Python 3.11, requirements/py311.txt), tests/unit -m megatron
#
# Exit 0 only if ruff passes, the primary run passes (exit 5 = no tests
# collected counts as a failure: the project always has tests) and the compat
# run passes or collects nothing (exit 5). Extra arguments go to both pytest
# runs (not to ruff).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/_env.sh
source scripts/_env.sh

ensure_venv .venv 3.12 requirements/py312.txt
ensure_venv .venv-py311 3.11 requirements/py311.txt

report_dir="$(mktemp -d)"
trap 'rm -rf -- "$report_dir"' EXIT

RUFF_PATHS=(megatron_vocabstats examples benchmarks)
ruff_rc=0
.venv/bin/ruff check "${RUFF_PATHS[@]}" || ruff_rc=$?

primary_rc=0
.venv/bin/python -m pytest tests/unit --junitxml="$report_dir/primary.xml" "$@" || primary_rc=$?
compat_rc=0
.venv-py311/bin/python -m pytest tests/unit -m megatron --junitxml="$report_dir/compat.xml" "$@" || compat_rc=$?

ruff_ok=0
[[ $ruff_rc -eq 0 ]] && ruff_ok=1
primary_ok=0
[[ $primary_rc -eq 0 ]] && primary_ok=1
compat_ok=0
[[ $compat_rc -eq 0 || $compat_rc -eq 5 ]] && compat_ok=1

# Counts from the JUnit reports: "passed failed skipped" (failed includes errors).
counts() {
    .venv/bin/python - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("0 0 0")
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
failed = n["failures"] + n["errors"]
print(n["tests"] - failed - n["skipped"], failed, n["skipped"])
PY
}
read -r p_pass p_fail p_skip < <(counts "$report_dir/primary.xml")
read -r c_pass c_fail c_skip < <(counts "$report_dir/compat.xml")

status() { if [[ $2 -eq 1 ]]; then echo "ok (exit $1)"; else echo "FAILED (exit $1)"; fi; }
overall=PASS
[[ $ruff_ok -eq 1 && $primary_ok -eq 1 && $compat_ok -eq 1 ]] || overall=FAIL
echo
echo "test.sh: $overall | ruff: $(status "$ruff_rc" "$ruff_ok") | primary py3.12: $(status "$primary_rc" "$primary_ok"), $p_pass passed, $p_fail failed, $p_skip skipped | compat py3.11 -m megatron: $(status "$compat_rc" "$compat_ok"), $c_pass passed, $c_fail failed, $c_skip skipped"
# Last line in the plain 'N passed, N failed, N skipped' form, totals of both runs.
echo "summary: $((p_pass + c_pass)) passed, $((p_fail + c_fail)) failed, $((p_skip + c_skip)) skipped"

[[ $overall == PASS ]]
