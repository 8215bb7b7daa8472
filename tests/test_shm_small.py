"""The small-bucket transport (``shm-small``): one handshake per call, against MPI and the window's bits (2 and 4 ranks)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm import CollectiveMismatchError, CollectiveTimeoutError, CommunicationOptions, RankCommunicator
from mpistrat.comm.agreement import call
from mpistrat.comm.runtime.topology import topology
from mpistrat.comm.transport.base import NO_AGREEMENT
from mpistrat.comm.transport.shm import allreduce as shm_allreduce
from mpistrat.comm.transport.shm.allreduce import ShmTransport
from mpistrat.comm.transport.shm.small import SmallShmTransport

OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


def _data(shape, dtype, rank, seed=0):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, shape).astype(dtype)


@pytest.fixture
def auto_rc(comm, monkeypatch):
    """A communicator with the library's defaults: shm-small first on one node."""
    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    c = RankCommunicator(comm)
    assert [t.name for t in c.transports] == ["shm-small", "shm", "mpi"]
    yield c
    c.close()


@pytest.fixture
def small(comm):
    topo = topology(comm)
    t = SmallShmTransport(topo, timeout_seconds=30.0)
    yield t
    t.close()
    topo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "uint8", "complex64"])
@pytest.mark.parametrize("op", list(OPS))
def test_matches_mpi_and_sums_in_local_rank_order(small, comm, dtype, op):
    if np.dtype(dtype).kind == "c" and op != "sum":
        assert not small.enabled(64, np.dtype(dtype), op)
        return
    for i, shape in enumerate([(0,), (1,), (7,), (33, 5), (small.max_bytes // np.dtype(dtype).itemsize,)]):
        x = _data(shape, dtype, comm.rank, seed=i)
        if np.dtype(dtype).kind == "c":
            x = x + 1j * _data(shape, "float32", comm.rank, seed=i + 100)
            x = x.astype(dtype)
        ref = x.copy()
        comm.Allreduce(MPI.IN_PLACE, ref, op=OPS[op])
        out = np.empty_like(x)
        small.allreduce_array(x, out, op, NO_AGREEMENT)
        # The window's order, ((s0 + s1) + s2) + ..., on every rank: floats are exact at 2 ranks and
        # equal to a NumPy sum in that order at more.
        parts = comm.allgather(x)
        expected = parts[0].copy()
        for p in parts[1:]:
            expected = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op](expected, p)
        assert np.array_equal(out, expected), (shape, dtype, op)
        if np.dtype(dtype).kind in "iu" or op != "sum" or comm.size == 2:
            assert np.array_equal(out, ref)
        else:
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi(min_size=2)
def test_packed_and_in_place_and_the_size_limit(small, comm):
    x = _data((100,), "float64", comm.rank)
    total = np.sum(comm.allgather(x), axis=0)
    buf = small.pack_buffer(100, np.float64)
    buf[:] = x
    np.testing.assert_allclose(small.allreduce_packed(100, np.float64, "sum"), total)
    y = x.copy()
    small.allreduce_array(MPI.IN_PLACE, y, "sum", NO_AGREEMENT)
    np.testing.assert_allclose(y, total)
    assert small.enabled(small.max_bytes, np.float32, "sum") and not small.enabled(small.max_bytes + 4, np.float32, "sum")
    with pytest.raises(ValueError, match="outside"):
        small.pack_buffer(small.max_bytes // 4 + 1, np.float32)
    with pytest.raises(RuntimeError, match="without pack_buffer"):
        small.allreduce_packed(5, np.float64, "sum")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_slots_survive_a_slow_reader(small, comm):
    """One synchronisation per call: a rank that races ahead copies into the other slot, so a slow rank
    still reads this call's data."""
    count = 1000
    for step in range(40):
        x = np.full(count, step * 10 + comm.rank, np.int64)
        out = np.empty(count, np.int64)
        if comm.rank == step % comm.size and step % 3 == 0:
            time.sleep(0.02)  # the others race ahead into the next call
        small.allreduce_array(x, out, "sum", NO_AGREEMENT)
        assert (out == step * 10 * comm.size + sum(range(comm.size))).all(), step


@pytest.mark.mpi(min_size=2)
def test_the_default_communicator_takes_small_buckets_through_it_with_the_check_folded(auto_rc, comm):
    small = auto_rc.transports[0]
    assert small.describe()["max_bytes"] == small.max_bytes >= shm_allreduce.DIRECT_MAX_BYTES
    x = [np.full(1000, comm.rank + 1.0, np.float32)]
    for _ in range(3):
        out = auto_rc.allreduce(x, "sum")
        assert np.all(out[0] == comm.size * (comm.size + 1) / 2)
    plan = next(iter(auto_rc._planner._plans.values()))
    # The check is its handshake where it goes through shared memory; over MPI (MPISTRAT_AGREEMENT=mpi)
    # it is a round of its own, overlapped with the staging.
    folded = call.FOLD if auto_rc._guard.transport == "shm" else call.OVERLAP
    assert plan.steps[0].transport is small and plan.repeat_mode == folded
    big = [np.ones(small.max_bytes // 4 + 1, np.float32)]
    auto_rc.allreduce(big, "sum")
    assert any(p.steps[0].transport.name == "shm" for p in auto_rc._planner._plans.values())


@pytest.mark.mpi(min_size=2)
def test_a_mismatch_on_a_repeated_small_call_raises_everywhere_and_leaves_it_usable(auto_rc, comm):
    x = np.ones(300, np.float32)
    for op in ("sum", "max", "sum", "max"):
        auto_rc.allreduce([x], op)
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce op.*rank 0 sent op=max"):
        auto_rc.allreduce([x], "max" if comm.rank == 0 else "sum")
    shape = 301 if comm.rank == comm.size - 1 else 300
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce shapes"):
        auto_rc.allreduce([np.ones(shape, np.float32)], "sum")
    assert np.all(auto_rc.allreduce([np.full(300, comm.rank + 1.0, np.float32)], "max")[0] == comm.size)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_late_rank_on_a_repeated_small_call_times_out_the_waiting_ranks(auto_rc, comm):
    late = comm.size - 1
    opts = CommunicationOptions(timeout_seconds=1.0)
    x = [np.ones(64, np.float32)]
    auto_rc.allreduce(x, "sum", opts)
    auto_rc.allreduce(x, "sum", opts)
    if comm.rank == late:
        time.sleep(3.0)  # past the others' timeout and grace period
    with pytest.raises(CollectiveTimeoutError) as info:
        auto_rc.allreduce(x, "sum", opts)
    if comm.rank != late:
        assert info.value.missing_ranks == [late]
    MPI.COMM_WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting, implementation", [("0", "AUTO"), ("64K", "AUTO"), ("off", "AUTO"), (None, "SHM"),
                                                     (None, "MPI")])
def test_only_the_default_rule_on_one_node_makes_it(comm, monkeypatch, setting, implementation):
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    if setting is None:
        monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    else:
        monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", setting)
    with RankCommunicator(comm, CommunicationOptions(implementation=implementation)) as c:
        assert "shm-small" not in [t.name for t in c.transports]
    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", "2")
    with RankCommunicator(comm) as c:  # two (pretend) nodes: small buckets go to MPI, checked apart
        assert "shm-small" not in [t.name for t in c.transports]
    if comm.rank == 0:  # one rank with another rule: agreed, made nowhere
        monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "4096")
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)
    with RankCommunicator(comm) as c:
        assert "shm-small" not in [t.name for t in c.transports]


@pytest.mark.mpi(min_size=2)
def test_it_never_exceeds_the_window_limit_and_gives_the_window_bits(comm, monkeypatch):
    monkeypatch.delenv("MPISTRAT_SHM_MIN_BYTES", raising=False)
    monkeypatch.setenv("MPISTRAT_SHM_MAX_BYTES", "8K")
    with RankCommunicator(comm) as c:
        assert c.transports[0].name == "shm-small" and c.transports[0].max_bytes == 8192
    monkeypatch.delenv("MPISTRAT_SHM_MAX_BYTES")
    x = _data((5000,), "float32", comm.rank, seed=7)  # 20 KB: one synchronisation on either transport
    with RankCommunicator(comm) as auto, RankCommunicator(comm, CommunicationOptions(implementation="SHM")) as window:
        assert isinstance(window.transports[0], ShmTransport)
        assert np.array_equal(auto.allreduce([x], "sum")[0], window.allreduce([x], "sum")[0])



@pytest.mark.mpi(min_size=2)
def test_large_arrays_of_a_call_are_reduced_on_their_own_with_the_bits_of_one_packed_bucket(auto_rc, comm):
    from mpistrat.comm.plan import UNFUSED_MIN_BYTES

    big = UNFUSED_MIN_BYTES // 4
    shapes = [(big + 8,), (7,), (3, 5), (big,), (1000,)]
    arrays = [_data(s, "float32", comm.rank, seed=i) for i, s in enumerate(shapes)]
    kept = [a.copy() for a in arrays]
    out = auto_rc.allreduce(arrays, "sum")
    plan = next(p for p in auto_rc._planner._plans.values() if len(p.steps) > 1)
    assert [(s.members, s.direct) for s in plan.steps] == [((0,), True), ((3,), True), ((1, 2, 4), False)]
    # the same values reduced as one array give the same bits: every path sums in local-rank order
    flat = auto_rc.allreduce([np.concatenate([a.ravel() for a in arrays])], "sum")[0]
    offsets = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    for i, (r, s) in enumerate(zip(out, shapes)):
        assert r.shape == s
        np.testing.assert_array_equal(r.ravel(), flat[offsets[i]:offsets[i + 1]])
        np.testing.assert_array_equal(arrays[i], kept[i])  # inputs untouched
