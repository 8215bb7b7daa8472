"""All-reduce results in node shared memory (comm/transport/shm/results.py).

The owners of the shared-memory reduce-scatter write the result straight into
one block the node's ranks share, where every rank offered it (nobody holds it);
each rank's result is a read-only view of it. These tests check that the results
are right whichever blocks the ranks offer (the same on every rank or not), that
every rank decides the same, that a result any rank holds is never written
again, that shared results are read-only, and that results outlive the
communicator. The MPI tests run at 2 and 4 ranks, on one node.
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
from mpistrat.comm.transport.shm.results import ALL_SLOTS, MAX_BYTES, SLOTS, ResultBlocks

OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
# Above the one-synchronisation limit (256 KiB where ranks outnumber cores or a node has two): the reduce-scatter.
# In the rc fixture's 1 MiB chunks, the first in one pass; the second in chunks whose last (of int64 320 KB, of
# float32 668 KiB) is reduce-scattered too.
COUNTS = [100_003, 3 * 131_072 + 40_000]


@pytest.fixture
def rc(comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", str(1 << 20))
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


def _slot(result: np.ndarray, shm: ShmTransport) -> int:
    """The node's block ``result`` is a view of, or -1 (a private result)."""
    shared = shm.result_blocks.shared_results(result.size, result.dtype)
    return -1 if shared is None else shared.slot_of(result)


def _is_shared(result: np.ndarray, shm: ShmTransport) -> bool:
    return _slot(result, shm) >= 0


def _same_everywhere(comm, value) -> bool:
    return len({repr(v) for v in comm.allgather(value)}) == 1


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
            assert _same_everywhere(comm, _slot(out, shm))  # one block for the node's ranks
            assert out.flags.writeable == (salt == 0)  # shared: read-only, a write would reach the peers' results
            np.testing.assert_array_equal(x.reshape(-1), _data(count, dtype, comm.rank, salt))  # input kept


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", COUNTS)
def test_ranks_holding_different_results_take_a_block_all_offered_or_private_results(comm, rc, count):
    """Rank r keeps the results of some calls (more than SLOTS on some ranks), so the ranks offer
    different blocks, or none; every call decides the same on every rank, and every result stays what it was."""
    shm = _shm(rc)
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    kinds = set()
    for call in range(8):
        x = _data(count, "int64", comm.rank, call)
        (out,) = rc.allreduce([x], "sum")
        kinds.add(_is_shared(out, shm))
        assert _same_everywhere(comm, _slot(out, shm)), call
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
@pytest.mark.parametrize("lane", ["compiled", "python", "mixed"])
@pytest.mark.parametrize("count", [100_003, 3 * 65_536 + 40_000])
def test_a_call_takes_the_block_every_rank_offered_or_private_results_on_every_rank(comm, monkeypatch, lane, count):
    """Rank 0 keeps a result in block 0, the other ranks one in block 1: the call between takes block 1 (the only
    one every rank offered), the call after takes none (private results on every rank), and no held result is
    written again. With the compiled reduce-scatter, the Python path, and the kernel on rank 0 only (int64 in
    chunks of 512 KiB: two, and four, the last one of 313 KB, reduce-scattered too)."""
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", str(512 << 10))
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1" if lane == "compiled" or (lane == "mixed" and comm.rank == 0)
                       else "0")
    with RankCommunicator(comm) as rc:
        shm = _shm(rc)
        xs = [_data(count, "int64", comm.rank, salt) for salt in range(5)]
        wants = [_reference(comm, x, "sum") for x in xs]
        rc.allreduce([xs[0]], "sum")  # the size's first call makes the blocks
        (a,) = rc.allreduce([xs[1]], "sum")
        assert _slot(a, shm) == 0
        kept_a = a if comm.rank == 0 else None
        del a
        (b,) = rc.allreduce([xs[2]], "sum")  # rank 0 holds block 0
        assert _slot(b, shm) == 1 and not b.flags.writeable
        kept_b = b if comm.rank != 0 else None
        del b
        (c,) = rc.allreduce([xs[3]], "sum")  # rank 0 holds block 0, the others block 1
        assert _slot(c, shm) == -1 and c.flags.writeable
        np.testing.assert_array_equal(c, wants[3])
        if kept_a is not None:
            np.testing.assert_array_equal(kept_a, wants[1])
        if kept_b is not None:
            np.testing.assert_array_equal(kept_b, wants[2])
        del kept_a, kept_b
        (d,) = rc.allreduce([xs[4]], "sum")  # nothing held: block 0 again
        assert _slot(d, shm) == 0
        np.testing.assert_array_equal(d, wants[4])
        np.testing.assert_array_equal(c, wants[3])
        del c, d


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_source_the_kernel_declines_still_gets_a_shared_result(comm, monkeypatch):
    """A source not aligned to its items: the compiled reduce-scatter declines it before posting anything, and the
    Python path that takes the call gets the same offer, so the result still goes into the node's block."""
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1")
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    count = COUNTS[0]
    raw = np.empty(count * 4 + 1, np.uint8)
    x = np.frombuffer(raw.data, np.float32, count, offset=1)  # C-contiguous, one byte off its items
    assert not x.flags.aligned
    with RankCommunicator(comm) as rc:
        shm = _shm(rc)
        for salt in range(3):
            x[...] = _data(count, "float32", comm.rank, salt)
            (out,) = rc.allreduce([x], "sum")
            np.testing.assert_array_equal(out, _reference(comm, x.copy(), "sum"))
            assert _slot(out, shm) == (-1 if salt == 0 else 0)
            del out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("lane", ["compiled", "python", "mixed"])
def test_an_array_whose_last_chunk_takes_one_synchronisation_gets_private_results(comm, monkeypatch, lane):
    """Every rank sums such a chunk into its own result, so no rank offers a shared block for the array: the
    results are private (writable) on every rank, and right, call after call."""
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "0")
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", str(512 << 10))
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    monkeypatch.setenv("MPISTRAT_COMPILED_LANE", "1" if lane == "compiled" or (lane == "mixed" and comm.rank == 0)
                       else "0")
    count = 6 * 65_536 + 500  # int64: six chunks of 512 KiB, then 4000 bytes
    with RankCommunicator(comm) as rc:
        shm = _shm(rc)
        for salt in range(4):
            x = _data(count, "int64", comm.rank, salt)
            (out,) = rc.allreduce([x], "sum")
            np.testing.assert_array_equal(out, _reference(comm, x, "sum"))
            assert _slot(out, shm) == -1 and out.flags.writeable
        assert shm.result_blocks.shared_results(count, np.int64) is not None  # blocks made, never offered


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
    """A shared result is read-only: writing into it, or reducing it in place, raises on every rank and
    changes nothing; reduced again (not in place) it is an input like any other, and the new result goes
    into the other block."""
    shm = _shm(rc)
    x = _data(count, "int64", comm.rank, 5)
    rc.allreduce([x], "sum")
    (held,) = rc.allreduce([x], "sum")
    want = _reference(comm, x, "sum")
    assert _is_shared(held, shm)
    with pytest.raises(ValueError, match="read-only"):
        held += comm.rank
    with pytest.raises(ValueError, match="read-only"):
        rc.allreduce([held], "sum", inplace=True)
    np.testing.assert_array_equal(held, want)
    (again,) = rc.allreduce([held], "sum")
    np.testing.assert_array_equal(again, want * comm.size)
    assert _is_shared(again, shm) and _slot(again, shm) != _slot(held, shm)
    np.testing.assert_array_equal(held, want)  # its block was not written while held


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
    assert not out.flags.writeable
    with RankCommunicator(comm) as later:  # a new communicator gets blocks of its own
        later.allreduce([x], "sum")
        (second,) = later.allreduce([x], "sum")
        assert _is_shared(second, _shm(later))
        np.testing.assert_array_equal(second, want)
        del second
    np.testing.assert_array_equal(out, want)


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
def test_no_shared_blocks_across_nodes_or_above_the_limit(comm, monkeypatch):
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
            shared_result = shared.slot_of(a) >= 0
            assert shared.slot_of(b) == shared.slot_of(a) and _same_everywhere(comm, shared.slot_of(a))
            assert a.flags.writeable == b.flags.writeable == (not shared_result)
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
        assert blocks.shared_results(2 * count, np.float32).slot_of(a) >= 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_fused_results_right_whichever_blocks_each_rank_offers(comm, monkeypatch):
    """Ranks hold different fused results (more than SLOTS on some), so in one call the ranks offer
    different blocks, or none: the call takes a block every rank offered, or private results on every
    rank; every result, and every held one, stays what it was."""
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
            slot = -1 if shared is None else shared.slot_of(out[0])
            assert _same_everywhere(comm, slot), call
            kinds.add(slot >= 0)
            if (call + comm.rank) % 3 and len(kept) < SLOTS + 1:
                kept.append((out[call % 2], want[call % 2]))
            for held, expected in kept:
                np.testing.assert_array_equal(held, expected)
            del out
    assert kinds == {True, False}


def _call(shared, views, pool) -> list:
    """What a transport does with the pool's offer on one rank: publish it, decide after the (here trivial)
    synchronisation, and the results the pool hands out."""
    shared.publish(shared.take_offer(views[0]))
    shared.decide()
    return pool.results(views)


def test_result_pool_offers_the_free_shared_blocks():
    """One rank (COMM_SELF): what the pool offers, and which results it hands out after the decision."""
    blocks = ResultBlocks(MPI.COMM_SELF, True, 0, SLOTS * 128 * 4)  # room for one size
    try:
        (bucket,) = plan_buckets([((16, 8), "f4")], 1 << 20)
        pool = ResultPool(bucket, shared=blocks)
        assert blocks.shared_results(128, np.float32) is None and blocks.may_share(128, np.float32)
        block, views = pool.get()  # not made yet: a private block, nothing offered
        shared = blocks.make(128, np.dtype(np.float32))
        assert shared is not None and blocks.shared_results(128, np.float32) is shared
        assert not blocks.may_share(128, np.float32)
        assert _call(shared, views, pool) is views and shared.chosen == -1
        held = []
        for k in range(SLOTS):  # every call's result in the lowest free block, read-only
            (result,) = _call(shared, pool.get()[1], pool)
            assert shared.slot_of(result) == k and result.shape == (16, 8) and not result.flags.writeable
            held.append(result)
        private = pool.get()[1]  # every block held: none offered, the private result
        assert shared.take_offer(private[0]) == 0
        shared.publish(0)
        assert shared.decide() is None and pool.results(private) is private and private[0].flags.writeable
        derived = held[0][3:5]  # a view pins its block
        del held[0]
        views = pool.get()[1]
        assert shared.take_offer(views[0]) == 0
        del derived
        views = pool.get()[1]
        assert shared.take_offer(np.empty(128, np.float32)) == 0  # offered with another array: nothing
        views = pool.get()[1]
        shared.publish(shared.take_offer(views[0]))
        assert shared.published == 1  # slot 0 free again, and offered
        shared.retire()  # the call failed before deciding: the block every rank offered may be written late
        views = pool.get()[1]
        assert shared.take_offer(views[0]) == 0  # slot 0 pinned for good, slot 1 held
        assert ALL_SLOTS == (1 << SLOTS) - 1
        assert blocks.make(100, np.dtype(np.float64)) is None  # over the budget: refused, for good
        assert not blocks.may_share(100, np.float64)
    finally:
        blocks.free()
