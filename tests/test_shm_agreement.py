"""The agreement check through node shared memory, and the check folded into the window's first sync.

On one node the guard gathers its check through :class:`ShmAllgather`
(``MPISTRAT_AGREEMENT=mpi`` keeps the MPI all-gather; CI runs the guard's
tests under both). A repeated all-reduce on the shared-memory backend posts
the check only after staging its data; when every rank did so (the aux bit
``STAGED_FIRST``), the check stands for the backend's first synchronisation.
"""

import random
import time

import numpy as np
import pytest

from mpistrat import config
from mpistrat.comm import CollectiveMismatchError, CommunicationOptions, RankCommunicator
from mpistrat.comm.agreement.call import check_aux, require_same_pack
from mpistrat.comm.agreement.guard import AgreementGuard
from mpistrat.comm.agreement.shm_allgather import ShmAllgather
from mpistrat.comm.transport.shm.allreduce import ShmTransport

AGREEMENT_ENV = "MPISTRAT_AGREEMENT"


@pytest.mark.parametrize("text, wanted", [("", True), ("auto", True), (" MPI ", False), ("mpi", False)])
def test_the_setting_is_read_from_the_environment(monkeypatch, text, wanted):
    monkeypatch.setenv(AGREEMENT_ENV, text)
    assert (config.settings().agreement == "auto") is wanted


def test_an_unknown_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(AGREEMENT_ENV, "nvlink")
    with pytest.raises(ValueError, match=r"MPISTRAT_AGREEMENT must be one of auto, mpi, got 'nvlink'"):
        config.settings()


def test_the_aux_carries_the_bucket_size_and_whether_every_rank_staged_first():
    both = np.array([check_aux(1 << 20, True), check_aux(1 << 20, True)])
    assert require_same_pack(both) is True
    one_late = np.array([check_aux(1 << 20, True), check_aux(1 << 20, False)])
    assert require_same_pack(one_late) is False
    with pytest.raises(CollectiveMismatchError, match=r"rank 0: 1048576; rank 1: 4096"):
        require_same_pack(np.array([check_aux(1 << 20, True), check_aux(4096, True)]))


# ---------------------------------------------------------------- the transport choice


@pytest.mark.mpi(min_size=2)
def test_one_node_checks_through_shared_memory_unless_told_otherwise(comm, monkeypatch):
    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    guard = AgreementGuard(comm)
    try:
        assert guard.transport == "shm" and isinstance(guard._persistent, ShmAllgather)
    finally:
        guard.close()
    if comm.rank == 1:  # one rank asking for MPI is enough: the choice is agreed
        monkeypatch.setenv(AGREEMENT_ENV, "mpi")
    guard = AgreementGuard(comm)
    try:
        assert guard.transport == "mpi" and not isinstance(guard._persistent, ShmAllgather)
        out = guard.check(("probe", (), ()), 10.0, aux=comm.rank + 1)
        assert list(out) == list(range(1, comm.size + 1))
    finally:
        guard.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_a_bad_setting_on_one_rank_raises_on_every_rank(comm, monkeypatch):
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(AGREEMENT_ENV, "sometimes")
    with pytest.raises(ValueError, match="MPISTRAT_AGREEMENT") as info:
        RankCommunicator(comm)
    if comm.rank != comm.size - 1:
        assert f"failed on rank(s) [{comm.size - 1}]" in str(info.value)
    monkeypatch.undo()
    with RankCommunicator(comm) as rc:  # nothing left half-made: the next one works
        assert rc.allreduce([np.ones(3)], "sum")[0][0] == comm.size


# ---------------------------------------------------------------- ShmAllgather itself


@pytest.fixture
def gather(comm):
    send = np.zeros(3, np.int64)
    recv = np.zeros(3 * comm.size, np.int64)
    g = ShmAllgather(comm, send, recv)
    yield g, send, recv.reshape(comm.size, 3)
    g.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_every_round_gathers_every_ranks_values_whatever_the_pace(comm, gather):
    g, send, recv = gather
    rng = random.Random(comm.rank)
    for k in range(1, 301):
        if rng.random() < 0.1:
            time.sleep(rng.random() * 2e-3)  # ranks drift: a peer up to one round ahead
        send[:] = (1000 * comm.rank + k, k, -comm.rank)
        g.Start()
        while not g.Test():
            pass
        expected = [(1000 * r + k, k, -r) for r in range(comm.size)]
        assert [tuple(row) for row in recv] == expected, f"round {k}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_a_round_is_incomplete_until_the_last_rank_posts(comm, gather):
    g, send, recv = gather
    last = comm.size - 1
    send[:] = comm.rank
    if comm.rank != last:
        g.Start()
        with pytest.raises(RuntimeError, match="round 1 has not completed"):
            g.Start()  # a second round before the first completed: a peer may still read the slot
    if comm.rank == 0:
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            assert not g.Test(), "complete before the last rank posted"
    comm.Barrier()  # rank 0 has seen the round incomplete
    if comm.rank == last:
        g.Start()
    while not g.Test():
        pass
    assert list(recv[:, 0]) == list(range(comm.size))


# ---------------------------------------------------------------- the fold


@pytest.fixture
def shm_rc(comm, monkeypatch):
    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    c = RankCommunicator(comm, CommunicationOptions(implementation="SHM"))
    assert c._guard.transport == "shm" and isinstance(c.transports[0], ShmTransport)
    yield c
    c.close()


def _count_syncs(rc: RankCommunicator, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the shared-memory backend's node synchronisations: its waits, and the epochs
    the compiled reduce-scatter (``_lane.scatter``) posts itself (``CounterSync.advance``)."""
    sync = rc.transports[0]._sync
    wait, advance, counter = sync.wait, getattr(sync, "advance", None), [0]

    def counted(*args, **kwargs):
        counter[0] += 1
        return wait(*args, **kwargs)

    def advanced(waits: int) -> None:
        counter[0] += waits
        advance(waits)

    monkeypatch.setattr(sync, "wait", counted)
    if advance is not None:
        monkeypatch.setattr(sync, "advance", advanced)
    return counter


CALLS = {  # name -> the arrays of one call (fill value)
    "fused list": lambda fill: [np.full(1024, fill, np.float32) for _ in range(20)],
    "one 64 KiB array": lambda fill: [np.full(1 << 14, fill, np.float32)],
    "one 4 MiB array": lambda fill: [np.full(1 << 20, fill, np.float32)],
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", list(CALLS))
def test_folded_calls_give_exact_sums_while_ranks_race(shm_rc, call):
    # Ranks reuse the window's two buckets in turn: with the check as the first synchronisation a
    # fast rank must still never overwrite a bucket a slow one reads. Values change every call.
    rng = random.Random(shm_rc.rank)
    n = shm_rc.size
    for k in range(60):
        if rng.random() < 0.2:
            time.sleep(rng.random() * 2e-3)
        arrays = CALLS[call](float(shm_rc.rank + k))
        out = shm_rc.allreduce(arrays, "sum")
        expected = n * k + n * (n - 1) / 2
        assert all(np.all(o == expected) for o in out), f"call {k}"


def _syncs_in_three_calls(rc: RankCommunicator, call: str, monkeypatch: pytest.MonkeyPatch) -> int:
    rc.allreduce(CALLS[call](1.0), "sum")  # planned, window grown, chunks settled
    with monkeypatch.context() as patch:
        syncs = _count_syncs(rc, patch)
        for _ in range(3):
            assert rc.allreduce(CALLS[call](1.0), "sum")[0][0] == rc.size
    return syncs[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["fused list", "one 64 KiB array", "one 4 MiB array"])
def test_the_check_replaces_the_first_synchronisation_only_when_every_rank_staged(shm_rc, call, monkeypatch):
    rc = shm_rc
    with monkeypatch.context() as patch:
        patch.setenv(AGREEMENT_ENV, "mpi")
        with RankCommunicator(rc.comm, CommunicationOptions(implementation="SHM")) as unfolded:
            assert unfolded._guard.transport == "mpi"
            expected = _syncs_in_three_calls(unfolded, call, monkeypatch)
    folded = _syncs_in_three_calls(rc, call, monkeypatch)
    assert rc.comm.allgather((folded, expected)) == [(expected - 3, expected)] * rc.size
    if call == "one 64 KiB array":
        # Rank 0 cannot stage before the check (as when its window must grow): every rank syncs.
        if rc.rank == 0:
            monkeypatch.setattr(rc.transports[0], "_staged_without_collectives", lambda count, dtype: False)
        assert rc.comm.allgather(_syncs_in_three_calls(rc, call, monkeypatch)) == [expected] * rc.size


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_on_a_folded_call_raises_everywhere_and_leaves_it_usable(shm_rc):
    rc = shm_rc
    for _ in range(2):
        rc.allreduce(CALLS["fused list"](1.0), "sum")
    arrays = CALLS["fused list"](1.0)
    if rc.rank == 1:
        arrays[3] = np.ones(1025, np.float32)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce shapes.*rank 1 sent"):
        rc.allreduce(arrays, "sum")
    out = rc.allreduce(CALLS["fused list"](rc.rank + 1.0), "sum")
    assert all(np.all(o == rc.size * (rc.size + 1) / 2) for o in out)


@pytest.mark.mpi(min_size=4)
def test_a_guard_on_a_sub_communicator_checks_through_its_own_table(comm, monkeypatch):
    # Two guards at once (world and pairs), interleaved: each gathers only its own ranks.
    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    half = comm.Split(comm.rank % 2, comm.rank)
    try:
        with RankCommunicator(comm) as world, RankCommunicator(half) as sub:
            assert world._guard.transport == "shm" == sub._guard.transport
            for k in range(20):
                assert world.allreduce([np.full(4, float(k))], "sum")[0][0] == comm.size * k
                got = sub.allreduce([np.full(4, float(comm.rank))], "sum")[0][0]
                assert got == sum(r for r in range(comm.size) if r % 2 == comm.rank % 2)
    finally:
        half.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_check_interrupted_while_waiting_breaks_the_guard(comm, monkeypatch):
    # The round stays open on the interrupted rank (its peers may complete it and move on): going on
    # would put it one call behind them for good, so every later call on it raises instead.
    from mpistrat.comm.errors import CommunicatorBrokenError

    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    guard = AgreementGuard(comm)
    try:
        if comm.rank == 0:
            def interrupted(*args):
                raise KeyboardInterrupt

            monkeypatch.setattr(guard, "_wait", interrupted)
            with pytest.raises(KeyboardInterrupt):
                guard.check(("step", (), ()), 10.0)
            assert guard.broken and "interrupted on rank 0" in guard.broken
            with pytest.raises(CommunicatorBrokenError, match="interrupted"):
                guard.check(("step", (), ()), 10.0)
        else:
            time.sleep(0.3)  # rank 0 waits for us, and is interrupted meanwhile
            guard.check(("step", (), ()), 10.0)
    finally:
        guard.broken = guard.broken or "test over: rank 0 broke"  # no collective clean-up with rank 0 gone
        guard.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_close_survives_a_bad_grace_setting_on_one_rank(comm, monkeypatch):
    rc = RankCommunicator(comm)
    assert rc.allreduce([np.ones(2)], "sum")[0][0] == comm.size
    if comm.rank == 1:
        monkeypatch.setenv("MPISTRAT_TIMEOUT_GRACE_SECONDS", "soon")
    rc.close()  # every rank gets through the collective clean-up
    assert comm.allgather(rc._closed) == [True] * comm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_after_an_interrupted_folded_call_the_peers_get_right_sums_or_errors_never_wrong_ones(comm, monkeypatch):
    # Rank 1 staged and posted its check, then was interrupted while waiting; its peers complete that
    # call with its data. Its next calls must raise before staging over the data they still read.
    from mpistrat.comm.errors import CollectiveTimeoutError, CommunicatorBrokenError

    monkeypatch.delenv(AGREEMENT_ENV, raising=False)
    rc = RankCommunicator(comm, CommunicationOptions(implementation="SHM", timeout_seconds=2))
    try:
        def data(v):
            return [np.full(1024, float(v))]

        for _ in range(2):
            rc.allreduce(data(1), "sum")  # planned: the next calls fold
        guard = rc._guard
        if comm.rank == 1:
            wait = guard._wait

            def interrupted(*args):
                guard._wait = wait
                raise KeyboardInterrupt

            guard._wait = interrupted
            with pytest.raises(KeyboardInterrupt):
                rc.allreduce(data(10), "sum")
            with pytest.raises(CommunicatorBrokenError, match="interrupted on rank 1"):
                rc.allreduce(data(1000), "sum")
        else:
            time.sleep(0.3)  # rank 1 waits for us in its check, and is interrupted there
            expected = 10 + sum(r + 1 for r in range(comm.size) if r != 1)
            assert rc.allreduce(data(comm.rank + 1), "sum")[0][0] == expected
            with pytest.raises(CollectiveTimeoutError, match="rank 1"):
                rc.allreduce(data(1), "sum")
    finally:
        rc.close()  # every guard is broken by now: local clean-up only
