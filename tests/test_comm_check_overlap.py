"""The agreement check overlapping the staging of a repeated all-reduce.

A call made before (its plan cached) on host buckets of at most 4 MiB starts
the check, stages this rank's data (packing a bucket, copying an array into
the shared window), and only then waits for the check. These tests pin down
that order and its limits, and that mismatches, timeouts, late ranks and
errors while staging still end the same way on every rank, with the
communicator left usable where it was before.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm import CollectiveMismatchError, CollectiveTimeoutError, CommunicationOptions, RankCommunicator, Transport
from mpistrat.comm import fusion
from mpistrat.comm.agreement import call
from mpistrat.comm.transport import table
from mpistrat.comm.transport.mpi import MpiTransport
from mpistrat.comm.transport.shm.allreduce import ShmTransport
from mpistrat.ops import mpi_op

# name -> the arrays of one call: one array on the reduce-scatter path (above
# the one-synchronisation size), one small array, a fused list of ten.
CALLS = {
    "one 1 MiB array": lambda fill: [np.full(1 << 18, fill, np.float32)],
    "one 4 KiB array": lambda fill: [np.full(1024, fill, np.float32)],
    "ten small arrays": lambda fill: [np.full(100 + i, fill, np.float64) for i in range(10)],
}


@pytest.fixture
def shm_rc(comm, monkeypatch):
    # These tests see the order through the Python path's hooks; the compiled reduce-scatter (one C call)
    # has none, and test_repeat_scatter.py watches its order from a peer.
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "0")
    c = RankCommunicator(comm, CommunicationOptions(implementation="SHM"))
    assert isinstance(c.transports[0], ShmTransport)
    yield c
    c.close()


def _record_order(rc: RankCommunicator, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Events ``"staged"`` (data packed into a backend buffer) and ``"checked"`` (the check's wait begins:
    ``finish``, or ``check_aux``, where a folded check posts and completes its round in one call)."""
    events: list[str] = []
    guard, backend = rc._guard, rc.transports[0]
    finish, check_aux, pack_buffer = guard.finish, guard.check_aux, backend.pack_buffer

    def recorded_finish():
        events.append("checked")
        return finish()

    def recorded_check_aux(*args, **kwargs):
        events.append("checked")
        return check_aux(*args, **kwargs)

    def recorded_pack_buffer(count, dtype):
        events.append("staged")
        return pack_buffer(count, dtype)

    monkeypatch.setattr(guard, "finish", recorded_finish)
    monkeypatch.setattr(guard, "check_aux", recorded_check_aux)
    monkeypatch.setattr(backend, "pack_buffer", recorded_pack_buffer)
    return events


def _pack_slowly(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make this rank's packing of a bucket (staging, between start and finish of the check) slow."""
    pack = fusion.pack

    def pack_slowly(*args, **kwargs):
        time.sleep(seconds)
        return pack(*args, **kwargs)

    monkeypatch.setattr(fusion, "pack", pack_slowly)


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

    monkeypatch.setattr(fusion, "pack", failing_pack)
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


@pytest.mark.mpi(min_size=2)
def test_a_repeated_call_above_the_overlap_limit_checks_before_staging(shm_rc, monkeypatch):
    events = _record_order(shm_rc, monkeypatch)
    count = (call.OVERLAP_MAX_BYTES + (1 << 20)) // 4  # float32, above the limit
    for _ in range(2):
        out = shm_rc.allreduce([np.full(count, 1.0, np.float32)], "sum")
        assert np.all(out[0] == shm_rc.size)
        assert events[:2] == ["checked", "staged"], events
        events.clear()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_rank_past_its_deadline_after_staging_tells_the_late_peer(shm_rc, monkeypatch):
    # Rank 0 starts the check (advertising a deadline 1 s later) and stages for 1.5 s; rank 1
    # arrives after that deadline and expects a verdict from rank 0: RESOLVED, since the
    # collective completes. Everyone gets the right result and the communicator stays usable.
    rc = shm_rc
    opts = CommunicationOptions(timeout_seconds=1.0)
    arrays = CALLS["ten small arrays"](rc.rank + 1.0)
    rc.allreduce(arrays, "sum", opts)
    if rc.rank == 0:
        _pack_slowly(monkeypatch, 1.5)
    else:
        time.sleep(1.2)
    out = rc.allreduce(arrays, "sum", opts)
    monkeypatch.undo()
    assert all(np.all(o == rc.size * (rc.size + 1) / 2) for o in out)
    assert rc.allreduce(arrays, "sum", opts)[0][0] == rc.size * (rc.size + 1) / 2


class _ForgetfulTransport(MpiTransport):
    """Never tells its agreement hook that it staged (a bug the communicator must catch)."""

    name = "forgetful"

    def allreduce_array(self, src, dst, op, hook):
        self.comm.Allreduce(src, dst, mpi_op(op))


class _NotATransport:
    """Has the methods but does not subclass the contract."""

    name = "impostor"

    def __init__(self, ctx):
        pass


@pytest.fixture
def registered(monkeypatch):
    def register(name, factory):
        monkeypatch.setattr(table, "FACTORIES", dict(table.FACTORIES))
        monkeypatch.setattr(table, "PREFERENCES", dict(table.PREFERENCES))
        table.register_transport(name, factory, ("AUTO",))

    return register


@pytest.mark.mpi(min_size=2)
def test_a_factory_that_returns_no_transport_is_refused(comm, registered):
    registered("impostor", _NotATransport)
    with pytest.raises(TypeError, match="transport factory 'impostor' returned _NotATransport, not a Transport"):
        RankCommunicator(comm)


def test_a_transport_missing_a_verb_cannot_be_made():
    class Half(Transport):  # only enabled() given
        name = "half"

        def enabled(self, nbytes, dtype, op):
            return True

    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.mpi(min_size=2)
def test_a_transport_that_never_calls_its_hook_is_caught_on_every_rank(comm, registered):
    registered("forgetful", lambda ctx: _ForgetfulTransport(ctx.comm))
    rc = RankCommunicator(comm)
    try:
        assert type(rc.transports[0]) is _ForgetfulTransport
        rc.allreduce([np.ones(1000)], "sum")  # first call: checked before, as always
        with pytest.raises(RuntimeError, match="_ForgetfulTransport never called its agreement hook"):
            rc.allreduce([np.ones(1000)], "sum")
        assert not rc._guard.started
        # Every rank raised, and the communicator is still usable.
        assert rc.allreduce([np.ones(3)], "max")[0].tolist() == [1, 1, 1]
    finally:
        rc.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_peer_deadline_passing_while_a_rank_stages_ends_alike_on_both(comm, monkeypatch):
    # Rank 1 waits in the check; rank 0 starts 0.2 s before rank 1's deadline and stages for 1.5 s
    # without polling. Rank 1 either completes in time (no verdict) or times out (it queries rank 0,
    # then abandons): rank 0 must see which, so both succeed or both raise, never one waiting alone.
    pair = comm.Split(0 if comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    if pair == MPI.COMM_NULL:
        return
    rc = RankCommunicator(pair, CommunicationOptions(implementation="SHM"))
    try:
        opts = CommunicationOptions(timeout_seconds=1.0)
        arrays = CALLS["ten small arrays"](rc.rank + 1.0)
        rc.allreduce(arrays, "sum", opts)
        if rc.rank == 0:
            time.sleep(0.8)
            _pack_slowly(monkeypatch, 1.5)
        try:
            out = rc.allreduce(arrays, "sum", opts)
            outcome = "ok" if all(np.all(o == 3.0) for o in out) else "wrong"
        except CollectiveTimeoutError:
            outcome = "timeout"
        monkeypatch.undo()
        outcomes = pair.allgather(outcome)
        assert outcomes in (["ok", "ok"], ["timeout", "timeout"]), outcomes
    finally:
        rc.close()
        pair.Free()
