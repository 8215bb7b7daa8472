"""Exit cases of issue 24: a rank that exits, returns, is killed or stalls; the rank table and the one-line summary."""

import os
import re
import socket
import time

import pytest
from mpi4py import MPI

from mpirun import clean_env, run_job, wait_for_no_leftovers
from mpistrat.comm.errors import CollectiveTimeoutError, PeerExitedError
from mpistrat.comm.runtime import abort

# The last rank does CASE at step 2 (after two all-reduces); the others go on to the third all-reduce.
PROGRAM = '''
import os, signal, sys, time
import numpy as np
import mpistrat as ms

case = sys.argv[1]
strategy = ms.MultiWorkerMirroredStrategy()
ctx = strategy.extended
last = ctx._worker_index == ctx._num_workers - 1


def main():
    for step in range(4):
        if last and step == 2:
            if case == "os_exit0": os._exit(0)
            if case == "os_exit3": os._exit(3)
            if case == "sys_exit2": sys.exit(2)
            if case == "return": return
            if case == "sigkill": os.kill(os.getpid(), signal.SIGKILL)
            if case == "stall": time.sleep(3600)
        strategy.run(lambda: ms.get_replica_context().all_reduce(ms.ReduceOp.SUM, np.ones(4)))
    print("rank done", flush=True)


main()
'''
LIMIT = 40.0  # a hang fails the test (the cases below end in 1-6 s on an idle 2-core VM)
TABLE_ROW = re.compile(r"^\[mpistrat\] rank (\d+): host (\S+) PID (\d+)$", re.MULTILINE)
SUMMARY = re.compile(r"^\[mpistrat\] job summary from rank (\d+), the lowest surviving: (.*)$", re.MULTILINE)


def _run(tmp_path, case, ranks, **extra):
    script = tmp_path / "exit_program.py"
    script.write_text(PROGRAM)
    env = clean_env(MPISTRAT_TIMEOUT_SECONDS="2", MPISTRAT_PRINT_RANKS="1", **extra)
    start = time.monotonic()
    job = run_job([str(script), case], ranks, LIMIT, env)
    elapsed = time.monotonic() - start
    assert wait_for_no_leftovers(job.tag) == [], job.output
    table = {int(r): (host, int(pid)) for r, host, pid in TABLE_ROW.findall(job.output)}
    assert sorted(table) == list(range(ranks)), job.output  # MPISTRAT_PRINT_RANKS=1: one row per rank
    return job, table, elapsed


@pytest.mark.parametrize(("case", "ranks"), [("sys_exit2", 2), ("return", 4)])
def test_early_exit_gives_one_summary_naming_the_rank_and_its_pid(tmp_path, case, ranks):
    job, table, elapsed = _run(tmp_path, case, ranks)
    assert job.returncode != 0, job.output
    summaries = SUMMARY.findall(job.output)
    assert len(summaries) == 1, job.output  # from the lowest surviving rank only
    last = ranks - 1
    host, pid = table[last]
    assert summaries[0][0] == "0"
    assert summaries[0][1].startswith(f"rank {last} (host {host}, PID {pid}) exited without joining collective #3 "
                                      "(allreduce(op=sum) [(4,), float64]) (PeerExitedError)"), job.output
    # one traceback in all (the summary's rank); every other survivor prints its error in one line
    assert job.output.count("Traceback (most recent call last)") == 1, job.output
    for r in range(1, last):
        assert f"[rank {r}] (traceback and summary on rank 0)" in job.output
    assert "rank done" not in job.output
    assert elapsed < 20, elapsed


def test_stalled_rank_is_named_by_the_summary_after_the_timeout(tmp_path):
    job, table, elapsed = _run(tmp_path, "stall", 2)
    assert job.returncode != 0, job.output
    host, pid = table[1]
    (summary,) = SUMMARY.findall(job.output)
    assert summary[1].startswith(f"rank 1 (host {host}, PID {pid}) never arrived at collective #3"), job.output
    assert "(CollectiveTimeoutError)" in summary[1]
    assert "ended through os._exit" in job.output  # the timeout says a silent rank may be dead
    assert elapsed < 25, elapsed


def test_sigkilled_rank_is_found_through_the_rank_table(tmp_path):
    job, table, _ = _run(tmp_path, "sigkill", 2)
    assert job.returncode != 0, job.output
    # The launcher names the killed process by PID only; the table says which rank it was.
    m = re.search(r"PID (\d+) RUNNING AT", job.output)
    if m:  # MPICH's hydra prints it; other launchers word it otherwise
        assert int(m.group(1)) == table[1][1], job.output


def test_os_exit_ends_the_job_without_a_hang(tmp_path):
    # os._exit runs no exit hook, so no peer is told: the launcher ends the job (documented in
    # docs/reliability.md). A non-zero code is passed on; os._exit(0) at 2 ranks ends with 0 (MPICH).
    job, _, elapsed = _run(tmp_path, "os_exit3", 2)
    assert job.returncode != 0, job.output
    assert "rank done" not in job.output
    assert elapsed < 20, elapsed


def test_no_table_unless_asked(tmp_path):
    script = tmp_path / "exit_program.py"
    script.write_text(PROGRAM)
    job = run_job([str(script), "none"], 2, LIMIT, clean_env())
    assert job.returncode == 0, job.output
    assert job.output.count("rank done") == 2
    assert not TABLE_ROW.search(job.output)
    assert not SUMMARY.search(job.output)


def test_summary_in_process():
    saved = list(abort._RANK_TABLE)
    try:
        table = abort.record_ranks(MPI.COMM_SELF)
        assert table == [(socket.gethostname(), os.getpid())]
        abort._RANK_TABLE[:] = [*table, ("node7", 4242)]  # as if this process were rank 0 of two
        gone = PeerExitedError("x", exited_ranks=[1], collective="#5 (allreduce(op=sum) [(2,), float32])")
        assert abort.missing_peer_summary(gone) == (
            "[mpistrat] job summary from rank 0, the lowest surviving: rank 1 (host node7, PID 4242) exited without "
            "joining collective #5 (allreduce(op=sum) [(2,), float32]) (PeerExitedError); ending the job with exit "
            "code 1")
        late = CollectiveTimeoutError("x", missing_ranks=[1], collective="#5 (barrier)")
        assert "rank 1 (host node7, PID 4242) never arrived at collective #5 (barrier)" in abort.missing_peer_summary(late)
        abort._RANK_TABLE[:] = [("node7", 4242), *table]  # this process is rank 1 of two: rank 0 reports, not us
        assert abort.missing_peer_summary(CollectiveTimeoutError("x", missing_ranks=[2])) is None
        assert abort.missing_peer_summary(ValueError("not a missing peer")) is None
    finally:
        abort._RANK_TABLE[:] = saved
