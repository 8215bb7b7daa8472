"""Test-suite wiring: MPI failure handling and GPU skips.

Under mpiexec with several ranks, a test that fails on one rank would leave the
other ranks waiting in a collective. So when an MPI-marked test fails on any
rank, that rank prints its report (prefixed with the rank) and aborts the whole
job with MPI_Abort: the command fails at once with that rank's message instead
of hanging. pytest-timeout bounds every test as a second line of defence, and
scripts/test.sh bounds every run with ``timeout``. Set MPISTRAT_TEST_NO_ABORT=1
to let failures go on (for debugging a single rank).
"""

from __future__ import annotations

import os
import sys

import pytest

from mpistrat.devices import num_gpus


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def pytest_runtest_logreport(report):
    if not report.failed or os.environ.get("MPISTRAT_TEST_NO_ABORT") == "1":
        return
    if "mpi" not in report.keywords:
        return
    world = _world()
    if world.Get_size() < 2:
        return
    text = f"\n[rank {world.Get_rank()}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    sys.stdout.flush()
    from mpistrat.comm.runtime.abort import abort_world  # noqa: PLC0415 - MPICH leaves /dev/shm files at a bare Abort

    abort_world(1)


def pytest_collection_modifyitems(config, items):
    gpus = None
    for item in items:
        if "gpu" in item.keywords:
            if gpus is None:
                gpus = num_gpus()
            need = item.get_closest_marker("gpu").kwargs.get("min_gpus", 1)
            if gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s) visible to CuPy, found {gpus}"))


@pytest.fixture
def comm():
    """COMM_WORLD (the ranks this test runs on)."""
    return _world()
