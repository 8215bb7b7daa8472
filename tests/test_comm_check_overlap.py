"""The agreement check overlapping the staging of a repeated all-reduce.

A call made before (its plan cached) starts the check, stages this rank's
data (packing a bucket, copying an array into the shared window), and only
then waits for the check. These tests pin down that order, and that
mismatches, timeouts and errors while staging still end the same way on
every rank, with the communicator left usable where it was before.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm import communicator as communicator_module
from mpistrat.comm.communicator import RankCommunicator
from mpistrat.comm.options import CommunicationOptions
from mpistrat.comm.safety import CollectiveMismatchError, CollectiveTimeoutError
from mpistrat.comm.shm_allreduce import ShmAllreduceBackend

# name -> the arrays of one call: one array on the reduce-scatter path (above
# the one-synchronisation size), one small array, a fused list of ten.
CALLS = {
    "one 1 MiB array": lambda fill: [np.full(1 << 18, fill, np.float32)],
    "one 4 KiB array": lambda fill: [np.full(1024, fill, np.float32)],
    "ten small arrays": lambda fill: [np.full(100 + i, fill, np.float64) for i in range(10)],
}


@pytest.fixture
def shm_rc(comm):
    c = RankCommunicator(comm, CommunicationOptions(implementation="SHM"))
    assert isinstance(c._host_backends[0], ShmAllreduceBackend)
    yield c
    c.close()


def _record_order(rc: RankCommunicator, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Events ``"staged"`` (data packed into a backend buffer) and ``"checked"`` (check finished)."""
    events: list[str] = []
    guard, backend = rc._guard, rc._host_backends[0]
    finish, pack_buffer = guard.finish, backend.pack_buffer

    def recorded_finish():
        events.append("checked")
        return finish()

    def recorded_pack_buffer(count, dtype):
        events.append("staged")
        return pack_buffer(count, dtype)

    monkeypatch.setattr(guard, "finish", recorded_finish)
    monkeypatch.setattr(backend, "pack_buffer", recorded_pack_buffer)
    return events


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", list(CALLS))
def test_a_repeated_call_stages_its_data_before_waiting_for_the_check(shm_rc, call, monkeypatch):
    events = _record_order(shm_rc, monkeypatch)
    for n in range(3):
        arrays = CALLS[call](shm_rc.rank + 1.0)
        out = shm_rc.allreduce(arrays, "sum")
        expected = shm_rc.size * (shm_rc.size + 1) / 2
        assert all(np.array_equal(o, np.full_like(a, expected)) for o, a in zip(out, arrays))
        if n == 0:  # first time: checked, then planned and staged
            assert events[:2] == ["checked", "staged"], events
        else:  # planned before: staged while the check travels
            assert events[:2] == ["staged", "checked"], events
        events.clear()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", list(CALLS))
def test_a_mismatch_on_repeated_calls_raises_on_every_rank(shm_rc, call):
    rc = shm_rc
    for op in ("sum", "max", "sum", "max"):  # both calls planned on every rank
        rc.allreduce(CALLS[call](1.0), op)
    op = "max" if rc.rank == 0 else "sum"
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce op.*rank 0 sent op=max"):
        rc.allreduce(CALLS[call](1.0), op)
    # A planned call on some ranks, a new shape on the last: the same error everywhere.
    arrays = CALLS[call](1.0)
    if rc.rank == rc.size - 1:
        arrays = arrays + [np.ones(3, arrays[0].dtype)]
    with pytest.raises(CollectiveMismatchError, match=r"array counts"):
        rc.allreduce(arrays, "sum")
    assert not rc._guard.started
    out = rc.allreduce(CALLS[call](rc.rank + 1.0), "max")  # still usable, and right
    assert all(np.all(o == rc.size) for o in out)


@pytest.mark.mpi(min_size=2)
def test_an_error_while_staging_finishes_the_check_on_every_rank(shm_rc, monkeypatch):
    rc = shm_rc
    arrays = CALLS["ten small arrays"](1.0)
    rc.allreduce(arrays, "sum")

    def failing_pack(*args, **kwargs):
        raise RuntimeError("staging failed")

    monkeypatch.setattr(communicator_module, "pack", failing_pack)
    with pytest.raises(RuntimeError, match="staging failed"):
        rc.allreduce(arrays, "sum")
    assert not rc._guard.started, "the check must not stay open"
    monkeypatch.undo()
    out = rc.allreduce(CALLS["ten small arrays"](rc.rank + 1.0), "sum")
    assert all(np.all(o == rc.size * (rc.size + 1) / 2) for o in out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_late_rank_on_a_repeated_call_times_out_the_waiting_ranks(shm_rc):
    rc, late = shm_rc, 1
    opts = CommunicationOptions(timeout_seconds=1.0)
    arrays = CALLS["one 1 MiB array"](1.0)
    rc.allreduce(arrays, "sum", opts)
    if rc.rank == late:
        time.sleep(3.0)  # past the others' timeout and grace period
    with pytest.raises(CollectiveTimeoutError) as info:
        rc.allreduce(arrays, "sum", opts)
    if rc.rank != late:
        assert info.value.missing_ranks == [late] and "rank 1 never arrived" in str(info.value)
    assert not rc._guard.started
    MPI.COMM_WORLD.Barrier()
