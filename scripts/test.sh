#!/usr/bin/env bash
# The project's one test command:  bash scripts/test.sh [extra pytest args]
#
# A version matrix of three legs (requirements/<leg>.txt pins each; scripts/_env.sh builds it):
#
#   leg      venv          Python  torch   Triton  megatron-core  runs
#   primary  .venv         3.12    2.15.0  3.9.0   0.19.2         all of tests/unit, lint (ruff)
#   oldest   .venv-py311   3.11    2.11.0  3.6.0   0.16.1         -m "versioned or megatron" (+ verl,
#                                                                  SkyRL, AReaL, Megatron-Bridge)
#   py313    .venv-py313   3.13    2.14.1  3.8.0   0.19.2         -m versioned
#
# "versioned" marks the test files whose outcome can change with the Python, torch, Triton or
# megatron-core version (tests/unit/conftest.py lists them, each with its reason); the rest test
# our own arithmetic and checks through torch operations whose results the float64 references
# bound on any torch, and run once, on the primary leg. tests/README.md says more.
#
# The primary leg runs its pytest on 2 workers (pytest-xdist, whole files per worker); the other
# legs' venvs are built in the background meanwhile. Exit 0 only if ruff passes and every leg
# passes (a leg that collects no test fails: exit 5). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/_env.sh
source scripts/_env.sh

t_start=$SECONDS
report_dir="$(mktemp -d)"
bg_pid=""
cleanup() {
    [[ -n "$bg_pid" ]] && kill "$bg_pid" 2>/dev/null || true
    rm -rf -- "$report_dir"
}
trap cleanup EXIT

ensure_venv .venv 3.12 requirements/py312.txt

# The other legs' venvs, built while the primary leg runs (network and disk, mostly).
(
    rc=0
    ensure_venv .venv-py311 3.11 requirements/py311.txt >"$report_dir/venv-oldest.log" 2>&1 || rc=1
    echo $rc >"$report_dir/venv-oldest.rc"
    rc=0
    ensure_venv .venv-py313 3.13 requirements/py313.txt >"$report_dir/venv-py313.log" 2>&1 || rc=1
    echo $rc >"$report_dir/venv-py313.rc"
) &
bg_pid=$!

RUFF_PATHS=(megatron_vocabstats examples benchmarks)
ruff_rc=0
.venv/bin/ruff check "${RUFF_PATHS[@]}" || ruff_rc=$?

declare -A leg_rc leg_time
run_leg() {  # run_leg NAME VENV [pytest selection args...] -- then "$@" of this script
    local name="$1" venv="$2" t0=$SECONDS
    shift 2
    echo
    echo "== leg $name: $("$venv/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"
    leg_rc[$name]=0
    "$venv/bin/python" -m pytest tests/unit --junitxml="$report_dir/$name.xml" "$@" || leg_rc[$name]=$?
    leg_time[$name]=$((SECONDS - t0))
}

run_leg primary .venv -n 2 --dist loadfile "$@"
wait "$bg_pid" || true  # each venv's outcome is in its .rc file
bg_pid=""
for leg in oldest py313; do
    if [[ "$(cat "$report_dir/venv-$leg.rc" 2>/dev/null)" != 0 ]]; then
        echo "test.sh: building the $leg leg's venv failed:" >&2
        cat "$report_dir/venv-$leg.log" >&2
        leg_rc[$leg]=1
        leg_time[$leg]=0
    else
        cat "$report_dir/venv-$leg.log" >&2
    fi
done
[[ ${leg_rc[oldest]:-0} -eq 0 ]] && run_leg oldest .venv-py311 -n 2 --dist loadfile -m "versioned or megatron" "$@"
[[ ${leg_rc[py313]:-0} -eq 0 ]] && run_leg py313 .venv-py313 -n 2 --dist loadfile -m versioned "$@"

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

overall=PASS
[[ $ruff_rc -eq 0 ]] || overall=FAIL
line="ruff: $([[ $ruff_rc -eq 0 ]] && echo ok || echo "FAILED (exit $ruff_rc)")"
t_pass=0 t_fail=0 t_skip=0
for leg in primary oldest py313; do
    read -r p f s < <(counts "$report_dir/$leg.xml")
    t_pass=$((t_pass + p)) t_fail=$((t_fail + f)) t_skip=$((t_skip + s))
    rc=${leg_rc[$leg]:-1}
    state="ok"
    [[ $rc -eq 0 ]] || { state="FAILED"; overall=FAIL; }
    line+=" | $leg: $state (exit $rc, ${leg_time[$leg]:-0} s), $p passed, $f failed, $s skipped"
done
echo
echo "test.sh: $overall | $line | total $((SECONDS - t_start)) s"
# Last line in the plain 'N passed, N failed, N skipped' form, totals of every leg.
echo "summary: $t_pass passed, $t_fail failed, $t_skip skipped"

[[ $overall == PASS ]]
