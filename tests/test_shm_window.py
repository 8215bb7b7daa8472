"""Shared-memory windows: segments, synchronisation, timeouts, lifetime."""

from __future__ import annotations

import os
import time
import warnings
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm.runtime.waiter import OVERSUBSCRIBED_YIELDS, SLEEP_SECONDS, Waiter, pause, reads_clock
from mpistrat.comm.runtime.shm_window import PAGE_SIZE, CounterSync, SharedWindow, make_sync


@pytest.fixture
def node():
    c = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    yield c
    c.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["barrier", "counter"])
def test_segments_visible_to_peers(node, kind):
    w = SharedWindow(node, 1000)
    s = make_sync(w, kind)
    try:
        assert w.nbytes % PAGE_SIZE == 0 and w.nbytes >= 1000
        for r in range(w.size):
            assert w.segment(r).ctypes.data % PAGE_SIZE == 0
            assert w.segment(r).nbytes == w.nbytes
        assert not w.segment(w.rank).any(), "pre-faulted segment must start zeroed"
        for epoch in range(1, 101):
            mine = w.view(w.rank, np.int64, 8, 4)
            mine[:] = epoch * 1000 + w.rank
            s.wait()
            seen = [int(w.view(r, np.int64, 8, 4)[3]) for r in range(w.size)]
            assert seen == [epoch * 1000 + r for r in range(w.size)]
            s.wait()  # nobody writes the next epoch before all have read this one
    finally:
        s.free()
        w.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("yields", [None, OVERSUBSCRIBED_YIELDS])
def test_counter_sync_timeout_names_missing_ranks(node, yields):
    w = SharedWindow(node, 64)
    s = CounterSync(w, waiter=Waiter(0, yields), timeout=0.3, rank_names=[100 + r for r in range(w.size)])
    try:
        if w.rank == 0:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"\[101"):
                s.wait()
            assert time.monotonic() - t0 < 5
        node.Barrier()
        if w.rank != 0:
            s.wait()  # catch up: rank 0's counter already holds this epoch
        s.wait()  # everyone in step again
    finally:
        s.free()
        w.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_counter_sync_sleeps_after_its_yields(node):
    """With ``yields`` set, a rank waiting for a late peer sleeps between polls instead of yielding
    on (a yield does not always hand over the CPU: polling), so it burns little CPU while it waits."""
    w = SharedWindow(node, 64)
    s = CounterSync(w, waiter=Waiter(0, OVERSUBSCRIBED_YIELDS), timeout=30)
    late = 0.4
    try:
        s.wait()
        if w.rank == 1:
            time.sleep(late)
        cpu, wall = time.thread_time(), time.monotonic()
        s.wait()
        cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
        if w.rank != 1:
            assert wall >= late * 0.9, "the peer was late: this rank must have waited for it"
            assert cpu < 0.5 * wall, f"{cpu:.3f} s of CPU in a {wall:.3f} s wait: it polled without sleeping"
    finally:
        s.free()
        w.free()


def test_pause_spins_then_yields_then_sleeps():
    """``pause``: nothing for ``spin`` polls, a yield for the next ``yields``, then a sleep of at least
    ``SLEEP_SECONDS``; with ``yields=None`` never a sleep. A sleep blocks: it is the one pause that
    counts a voluntary context switch (a yield leaves the thread runnable)."""
    import resource

    def blocked(polls, spin, yields, repeat=20):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        for _ in range(repeat):
            pause(polls, spin, yields)
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before

    assert blocked(5, 10, 2) == 0, "within spin: no pause"
    assert blocked(12, 10, 2) == 0, "within the yields: no sleep"
    assert blocked(10_000, 10, None) == 0, "yields=None: never a sleep"
    assert blocked(13, 10, 2) == 20, "past spin + yields: every poll sleeps"
    # A wait with a timeout reads the clock at its first pause, every 1024th, and at every sleep.
    assert [p for p in range(11, 3000) if reads_clock(p, 10, None)] == [11, 1024, 2048]
    assert [p for p in range(11, 20) if reads_clock(p, 10, 2)] == [11, 13, 14, 15, 16, 17, 18, 19]
    t = time.perf_counter()
    pause(13, 10, 2)
    assert time.perf_counter() - t >= SLEEP_SECONDS


@pytest.mark.mpi(min_size=2)
def test_free_releases_window_and_refuses_views(node):
    w = SharedWindow(node, 4096)
    ref = weakref.ref(w.segment(0))
    w.free()
    assert w.win == MPI.WIN_NULL
    assert ref() is None
    with pytest.raises(RuntimeError, match="closed"):
        w.segment(0)
    w.free()  # idempotent


@pytest.mark.mpi(min_size=2)
def test_free_keeps_memory_while_a_view_lives(node):
    w = SharedWindow(node, 4096)
    held = w.view(0, np.int32, 0, 4) if w.rank == 1 else None
    if w.rank == 0:
        w.view(0, np.int32, 0, 4)[:] = 7
    w.sync()
    node.Barrier()
    w.sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w.free()
    assert any(issubclass(c.category, ResourceWarning) for c in caught), "every rank must be warned"
    assert w.win != MPI.WIN_NULL, "memory must stay mapped while a view lives"
    if held is not None:
        assert held.tolist() == [7, 7, 7, 7]
    del held


def test_bad_arguments():
    with pytest.raises(ValueError, match="nbytes"):
        SharedWindow(MPI.COMM_SELF, -1)
    w = SharedWindow(MPI.COMM_SELF, 100)
    try:
        with pytest.raises(ValueError, match="unknown node synchronisation"):
            make_sync(w, "fence")
        with pytest.raises(ValueError, match="does not fit"):
            w.view(0, np.float64, 0, w.nbytes)
        with pytest.raises(ValueError, match="does not fit"):
            w.view(0, np.float64, 4, 1)
    finally:
        w.free()


_EXIT_SCRIPT = """
import atexit, sys
def check():  # registered first, so it runs after mpistrat's exit hooks
    from mpistrat.comm.runtime import shm_window
    from mpi4py import MPI
    print("open", len(shm_window._OPEN), "freed", backend_win[0] == MPI.WIN_NULL, "finalized", MPI.Is_finalized())
atexit.register(check)
import numpy as np
from mpi4py import MPI
from mpistrat.comm.transport.shm.allreduce import ShmTransport
b = ShmTransport(MPI.COMM_WORLD, min_bytes=0)
b.pack_buffer(100, np.float32)[:] = 1
result = b.allreduce_packed(100, np.float32, "sum")
assert result.sum() == 100
backend_win = [b._window.win]
del result
"""


def test_windows_freed_at_exit_before_finalize(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit_free.py"
    script.write_text(_EXIT_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "open 0 freed True finalized False" in out.stdout, out.stdout + out.stderr


def test_no_collective_free_after_an_uncaught_exception(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit_raise.py"
    script.write_text(
        "import atexit, importlib\n"
        "atexit.register(lambda: print('still open', len(importlib.import_module('mpistrat.comm.runtime.shm_window')._OPEN)))\n"
        "from mpi4py import MPI\n"
        "from mpistrat.comm.transport.shm.allreduce import ShmTransport\n"
        "b = ShmTransport(MPI.COMM_WORLD, min_bytes=0)\n"
        "b.pack_buffer(10, 'float32')\n"
        "raise RuntimeError('boom')\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "boom" in out.stderr
    assert "still open 2" in out.stdout, out.stdout + out.stderr


_OVERSUBSCRIPTION_SCRIPT = """
import os
from mpi4py import MPI
from mpistrat.comm.runtime.waiter import ranks_outnumber_cores
machine = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
os.write(1, f"outnumber={ranks_outnumber_cores(machine)}\\n".encode())  # one write: lines never interleave
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 cores")
@pytest.mark.parametrize("binding", ["core", "none"])
def test_ranks_outnumber_cores_counts_the_cores_of_all_ranks(tmp_path, binding):
    """Ranks bound one to a core each see one core apiece but are not oversubscribed; one rank more
    than the cores is, bound or not."""
    import subprocess
    import sys

    from mpirun import clean_env, mpiexec

    script = tmp_path / "outnumber.py"
    script.write_text(_OVERSUBSCRIPTION_SCRIPT)
    cores = len(os.sched_getaffinity(0))
    for ranks, expected in ((min(cores, 4), False), (cores + 1, True)):
        if binding == "core" and ranks > cores:
            continue  # the launchers refuse to bind more ranks than cores
        out = subprocess.run([mpiexec(), "--bind-to", binding, "-n", str(ranks), sys.executable, str(script)],
                             capture_output=True, text=True, timeout=60, env=clean_env())
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.split() == [f"outnumber={expected}"] * ranks, (ranks, out.stdout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_segments_of_different_sizes_are_mapped_whole():
    """Rank 0 allocates more than a page and the others nothing: every rank sees rank 0's table (a
    view sized by the local segment raised on rank 0 and left the others waiting)."""
    comm = MPI.COMM_WORLD
    win = SharedWindow(comm, 3 * PAGE_SIZE if comm.rank == 0 else 0)
    try:
        table = win.view(0, np.int64, 0, 3 * PAGE_SIZE // 8)
        if comm.rank == 0:
            table[-1] = 42
        win.sync()
        comm.Barrier()
        win.sync()
        assert table[-1] == 42
        with pytest.raises(ValueError, match=f"rank 1's {PAGE_SIZE}-byte segment"):
            win.view(1, np.int64, 0, PAGE_SIZE // 8 + 1)
        del table
    finally:
        win.free()
