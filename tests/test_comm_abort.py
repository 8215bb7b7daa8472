"""Abort-on-exception: one rank's uncaught exception ends the whole job (subprocess mpiexec)."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from mpirun import mpich_shm_files

from mpistrat.comm.runtime import abort

BOUND_SECONDS = 30


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPI_", "HYDRA_", "OMPI_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env.update(extra)
    return env


def _mpiexec():
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return exe if os.path.exists(exe) else shutil.which("mpiexec")


SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    from mpistrat.comm.communicator import RankCommunicator
    c = RankCommunicator()
    c.barrier()
    if c.rank == 1:
        if sys.argv[1] == "thread":
            t = threading.Thread(target=lambda: 1 / 0, name="worker")
            t.start(); t.join()
            time.sleep(60)
        elif sys.argv[1] == "exit":
            sys.exit(3)
        raise ValueError("rank one failed on purpose")
    c.allreduce([np.ones(3)], "sum")  # the others wait here (600 s default timeout)
    """
)


# A training script that never mentions the hook: the strategy installs it.
STRATEGY_SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import mpistrat as ms
    s = ms.MultiWorkerMirroredStrategy()
    def step():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            raise ValueError("replica one failed on purpose")
        return ctx.all_reduce("sum", np.ones(3))  # the others wait here (600 s default timeout)
    s.run(step)
    """
)


def _run(tmp_path, mode, *, runner=("-m", "mpistrat.run"), env=None, ranks=2, script_text=SCRIPT):
    if _mpiexec() is None:
        pytest.skip("no mpiexec")
    script = tmp_path / "job.py"
    script.write_text(script_text)
    start = time.monotonic()
    proc = subprocess.run(
        [_mpiexec(), "-n", str(ranks), sys.executable, *runner, str(script), mode],
        capture_output=True, text=True, timeout=BOUND_SECONDS + 30, env=env or _clean_env(),
    )
    return proc, time.monotonic() - start


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [2, 4])
def test_exception_on_one_rank_aborts_job_with_its_traceback(tmp_path, ranks):
    proc, elapsed = _run(tmp_path, "raise", ranks=ranks)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < BOUND_SECONDS, (elapsed, out)
    assert "[rank 1] Traceback (most recent call last):" in out, out
    assert "[rank 1] ValueError: rank one failed on purpose" in out, out
    assert f"aborting all {ranks} ranks" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ranks", [2, 4])
def test_strategy_program_aborts_on_one_ranks_exception(tmp_path, ranks):
    """Plain ``python script.py`` (no ``mpistrat.run``): MultiWorkerMirroredStrategy installs the hook."""
    proc, elapsed = _run(tmp_path, "", runner=(), ranks=ranks, script_text=STRATEGY_SCRIPT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < BOUND_SECONDS, (elapsed, out)
    assert "[rank 1] ValueError: replica one failed on purpose" in out, out
    assert f"aborting all {ranks} ranks" in out, out


@pytest.mark.timeout(120)
def test_exception_in_a_thread_aborts_job(tmp_path):
    proc, elapsed = _run(tmp_path, "thread")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < BOUND_SECONDS, (elapsed, out)
    assert "[rank 1] ZeroDivisionError: division by zero" in out and "in thread 'worker'" in out, out


@pytest.mark.timeout(120)
def test_nonzero_exit_on_one_rank_aborts_job(tmp_path):
    proc, elapsed = _run(tmp_path, "exit")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and elapsed < BOUND_SECONDS, (elapsed, out)
    assert "[rank 1] exited with status 3" in out, out


def test_hook_can_be_disabled(monkeypatch):
    monkeypatch.setenv("MPISTRAT_NO_ABORT_HOOK", "1")
    before = sys.excepthook
    assert abort.install_abort_on_exception() is False
    assert sys.excepthook is before


def test_run_usage_errors():
    proc = subprocess.run([sys.executable, "-m", "mpistrat.run"], capture_output=True, text=True,
                          timeout=60, env=_clean_env())
    assert proc.returncode == 2 and "usage: python -m mpistrat.run" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_aborted_job_leaves_no_mpich_shared_memory_file(tmp_path):
    """MPICH unlinks its /dev/shm files at MPI_Finalize, not at MPI_Abort; the abort path does it."""
    from mpi4py import MPI

    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("MPICH's shared memory files: another MPI library names its own")
    before = mpich_shm_files()
    proc, _ = _run(tmp_path, "raise", ranks=2)
    assert proc.returncode != 0 and "aborting all 2 ranks" in proc.stderr + proc.stdout
    after = mpich_shm_files()
    assert not (after - before), f"left in /dev/shm: {sorted(after - before)}"
    # the contrast, so the assertion above can fail: a bare MPI_Abort leaves one
    bare = tmp_path / "bare.py"
    bare.write_text("from mpi4py import MPI\nif MPI.COMM_WORLD.rank == 1:\n    MPI.COMM_WORLD.Abort(1)\n"
                    "MPI.COMM_WORLD.Barrier()\n")
    subprocess.run([_mpiexec(), "-n", "2", sys.executable, str(bare)], capture_output=True, timeout=60,
                   env=_clean_env())
    leaked = mpich_shm_files() - after
    for name in leaked:  # do not leave it behind ourselves
        os.unlink(os.path.join("/dev/shm", name))
    assert leaked, "a bare MPI_Abort no longer leaves a file: the workaround may be obsolete"
