"""A real single-node Slurm cluster for tests, started from nothing.

Use the ``slurm_cluster`` fixture (import it into a test module:
``from slurm import slurm_cluster  # noqa: F401``) and mark tests
``@pytest.mark.slurm``. The fixture:

1. installs Slurm with apt-get when ``slurmctld``/``slurmd``/``srun`` are
   missing (``apt-get update`` too when the package lists lack it; every step
   is announced on the terminal, and all of it must end within
   ``MPISTRAT_SLURM_INSTALL_BUDGET`` seconds, default 480),
2. writes a private ``slurm.conf`` in a fresh temporary directory (free ports,
   ``auth/none``, one node named after this host advertising 8 CPUs so
   ``-n 4`` runs on 2 cores, one partition ``debug``), starts ``slurmctld``
   and ``slurmd`` in the foreground as children of this process (they die
   with it) and waits until the node is ``idle``,
3. stops both daemons and removes the directory when the test session ends.

It skips, with the reason, only when Slurm is absent and cannot be installed
(not root, no apt-get, or apt-get failed: its output is in the reason). A
cluster that is installed but does not come up is an error, not a skip.
Clusters of concurrent test sessions do not interfere (own ports, own files,
own ``SLURM_CONF``). Set ``MPISTRAT_SLURM_KEEP=1`` to keep the directory
(logs) after the session.

For job-template tests: ``cluster.sbatch(path_or_text, "--nodes=1", ...)``
submits with ``--wait`` and returns the job id, exit code and output;
``cluster.srun([...], ntasks=2)`` runs a step; ``cluster.env`` is the
environment (``SLURM_CONF``, the venv first on ``PATH``) for any other
command, ``cluster.run([...])`` runs one with it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pytest

__all__ = ["SlurmCluster", "SlurmUnavailable", "BatchResult", "ensure_slurm", "get_cluster", "slurm_cluster"]

PACKAGES = ["slurmctld", "slurmd", "slurm-client"]
BINARIES = ["/usr/sbin/slurmctld", "/usr/sbin/slurmd", "srun", "sbatch", "sinfo", "scontrol"]
# Seconds that installing may take in all (apt-get install, update, install again).
INSTALL_BUDGET = float(os.environ.get("MPISTRAT_SLURM_INSTALL_BUDGET", "480"))
START_TIMEOUT = 60.0
INSTALL_LOCK = "/tmp/mpistrat-slurm-install.lock"


class SlurmUnavailable(Exception):
    """Slurm is not installed and cannot be installed here (the message says why)."""


def _stderr(msg: str) -> None:
    sys.stderr.write(f"[slurm fixture] {msg}\n")
    sys.stderr.flush()


def _have_binaries() -> bool:
    return all(shutil.which(b) or os.access(b, os.X_OK) for b in BINARIES)


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _apt(args: Sequence[str], deadline: float, log: Callable[[str], None]) -> subprocess.CompletedProcess:
    timeout = max(1, int(deadline - time.monotonic()))
    cmd = ["apt-get", "-o", f"DPkg::Lock::Timeout={timeout}", *args]
    log(f"running: {' '.join(cmd)} (time left {timeout} s)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise SlurmUnavailable(f"'{' '.join(cmd)}' did not finish in {timeout} s "
                               f"(MPISTRAT_SLURM_INSTALL_BUDGET={INSTALL_BUDGET:.0f} s in all)") from exc


def ensure_slurm(log: Callable[[str], None] = _stderr) -> None:
    """Install Slurm's daemons and client with apt-get unless present.

    Raises SlurmUnavailable (with the reason) when it cannot be installed.
    """
    if _have_binaries():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("Slurm is not installed and installing it needs root (apt-get)")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("Slurm is not installed and there is no apt-get to install it")
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time across test sessions
        if _have_binaries():
            return
        t0 = time.monotonic()
        deadline = t0 + INSTALL_BUDGET
        install = ["install", "-y", "--no-install-recommends", *PACKAGES]
        result = _apt(install, deadline, log)
        if result.returncode != 0:
            log("install from the current package lists failed; updating them first")
            update = _apt(["update"], deadline, log)
            if update.returncode != 0:
                raise SlurmUnavailable(f"apt-get update failed:\n{_tail(update.stdout + update.stderr)}")
            result = _apt(install, deadline, log)
        if result.returncode != 0 or not _have_binaries():
            raise SlurmUnavailable(
                f"apt-get install {' '.join(PACKAGES)} failed (exit {result.returncode}):\n"
                f"{_tail(result.stdout + result.stderr)}"
            )
        log(f"Slurm installed in {time.monotonic() - t0:.1f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child before exec
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class BatchResult:
    """A finished batch job: id, exit code of ``sbatch --wait``, output file text."""

    job_id: str
    returncode: int
    output: str
    stderr: str


class SlurmCluster:
    """A private single-node Slurm cluster under ``root`` (see the module docstring)."""

    def __init__(self, root: str | Path | None = None, log: Callable[[str], None] = _stderr):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="mpistrat-slurm-"))
        self.log = log
        self.hostname = socket.gethostname().split(".")[0]
        self.partition = "debug"
        self.conf = self.root / "slurm.conf"
        self._procs: dict[str, subprocess.Popen] = {}
        bindir = os.path.dirname(sys.executable)
        self.env = dict(os.environ, SLURM_CONF=str(self.conf),
                        PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":
                del self.env[key]

    # ---------------------------------------------------------------- lifecycle
    def _write_conf(self) -> None:
        for sub in ("state", "spool", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if self.conf.exists():
            return  # keep the ports of a cluster that may be running
        r = self.root
        self.conf.write_text(f"""\
# Written by mpistrat tests/slurm.py: a private single-node test cluster.
ClusterName=mpistrat
SlurmctldHost={self.hostname}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SlurmdParameters=config_overrides
MailProg=/bin/true
ReturnToService=2
KillWait=5
# sbatch --wait sleeps 2 s, then 4x longer while below MinJobAge/2 (2, 8, 32 s with the
# default 300): MinJobAge=5 keeps it polling every 2 s. Finished jobs leave scontrol after 5 s.
MinJobAge=5
InactiveLimit=0
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
NodeName={self.hostname} NodeAddr=127.0.0.1 CPUs=8 RealMemory=1024 State=UNKNOWN
PartitionName={self.partition} Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP
""")

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def node_state(self) -> str:
        """``sinfo``'s state of the node (``idle``, ``alloc``, ...), "" when unreachable."""
        try:
            out = self.run(["sinfo", "-h", "-o", "%t"], timeout=15)
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    def start(self) -> "SlurmCluster":
        """Start the daemons and wait until the node is idle; a no-op when running."""
        if self._alive() and self.node_state():
            return self
        self.stop(remove=False)
        self._write_conf()
        self.log(f"starting slurmctld and slurmd (config {self.conf})")
        t0 = time.monotonic()
        for name in ("slurmctld", "slurmd"):
            out = open(self.root / f"{name}.stdout", "ab")
            cmd = [f"/usr/sbin/{name}", "-D", "-f", str(self.conf)]
            if name == "slurmctld":
                cmd.append("-c")  # clear state from an earlier start in this directory
            self._procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
            out.close()
        state = ""
        while time.monotonic() - t0 < START_TIMEOUT:
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Slurm daemon(s) {dead} exited at start:\n{self.logs()}")
            state = self.node_state()
            if state.rstrip("*") == "idle":
                self.log(f"cluster up in {time.monotonic() - t0:.1f} s (node {self.hostname}, partition "
                         f"{self.partition})")
                return self
            time.sleep(0.3)
        raise RuntimeError(f"Slurm node not idle after {START_TIMEOUT:.0f} s (state {state!r}):\n{self.logs()}")

    def logs(self, n: int = 20) -> str:
        """The last lines of the daemons' logs."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.stdout", "slurmd.stdout"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name} ---\n{_tail(path.read_text(errors='replace'), n)}")
        return "\n".join(parts)

    def stop(self, remove: bool = True) -> None:
        """Stop the daemons this object started; remove the directory unless told not to."""
        if self._procs:
            with contextlib.suppress(Exception):
                self.run(["scancel", "--full", "--quiet", "--partition", self.partition], timeout=10)
            for proc in self._procs.values():
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + 10
            for proc in self._procs.values():
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._procs.clear()
        if remove and os.environ.get("MPISTRAT_SLURM_KEEP") != "1":
            shutil.rmtree(self.root, ignore_errors=True)

    # ---------------------------------------------------------------- commands
    def run(self, args: Sequence[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run a command with the cluster's environment (text output captured)."""
        kw.setdefault("env", self.env)
        kw.setdefault("capture_output", True)
        kw.setdefault("cwd", str(self.root / "jobs") if (self.root / "jobs").exists() else None)
        return subprocess.run(list(args), text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)

    def srun(self, args: Sequence[str], ntasks: int = 1, *options: str, mpi: str = "pmi2",
             timeout: float = 120) -> subprocess.CompletedProcess:
        """``srun -n ntasks --mpi=pmi2 [options] args`` (a job step of its own)."""
        cmd = ["srun", f"--ntasks={ntasks}", f"--mpi={mpi}", "--time=5", *options, *args]
        return self.run(cmd, timeout=timeout)

    def mpi_plugin(self) -> str | None:
        """The ``srun --mpi`` plugin that connects this interpreter's MPI to Slurm, or None: ``pmi2`` for
        MPICH; Open MPI 5 needs ``pmix``, which this Slurm offers only where its PMIx library loads."""
        if not hasattr(self, "_mpi_plugin"):
            from mpi4py import MPI

            plugin: str | None = "pmi2"
            if "Open MPI" in MPI.Get_library_version():
                ok = self.run(["srun", "--ntasks=1", "--mpi=pmix", "--time=1", "true"], timeout=60).returncode == 0
                plugin = "pmix" if ok else None
            self._mpi_plugin = plugin
        return self._mpi_plugin

    def sbatch(self, script: str | Path, *options: str, timeout: float = 300) -> BatchResult:
        """Submit a batch script (a path, or the script's text) with ``--wait``."""
        path = Path(script) if not str(script).lstrip().startswith("#!") else None
        if path is None:
            path = Path(tempfile.mkstemp(suffix=".sh", dir=self.root / "jobs")[1])
            path.write_text(str(script))
        output = self.root / "jobs" / "job-%j.out"
        cmd = ["sbatch", "--wait", "--parsable", f"--output={output}", f"--chdir={self.root / 'jobs'}",
               "--time=5", *options, str(path)]
        result = self.run(cmd, timeout=timeout)
        job_id = result.stdout.strip().split(";")[0].splitlines()[0] if result.stdout.strip() else ""
        out_file = self.root / "jobs" / f"job-{job_id}.out"
        text = out_file.read_text(errors="replace") if job_id and out_file.exists() else ""
        return BatchResult(job_id=job_id, returncode=result.returncode, output=text, stderr=result.stderr)


_CLUSTER: SlurmCluster | None = None
_UNAVAILABLE: str | None = None


def get_cluster(log: Callable[[str], None] = _stderr) -> SlurmCluster:
    """The process's one cluster, installed and started on first use (stopped at exit)."""
    global _CLUSTER, _UNAVAILABLE
    if _UNAVAILABLE is not None:
        raise SlurmUnavailable(_UNAVAILABLE)
    if _CLUSTER is None:
        try:
            ensure_slurm(log)
        except SlurmUnavailable as exc:
            _UNAVAILABLE = str(exc)
            raise
        _CLUSTER = SlurmCluster(log=log)
        atexit.register(_CLUSTER.stop)
    _CLUSTER.log = log
    return _CLUSTER.start()


@pytest.fixture(scope="session")
def slurm_cluster(request) -> SlurmCluster:
    """A running single-node Slurm cluster (skips only when Slurm cannot be installed)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def log(msg: str) -> None:
        ctx = capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()
        with ctx:
            _stderr(msg)

    try:
        cluster = get_cluster(log)
    except SlurmUnavailable as exc:
        pytest.skip(f"Slurm cannot be installed here: {exc}")
    yield cluster
    cluster.log = _stderr
    cluster.stop()
