"""Agreement checks and timeouts: errors on every rank naming the ranks, never a hang."""

import gc
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicationOptions,
    CommunicatorBrokenError,
    RankCommunicator,
)
from mpistrat.comm.runtime import lifetime
from mpistrat.comm.agreement.signatures import describe_call, fingerprint, format_mismatch


@pytest.fixture
def rc(comm):
    c = RankCommunicator(comm)
    yield c
    c.close()


def test_fingerprint_is_stable_and_distinguishes():
    a = ("allreduce", (("op", "sum"),), (((4,), "<f4"),))
    assert fingerprint(a) == fingerprint(("allreduce", (("op", "sum"),), (((4,), "<f4"),)))
    assert fingerprint(a) != fingerprint(("allreduce", (("op", "sum"),), (((5,), "<f4"),)))
    assert -(2**62) <= fingerprint(a) < 2**62
    assert describe_call(a) == "allreduce(op=sum) [(4,), float32]"


def test_format_mismatch_messages():
    k = lambda op, arrays: ("allreduce", (("op", op),), arrays)  # noqa: E731
    msg = format_mismatch([k("sum", (((4,), "<f4"),)), k("sum", (((5,), "<f4"),)), k("sum", (((4,), "<f4"),))], 3)
    assert msg == "Mismatched allreduce shapes in collective #3: ranks 0, 2 sent [(4,), float32]; rank 1 sent [(5,), float32]"
    msg = format_mismatch([k("sum", (((4,), "<f4"),)), k("max", (((4,), "<f4"),))], 1)
    assert msg.startswith("Mismatched allreduce op in collective #1: rank 0 sent op=sum; rank 1 sent op=max")
    many = tuple(((i,), "<f8") for i in range(50))
    other = many[:20] + (((20,), "<f4"),) + many[21:]
    msg = format_mismatch([k("sum", many), k("sum", other)], 2)
    assert "dtypes" in msg and "#20" in msg and "float32" in msg and "float64" in msg
    msg = format_mismatch([("barrier", (), ()), k("sum", many[:1])], 9)
    assert msg.startswith("Mismatched collectives in collective #9: rank 0 called barrier; rank 1 called allreduce")


def _raises_everywhere(fn, error, *patterns):
    with pytest.raises(error) as info:
        fn()
    text = str(info.value)
    for p in patterns:
        assert re.search(p, text), (p, text)
    return info.value


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_dtypes_ops_counts(rc):
    r, last = rc.rank, rc.size - 1
    shape = (5,) if r == last else (4,)
    _raises_everywhere(lambda: rc.allreduce([np.zeros(shape, np.float32)], "sum"), CollectiveMismatchError,
                       rf"Mismatched allreduce shapes", rf"rank {last} sent \[\(5,\), float32\]", r"ranks? 0\b")
    dtype = np.float64 if r == 0 else np.float32
    _raises_everywhere(lambda: rc.allreduce([np.zeros(3, dtype)], "sum"), CollectiveMismatchError,
                       r"Mismatched allreduce dtypes", r"rank 0 sent \[\(3,\), float64\]")
    op = "max" if r == 0 else "sum"
    _raises_everywhere(lambda: rc.allreduce([np.zeros(3)], op), CollectiveMismatchError,
                       r"Mismatched allreduce op", r"rank 0 sent op=max")
    count = 3 if r == last else 2
    _raises_everywhere(lambda: rc.allreduce([np.zeros(2)] * count, "sum"), CollectiveMismatchError,
                       r"array counts", rf"rank {last} sent 3 arrays")
    # The communicator stays usable after a mismatch.
    assert rc.allreduce([np.ones(2)], "sum")[0].tolist() == [rc.size] * 2


@pytest.mark.mpi(min_size=2)
def test_mismatched_kinds_roots_and_local_errors(rc):
    r = rc.rank
    if r == 0:
        fn = lambda: rc.broadcast([np.zeros(2)], root=0)  # noqa: E731
    else:
        fn = lambda: rc.allreduce([np.zeros(2)], "sum")  # noqa: E731
    _raises_everywhere(fn, CollectiveMismatchError, r"Mismatched collectives", r"rank 0 called broadcast")
    _raises_everywhere(lambda: rc.broadcast([np.zeros(2)], root=r), CollectiveMismatchError, r"broadcast root")
    # A bad input on one rank only: a mismatch naming it, on every rank.
    item = "oops" if r == 1 else np.zeros(2)
    _raises_everywhere(lambda: rc.allreduce([item], "sum"), CollectiveMismatchError,
                       r"rank 1 sent error=TypeError: allreduce: item #0 is a str")
    # The same bad input everywhere: the local error, on every rank.
    _raises_everywhere(lambda: rc.allreduce([np.zeros(2, bool)], "sum"), TypeError, r"dtype bool")
    _raises_everywhere(lambda: rc.allgather(np.zeros((2, 3)), axis=2), ValueError, r"axis 2 is out of range")
    shape = (2, 3) if r == 0 else (2, 4)
    _raises_everywhere(lambda: rc.allgather(np.zeros(shape)), CollectiveMismatchError, r"Mismatched allgather shapes")
    assert rc.allgather_object(r) == list(range(rc.size))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_timeout_names_the_missing_rank(rc):
    late = 1
    opts = CommunicationOptions(timeout_seconds=1.0)
    if rc.rank == late:
        time.sleep(3.0)  # busy in Python, past the others' timeout and grace period
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        rc.allreduce([np.ones(4, np.float32)], "sum", opts)
    waited = time.monotonic() - start
    text = str(info.value)
    if rc.rank == late:
        assert info.value.abandoned_by == [r for r in range(rc.size) if r != late]
        assert "was abandoned before rank 1 arrived" in text
        assert waited < 10  # bounded: the verdict wait is grace-limited
    else:
        assert info.value.missing_ranks == [late]
        assert "rank 1 never arrived" in text and "did not answer" in text and "timeout_seconds=1" in text
        assert 1.0 <= waited < 10
    with pytest.raises(CommunicatorBrokenError, match="timed out earlier"):
        rc.barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_timeout_names_a_rank_waiting_elsewhere(comm):
    # Rank 1 waits in a different communicator's collective: it answers and says where.
    a, b = RankCommunicator(comm), RankCommunicator(comm)
    opts = CommunicationOptions(timeout_seconds=1.0)
    if comm.rank == 1:
        b.barrier(CommunicationOptions(timeout_seconds=20))  # completes when the others come
        with pytest.raises(CollectiveTimeoutError, match="abandoned"):
            a.step_agreement(1, opts)
    else:
        with pytest.raises(CollectiveTimeoutError) as info:
            a.step_agreement(0, opts)
        b.barrier()
        text = str(info.value)
        assert f"rank 1 is waiting in collective #1 of communicator #{b._guard.index} (barrier)" in text, text
        assert info.value.missing_ranks == [1]
    a.close()
    b.close()


@pytest.mark.mpi(min_size=2)
def test_step_agreement_respects_timeout_per_call(rc):
    # The agreement also works when ranks arrive at different times within the timeout.
    if rc.rank == 0:
        time.sleep(0.3)
    codes = rc.step_agreement(rc.rank, CommunicationOptions(timeout_seconds=5))
    assert codes.tolist() == list(range(rc.size))


@pytest.mark.mpi(min_size=2)
def test_close_while_a_peer_is_in_a_collective(comm):
    c = RankCommunicator(comm)
    if comm.rank == 0:
        fn = lambda: c.allreduce([np.ones(2)], "sum")  # noqa: E731
    else:
        fn = c.close
    _raises_everywhere(fn, CollectiveMismatchError, r"rank 0 called allreduce", r"called close")
    if comm.rank == 0:
        c.close()  # the communicator is done for everyone: no collective clean-up, no hang
    with pytest.raises(CommunicatorBrokenError):
        c._guard.check(("barrier", (), ()), 1.0)
    # Dropped broken, on rank 1 without a finished close(): cleaned up locally at once, not left
    # filed for a collective release the other ranks (which closed it) would never join.
    filed = lifetime.dropped_count()
    c = fn = None  # drop it (the lambda above holds it too)
    gc.collect()
    assert lifetime.dropped_count() == filed


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_arrival_within_grace_period_completes_everywhere(comm, monkeypatch):
    # Rank 1 arrives after the others' timeout but within their grace period:
    # they see the collective complete, send RESOLVED, and everyone goes on.
    monkeypatch.setenv("MPISTRAT_TIMEOUT_GRACE_SECONDS", "2.5")  # read when the communicator is made
    with RankCommunicator(comm) as rc:
        if rc.rank == 1:
            time.sleep(1.5)
        out = rc.allreduce([np.full(3, rc.rank + 1.0)], "sum", CommunicationOptions(timeout_seconds=1.0))
        np.testing.assert_array_equal(out[0], np.full(3, rc.size * (rc.size + 1) / 2))
        assert rc.step_agreement(rc.rank).tolist() == list(range(rc.size))  # still usable


@pytest.mark.mpi(min_size=3)
def test_guards_have_one_index_on_all_ranks_after_guards_on_some_ranks(comm):
    # Timeout reports name peers' collectives by guard index: ranks that made more guards (here on a
    # pair of ranks) must not make the next guard over all ranks look like another communicator.
    pair = comm.Split(0 if comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    if pair != MPI.COMM_NULL:
        RankCommunicator(pair).close()
        pair.Free()
    c = RankCommunicator(comm)
    try:
        assert len(set(comm.allgather(c._guard.index))) == 1
    finally:
        c.close()


@pytest.mark.mpi(min_size=2)
def test_different_bytes_per_pack_raise_on_every_rank(rc):
    # Buckets cut at different sizes would mean different collective calls: a hang or a wrong sum.
    arrays = [np.full(100, rc.rank + 1.0) for _ in range(8)]
    mine = CommunicationOptions(bytes_per_pack=800 * (2 if rc.rank == 0 else 1))
    same = CommunicationOptions(bytes_per_pack=800)
    for options in (mine, same, same):  # the second time, after the plan was cached
        rc.allreduce(arrays, "sum", same)
        _raises_everywhere(lambda: rc.allreduce(arrays, "sum", mine), CollectiveMismatchError,
                           r"Mismatched allreduce bytes_per_pack", r"rank 0: 1600; rank 1: 800")
    out = rc.allreduce(arrays, "sum", same)
    assert all(np.all(o == rc.size * (rc.size + 1) / 2) for o in out)


@pytest.mark.mpi(min_size=2)
def test_different_bytes_per_pack_in_broadcast_raise_on_every_rank(rc):
    # Broadcast fuses its arrays too: buckets cut at different sizes would mean different Bcast calls.
    arrays = [np.full(100, float(rc.rank)) for _ in range(8)]
    mine = CommunicationOptions(bytes_per_pack=800 * (2 if rc.rank == 0 else 1))
    same = CommunicationOptions(bytes_per_pack=800)
    _raises_everywhere(lambda: rc.broadcast(arrays, root=1, options=mine), CollectiveMismatchError,
                       r"Mismatched broadcast bytes_per_pack", r"rank 0: 1600; rank 1: 800")
    out = rc.broadcast(arrays, root=1, options=same)
    assert all(np.all(o == 1.0) for o in out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_close_receives_the_messages_nobody_read(comm, monkeypatch):
    # A peer's reply to a query whose collective completed meanwhile is never read (the querying rank
    # stops listening once the collective completes). Left on the freed communicator, it would be
    # delivered to the next communicator that reuses its context id: close() receives it first, even
    # when it is not visible to a probe yet (the check may not go through MPI at all).
    rc = RankCommunicator(comm)
    guard = rc._guard
    if comm.rank == 1:
        guard._channel.post(((guard.index, 1, 1), None), 0, 2)  # a reply nobody waits for
    rc.barrier()
    left = []
    drain = guard._channel.drain

    def drain_and_look(*args):
        drain(*args)
        left.append(guard._query.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG))

    monkeypatch.setattr(guard._channel, "drain", drain_and_look)
    received = guard._channel._received_from
    rc.close()
    assert received[1] == (1 if comm.rank == 0 else 0), "rank 0 receives the stray reply, nobody else a message"
    assert left == [False]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_mismatched_first_call_leaves_no_plan_behind(comm):
    # A call not planned before is checked, then planned: a rank whose first call of a signature
    # failed the check must not have cached a plan, or its next call would skip the check and grow
    # the window alone (collective) while its peers check: a hang.
    with RankCommunicator(comm, CommunicationOptions(timeout_seconds=10)) as rc:
        x = [np.ones(4096, np.float32), np.ones(4096, np.float32)]  # one 32 KiB bucket: the window path
        mine = x if rc.rank == 0 else [np.ones(5, np.float32)]
        with pytest.raises(CollectiveMismatchError, match="Mismatched allreduce"):
            rc.allreduce(mine, "sum")
        assert len(rc._planner._plans) == 0
        for _ in range(3):
            out = rc.allreduce(x, "sum")
            assert all(np.all(o == rc.size) for o in out)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [4096, 20000, 70000])  # 32 KiB, 160 KiB, 560 KiB buckets
def test_ranks_may_mix_in_place_and_new_results(comm, count):
    # In place or not is each rank's own choice (it is not part of the agreement): the transports
    # must take the same collective path either way.
    with RankCommunicator(comm, CommunicationOptions(timeout_seconds=10, implementation="SHM")) as rc:
        for it in range(4):
            a = np.full(count, rc.rank + 1.0 + it, np.float32)
            b = np.full(count, 10.0 * (rc.rank + 1) + it, np.float32)
            ra, rb = rc.allreduce([a, b], "sum", inplace=rc.rank == 0)
            n = rc.size
            assert np.all(ra == n * (n + 1) / 2 + n * it) and np.all(rb == 10 * n * (n + 1) / 2 + n * it)
            assert (ra is a) == (rc.rank == 0)


@pytest.mark.mpi(min_size=2)
def test_in_place_results_never_pin_a_window_that_grows(comm):
    # In place, a packed bucket goes through the communicator's scratch memory: nothing it keeps
    # refers to a window, so a window that grows is freed, not kept mapped until exit.
    import warnings

    from mpistrat.comm.runtime import shm_window

    kept = len(shm_window._KEPT)
    with RankCommunicator(comm, CommunicationOptions(implementation="SHM")) as rc:
        small = [np.ones(4096, np.float32), np.ones(4096, np.float32)]
        rc.allreduce(small, "sum", inplace=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for mb in (2, 4, 8):
                big = [np.ones(mb << 17, np.float32), np.ones(mb << 17, np.float32)]
                rc.allreduce(big, "sum", inplace=True)
                rc.allreduce(small, "sum", inplace=True)
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert len(shm_window._KEPT) == kept
        assert np.all(small[0] == rc.size ** 4) and np.all(big[1] == rc.size)
