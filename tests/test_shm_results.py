"""All-reduce results in node shared memory (comm/shm_results.py).

The owners of the shared-memory reduce-scatter write the result straight into
every rank's result block. These tests check that the results are right
whichever blocks the ranks pick (shared or private, different on every rank),
that a result a caller holds is never written again, and that results outlive
the communicator. The MPI tests run at 2 and 4 ranks, on one node.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm import CommunicationOptions, RankCommunicator
from mpistrat.comm.fusion import ResultPool, plan_buckets
from mpistrat.comm.transport.shm.allreduce import ShmTransport
from mpistrat.comm.transport.shm.results import MAX_BYTES, PRIVATE, SLOTS, ResultBlocks

OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
# Above the one-synchronisation limit (256 KiB where ranks outnumber cores or a node has two): the reduce-scatter
# pushes. The second goes in 1 MiB chunks: of int64, the last one of 4000 bytes (one
# synchronisation); of float32, the last one of 514 KB.
COUNTS = [100_003, 3 * 131_072 + 500]


@pytest.fixture
def rc(comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    c = RankCommunicator(comm)
    yield c
    c.close()


def _shm(rc: RankCommunicator) -> ShmTransport:
    backend = rc.transports[0]
    assert isinstance(backend, ShmTransport)
    return backend


def _data(count: int, dtype: str, rank: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + salt)
    return rng.integers(-1000, 1000, count).astype(dtype)


def _reference(comm, x: np.ndarray, op: str) -> np.ndarray:
    ref = x.copy()
    comm.Allreduce(MPI.IN_PLACE, ref, op=OPS[op])
    return ref


def _is_shared(result: np.ndarray, shm: ShmTransport) -> bool:
    shared = shm.result_blocks.shared_results(result.size, result.dtype)
    return shared is not None and shared.slot_of(result) != PRIVATE


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("op", list(OPS))
def test_results_go_into_shared_blocks_and_match_mpi(comm, rc, dtype, op):
    shm = _shm(rc)
    for count in COUNTS:
        for salt in range(3):
            x = _data(count, dtype, comm.rank, salt).reshape(-1, 1)
            (out,) = rc.allreduce([x], op)
            assert out.shape == x.shape
            np.testing.assert_array_equal(out.reshape(-1), _reference(comm, x.reshape(-1), op))
            # The first call of a size makes the blocks (after the agreement check); later ones use them.
            assert _is_shared(out, shm) == (salt > 0), (count, salt)
            np.testing.assert_array_equal(x.reshape(-1), _data(count, dtype, comm.rank, salt))  # input kept


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", COUNTS)
def test_ranks_holding_different_results_mix_shared_and_private_blocks(comm, rc, count):
    """Rank r keeps the results of some calls (more than SLOTS on some ranks), so the ranks publish
    different blocks, private ones included; every result stays what it was."""
    shm = _shm(rc)
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    kinds = set()
    for call in range(8):
        x = _data(count, "int64", comm.rank, call)
        (out,) = rc.allreduce([x], "sum")
        kinds.add(_is_shared(out, shm))
        want = _reference(comm, x, "sum")
        np.testing.assert_array_equal(out, want)
        if (call + comm.rank) % 3 and len(kept) < SLOTS + 1:
            # A view of the result pins its block as the result itself does.
            kept.append((out[1:] if call % 2 else out, want[1:] if call % 2 else want))
        for held, expected in kept:
            np.testing.assert_array_equal(held, expected)
    assert kinds == {True, False}  # both kinds of block were used on this rank
    del kept, out
    gc.collect()
    (again,) = rc.allreduce([x], "sum")
    assert _is_shared(again, shm)  # nothing held any more: a shared block is free again


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_inplace_on_some_ranks_only(comm, rc):
    """In place on odd ranks (private results), new results on even ranks (shared blocks)."""
    count = COUNTS[0]
    for call in range(4):
        x = _data(count, "float64", comm.rank, call)
        want = _reference(comm, x, "max")
        inplace = comm.rank % 2 == 1
        (out,) = rc.allreduce([x], "max", inplace=inplace)
        assert (out is x) == inplace
        np.testing.assert_array_equal(out, want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", COUNTS)
def test_inplace_into_a_held_shared_result(comm, rc, count):
    """A result in a shared block reduced again in place: its block is both source and result
    (summed aside, as any in-place array; at 3+ ranks the owners' sums would clobber it otherwise)."""
    shm = _shm(rc)
    x = _data(count, "int64", comm.rank, 5)
    rc.allreduce([x], "sum")
    (held,) = rc.allreduce([x], "sum")
    assert _is_shared(held, shm)
    held += comm.rank  # different on every rank
    want = _reference(comm, held, "sum")
    (out,) = rc.allreduce([held], "sum", inplace=True)
    assert out is held
    np.testing.assert_array_equal(held, want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_results_outlive_the_communicator(comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    rc = RankCommunicator(comm)
    count = COUNTS[0]
    x = _data(count, "float32", comm.rank, 0)
    rc.allreduce([x], "sum")
    (out,) = rc.allreduce([x], "sum")
    assert _is_shared(out, _shm(rc))
    want = _reference(comm, x, "sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # held results are expected: no warning
        rc.close()
    np.testing.assert_array_equal(out, want)  # the memory stays mapped while the result lives
    out += 1  # and writable, as any result
    with RankCommunicator(comm) as later:  # a new communicator gets blocks of its own
        later.allreduce([x], "sum")
        (second,) = later.allreduce([x], "sum")
        assert _is_shared(second, _shm(later))
        np.testing.assert_array_equal(second, want)
    np.testing.assert_array_equal(out, want + 1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_sizes_beyond_the_budget_get_private_results(comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("MPISTRAT_SHM_MAX_BYTES", "1M")  # budget SLOTS x 1 MiB per rank
    with RankCommunicator(comm) as rc:
        shm = _shm(rc)
        first, second = 200_000, 100_000  # float32: 800 KB fits the budget, then 400 KB no longer
        for count in (first, second, first, second):
            x = _data(count, "float32", comm.rank, count)
            rc.allreduce([x], "sum")
            (out,) = rc.allreduce([x], "sum")
            np.testing.assert_array_equal(out, _reference(comm, x, "sum"))
            assert _is_shared(out, shm) == (count == first)
        assert shm.result_blocks.shared_results(second, np.float32) is None
        assert not shm.result_blocks.may_share(second, np.float32)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_no_shared_blocks_across_nodes_in_fused_buckets_or_above_the_limit(comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    with RankCommunicator(comm) as rc:
        big = _data(MAX_BYTES // 8 + 1, "int64", comm.rank, 2)
        for _ in range(2):
            (out,) = rc.allreduce([big], "sum")
            np.testing.assert_array_equal(out, _reference(comm, big, "sum"))
        assert not _is_shared(out, _shm(rc)) and not _shm(rc).result_blocks.may_share(big.size, big.dtype)
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", "2")
    count = COUNTS[0]
    x = _data(count, "float32", comm.rank, 1)
    want = _reference(comm, x, "sum")
    with RankCommunicator(comm) as rc:
        shm = _shm(rc)
        for _ in range(2):
            (out,) = rc.allreduce([x], "sum")
            np.testing.assert_array_equal(out, want)
        assert not shm.result_blocks.may_share(count, np.float32)
        assert shm.result_blocks.shared_results(count, np.float32) is None

@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_fused_buckets_get_shared_blocks_and_held_results_stay(comm, monkeypatch):
    """Two arrays packed into one bucket: its results are views of one shared block per call (after the
    size's first call made them), and a result, or a view of one, that a caller holds pins its block."""
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    count = COUNTS[0]
    with RankCommunicator(comm, CommunicationOptions(bytes_per_pack=16 << 20)) as rc:
        blocks = _shm(rc).result_blocks
        kept = []
        for call in range(6):
            x = _data(count, "float32", comm.rank, call)
            y = _data(count, "float32", comm.rank, call + 100)
            a, b = rc.allreduce([x, y], "sum")
            np.testing.assert_array_equal(a, _reference(comm, x, "sum"))
            np.testing.assert_array_equal(b, _reference(comm, y, "sum"))
            shared = blocks.shared_results(2 * count, np.float32)  # made by the size's first call ...
            shared_result = shared.slot_of(a) != PRIVATE
            assert shared_result == (call in (1, 2))  # ... which, and calls while both are held, get private ones
            if call == 1:
                kept.append((b[5:], b[5:].copy()))  # a view of a result pins its block
            if call == 2:
                kept.append((a, a.copy()))  # and so does a result itself
            for held, expected in kept:
                np.testing.assert_array_equal(held, expected)
            del a, b
        kept.clear()
        gc.collect()
        a, _ = rc.allreduce([x, y], "sum")  # nothing held any more: a shared block again
        assert blocks.shared_results(2 * count, np.float32).slot_of(a) != PRIVATE


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_fused_results_right_whichever_blocks_each_rank_publishes(comm, monkeypatch):
    """Ranks hold different fused results (more than SLOTS on some), so in one call some ranks publish a
    shared block and others PRIVATE: the owners write into each rank's choice; every result, and every
    held one, stays what it was."""
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    count = COUNTS[0]
    with RankCommunicator(comm, CommunicationOptions(bytes_per_pack=16 << 20)) as rc:
        blocks = _shm(rc).result_blocks
        kept, kinds = [], set()
        for call in range(8):
            xs = [_data(count, "int64", comm.rank, call), _data(count + 1, "int64", comm.rank, call + 50)]
            out = rc.allreduce(xs, "sum")
            want = [_reference(comm, x, "sum") for x in xs]
            for r, w in zip(out, want):
                np.testing.assert_array_equal(r, w)
            shared = blocks.shared_results(2 * count + 1, np.int64)
            kinds.add(shared is not None and shared.slot_of(out[0]) != PRIVATE)
            if (call + comm.rank) % 3 and len(kept) < SLOTS + 1:
                kept.append((out[call % 2], want[call % 2]))
            for held, expected in kept:
                np.testing.assert_array_equal(held, expected)
            del out
    assert kinds == {True, False}


def test_result_pool_hands_out_free_shared_blocks_first():
    """One rank (COMM_SELF): the pool's choice among shared and private blocks."""
    blocks = ResultBlocks(MPI.COMM_SELF, True, 0, SLOTS * 128 * 4)  # room for one size
    try:
        (bucket,) = plan_buckets([((16, 8), "f4")], 1 << 20)
        pool = ResultPool(bucket, shared=blocks)
        assert blocks.shared_results(128, np.float32) is None and blocks.may_share(128, np.float32)
        first = pool.get()[1][0]  # not made yet: a private block
        shared = blocks.make(128, np.dtype(np.float32))
        assert shared is not None and shared.slot_of(first) == PRIVATE
        assert shared is not None and blocks.shared_results(128, np.float32) is shared
        assert not blocks.may_share(128, np.float32)
        held = [pool.get()[1][0] for _ in range(SLOTS)]
        slots = [shared.slot_of(h) for h in held]
        assert sorted(slots) == list(range(SLOTS)) and all(h.shape == (16, 8) for h in held)
        extra = pool.get()[1][0]  # every shared block is held: a private one
        assert shared.slot_of(extra) == PRIVATE
        derived = held[0][3:5]  # a view pins its block
        del held[0]
        assert shared.slot_of(pool.get()[1][0]) == PRIVATE
        del derived
        assert shared.slot_of(pool.get()[1][0]) == slots[0]
        shared.publish(slots[0])
        shared.retire()  # its call failed: a late owner may still write into it
        assert [shared.slot_of(pool.get()[1][0]) for _ in range(3)] == [PRIVATE] * 3  # slots[1] is held
        assert blocks.make(100, np.dtype(np.float64)) is None  # over the budget: refused, for good
        assert not blocks.may_share(100, np.float64)
    finally:
        blocks.free()
