"""The shared-window all-reduce backend against plain MPI.Allreduce.

Run at 2 and 4 ranks; the pretend-node cases cut the ranks into 2 (and, at 4
ranks, 3 uneven) nodes so the hierarchical path runs on one machine.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat import config, ops
from mpistrat.comm.runtime.topology import node_layout, topology
from mpistrat.comm.runtime.waiter import OVERSUBSCRIBED_YIELDS, ranks_outnumber_cores
from mpistrat.comm.transport.shm import allreduce as shm_allreduce
from mpistrat.comm.transport.shm import calibration as shm_calibration
from mpistrat.comm.transport.shm.allreduce import ShmTransport
from mpistrat.config import parse_bytes

SIZES = [0, 1, 2, 3, 5, 17, 1000, 4099, 65539, 300001]
DTYPES = ["float32", "float64", "int32", "int64"]
OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


def _data(count, dtype, rank, seed=0):
    rng = np.random.default_rng(seed * 1000 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(count).astype(dtype)
    return rng.integers(-1000, 1000, count).astype(dtype)


def _cases_against_mpi(comm, dtype, op):
    """(index, count, this rank's data, MPI.Allreduce of it, whether the result must be bit-exact) per size."""
    for i, count in enumerate(SIZES):
        x = _data(count, dtype, comm.rank, seed=i)
        ref = x.copy()
        comm.Allreduce(MPI.IN_PLACE, ref, op=OPS[op])
        exact = np.dtype(dtype).kind == "i" or op != "sum" or comm.size == 2
        yield i, count, x, ref, exact


def _run(backend, x, op):
    buf = backend.pack_buffer(x.size, x.dtype)
    assert buf.shape == x.shape and buf.dtype == x.dtype
    buf[:] = x
    got = backend.allreduce_packed(x.size, x.dtype, op)
    assert got.shape == x.shape and got.dtype == x.dtype
    return got.copy()


def _expected_order(comm, x, op, pretend):
    """The backend's documented order: local ranks left to right, then across nodes."""
    lay = node_layout(comm, pretend)
    try:
        parts = lay.node_comm.allgather(x)
        ufunc = {"sum": np.add, "min": np.minimum, "max": np.maximum}[op]
        acc = parts[0].copy()
        for p in parts[1:]:
            acc = ufunc(acc, p)
        node_sums = comm.allgather(acc if lay.local_rank == 0 else None)
        sums = [s for s in node_sums if s is not None]
        return sums
    finally:
        lay.free()


@pytest.fixture(params=[None, 2], ids=["one-node", "pretend-2-nodes"])
def backend(request):
    b = ShmTransport(MPI.COMM_WORLD, pretend_nodes=request.param, min_bytes=0)
    b.pretend = request.param
    yield b
    b.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_matches_mpi_allreduce(backend, dtype, op):
    for _, count, x, ref, exact in _cases_against_mpi(MPI.COMM_WORLD, dtype, op):
        got = _run(backend, x, op)
        assert got.dtype == np.dtype(dtype) and got.shape == (count,)
        if exact:
            assert np.array_equal(got, ref), f"count={count}: differs from MPI.Allreduce"
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5)


@pytest.mark.mpi(min_size=2)
def test_float_sum_follows_documented_order(backend):
    comm = MPI.COMM_WORLD
    x = _data(100003, "float32", comm.rank, seed=7) * np.float32(1e3)
    got = _run(backend, x, "sum")
    node_sums = _expected_order(comm, x, "sum", backend.pretend)
    if len(node_sums) <= 2:  # a + b == b + a exactly, whatever order MPI takes across nodes
        expect = node_sums[0] if len(node_sums) == 1 else node_sums[0] + node_sums[1]
        assert np.array_equal(got, expect)
    else:
        np.testing.assert_allclose(got, sum(node_sums), rtol=1e-5)


@pytest.mark.mpi(min_size=4)
def test_uneven_pretend_nodes():
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, pretend_nodes=3, min_bytes=0)
    try:
        sizes = comm.allgather(b.layout.local_size)
        assert len(set(sizes)) > 1 and b.owners == min(sizes)
        for count in (1, 7, 5000, 300001):
            x = _data(count, "int64", comm.rank, seed=count)
            ref = x.copy()
            comm.Allreduce(MPI.IN_PLACE, ref)
            assert np.array_equal(_run(b, x, "sum"), ref)
            out = np.empty_like(x)
            b.allreduce_array(x, out, "sum")  # ranks owning no slice copy everything in
            assert np.array_equal(out, ref)
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
def test_buckets_survive_a_slow_reader(backend):
    """Pieces stay valid until this rank packs again, however far the others race ahead, with
    two-synchronisation reduces (one bucket) and one-synchronisation reduces (alternating buckets)
    in any order."""
    comm = MPI.COMM_WORLD
    direct = backend.direct_max_bytes >= 8 * 64
    buckets = []
    for step in range(24):
        one_sync = direct and step % 3 == 2
        count = 64 if one_sync else max(backend.direct_max_bytes // 8, 0) + 3001 + step
        x = np.full(count, step * 10 + comm.rank, np.int64)
        buf = backend.pack_buffer(count, np.int64)
        buckets.append(backend._bucket)
        buf[:] = x
        expect = step * 10 * comm.size + sum(range(comm.size))
        if one_sync:
            out = np.empty(count, np.int64)
            backend.allreduce_packed(count, np.int64, "sum", out=out)
            assert (out == expect).all(), f"step {step}: one synchronisation"
            continue
        reduced = backend.allreduce_packed(count, np.int64, "sum")  # this rank's segment
        if comm.rank == step % comm.size:
            time.sleep(0.05)  # the others race ahead and pack the next bucket
        got = reduced.copy()
        assert (got == expect).all(), f"step {step}: a peer overwrote a bucket still being read"
    # A two-synchronisation reduce leaves the bucket as it found it; a one-synchronisation one switches.
    for step in range(23):
        switched = direct and step % 3 == 2
        assert buckets[step + 1] == buckets[step] ^ switched, (step, buckets)


@pytest.mark.mpi(min_size=2)
def test_window_grows_then_refuses_above_max():
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0, max_bytes=4 << 20)
    try:
        for count in (10, (3 << 20) // 4 + 1, 10):
            x = _data(count, "int32", comm.rank, seed=count)
            ref = x.copy()
            comm.Allreduce(MPI.IN_PLACE, ref)
            assert np.array_equal(_run(b, x, "sum"), ref)
        assert b._capacity >= 3 << 20
        assert b.enabled(4 << 20, np.float32, "sum")
        assert not b.enabled((4 << 20) + 4, np.float32, "sum")
        with pytest.raises(ValueError, match="max_bytes"):
            b.pack_buffer((4 << 20) // 4 + 1, np.float32)
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
def test_enabled_by_size_dtype_op():
    b = ShmTransport(MPI.COMM_WORLD, min_bytes=1 << 16, max_bytes=1 << 20)
    try:
        assert not b.enabled(1 << 15, np.float32, "sum")
        assert b.enabled(1 << 16, np.float32, "sum")
        assert b.enabled(1 << 20, np.int64, "max")
        assert not b.enabled(1 << 17, np.float16, "sum")
        assert not b.enabled(1 << 17, np.bool_, "max")
        assert b.enabled(1 << 17, np.complex64, "sum") and not b.enabled(1 << 17, np.complex64, "min")
        assert not b.enabled(1 << 17, np.float32, "prod")
    finally:
        b.close()
    assert not b.enabled(1 << 17, np.float32, "sum"), "a closed backend is never enabled"


@pytest.mark.mpi(min_size=2)
def test_bad_use_raises_on_every_rank(backend):
    with pytest.raises(RuntimeError, match="must follow pack_buffer"):
        backend.allreduce_packed(10, np.float32, "sum")
    backend.pack_buffer(10, np.float32)
    with pytest.raises(RuntimeError, match="same count and dtype"):
        backend.allreduce_packed(11, np.float32, "sum")
    with pytest.raises(ValueError, match="op must be one of"):
        backend.allreduce_packed(10, np.float32, "prod")
    with pytest.raises(TypeError, match="float16"):
        backend.pack_buffer(10, np.float16)
    with pytest.raises(ValueError, match="outside"):
        backend.pack_buffer(-1, np.float32)
    # still usable afterwards
    x = np.arange(10, dtype=np.float32)
    assert np.array_equal(_run(backend, x, "max"), x)


@pytest.mark.mpi(min_size=2)
def test_close_frees_window_and_views():
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0)
    _run(b, np.ones(1000, np.float32), "sum")
    win = b._window.win
    root = weakref.ref(b._window.segment(0))
    b.close()
    assert win == MPI.WIN_NULL, "the window must be freed"
    assert root() is None, "no view may outlive Win.Free"
    with pytest.raises(RuntimeError, match="closed"):
        b.pack_buffer(4, np.float32)
    b.close()  # idempotent


@pytest.mark.mpi(min_size=2)
def test_close_with_a_held_piece_keeps_memory():
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0)
    count = b.direct_max_bytes // 4 + 6  # above the one-synchronisation size: the result is in the window
    b.pack_buffer(count, np.int32).fill(2)
    held = b.allreduce_packed(count, np.int32, "sum")
    win = b._window.win
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b.close()
    assert any(issubclass(c.category, ResourceWarning) for c in caught)
    assert win != MPI.WIN_NULL
    assert held.tolist() == [2 * comm.size] * count


@pytest.mark.mpi(min_size=2)
def test_the_size_threshold_is_a_rule_not_a_measurement():
    """``auto``: 16 KiB, never with one rank per node; the same on every rank, whatever the machine's load
    (the choice between this path and MPI's decides the summation order)."""
    comm = MPI.COMM_WORLD
    for pretend in (None, comm.size):
        b = ShmTransport(comm, pretend_nodes=pretend)
        try:
            expected = b.max_bytes + 1 if b.owners < 2 else shm_allreduce.MIN_BYTES
            assert shm_allreduce.MIN_BYTES == 16 << 10
            assert b.min_bytes == expected and len(set(comm.allgather(b.min_bytes))) == 1
            x = _data(5000, "float64", comm.rank)
            ref = x.copy()
            comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.MAX)
            assert np.array_equal(_run(b, x, "max"), ref)
        finally:
            b.close()


@pytest.mark.mpi(min_size=2)
def test_env_knobs(monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "64K")
    monkeypatch.setenv("MPISTRAT_SHM_MAX_BYTES", "2MiB")
    monkeypatch.setenv("MPISTRAT_SHM_BLOCK_BYTES", "4K")
    b = ShmTransport(MPI.COMM_WORLD)
    try:
        assert (b.min_bytes, b.max_bytes, b.sync_kind, b.block_bytes) == (65536, 2 << 20, "counter", 4096)
        comm = MPI.COMM_WORLD
        x = _data(70001, "float32", comm.rank)  # many small blocks
        ref = x.copy()
        comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.MIN)
        assert np.array_equal(_run(b, x, "min"), ref)
    finally:
        b.close()


def test_single_rank_is_identity():
    b = ShmTransport(MPI.COMM_SELF)
    try:
        assert not b.enabled(1 << 20, np.float32, "sum"), "nothing to share with one rank per node"
        x = np.arange(11, dtype=np.float64)
        assert np.array_equal(_run(b, x, "sum"), x)
    finally:
        b.close()


def test_parse_bytes_and_bad_options():
    assert parse_bytes("4096", "x") == 4096 and parse_bytes("256K", "x") == 256 << 10
    assert parse_bytes("64MiB", "x") == 64 << 20 and parse_bytes("1g", "x") == 1 << 30
    with pytest.raises(ValueError, match="MPISTRAT_SHM_MAX_BYTES"):
        parse_bytes("lots", "MPISTRAT_SHM_MAX_BYTES")
    with pytest.raises(ValueError, match="sync must be"):
        ShmTransport(MPI.COMM_SELF, sync="spin", min_bytes=0)


@pytest.mark.mpi(min_size=2)
def test_min_bytes_off_never_enables(monkeypatch):
    monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "off")
    off = ShmTransport(MPI.COMM_WORLD)
    try:
        assert not off.enabled(1 << 20, np.float32, "sum") and off.min_bytes > off.max_bytes
    finally:
        off.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pretend", [None, 2])
def test_barrier_sync_matches_mpi(pretend):
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, pretend_nodes=pretend, min_bytes=0, sync="barrier", block_bytes=1 << 12)
    try:
        assert b.sync_kind == "barrier"
        for step, count in enumerate((1, 33, 10007, 70001)):
            x = _data(count, "int32", comm.rank, seed=step)
            ref = x.copy()
            comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.MAX if step % 2 else MPI.SUM)
            assert np.array_equal(_run(b, x, "max" if step % 2 else "sum"), ref)
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
def test_many_counts_through_the_plan_cache(backend):
    comm = MPI.COMM_WORLD
    for rep in range(2):
        for count in range(1, 150):
            x = np.full(count, comm.rank + count, np.int32)
            expect = sum(r + count for r in range(comm.size))
            assert (_run(backend, x, "sum") == expect).all(), f"count {count}, pass {rep}"


@pytest.mark.mpi(min_size=2)
def test_env_pretend_nodes_capped_on_a_small_sub_communicator(monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", str(comm.size))
    pair = comm.Split(color=comm.rank // 2, key=comm.rank)
    try:
        b = ShmTransport(pair, min_bytes=0)
        try:
            assert b.layout.num_nodes == pair.size and b.layout.pretend
            x = np.full(9, comm.rank, np.int64)
            assert (_run(b, x, "max") == max(pair.allgather(comm.rank))).all()
        finally:
            b.close()
        with pytest.raises(ValueError, match="pretend_nodes"):
            ShmTransport(pair, pretend_nodes=pair.size + 1, min_bytes=0)
    finally:
        pair.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("op", list(OPS))
def test_reduce_into_private_memory_matches_mpi(backend, dtype, op):
    """allreduce_packed into private memory and allreduce_array (and in place), one and two
    synchronisations."""
    comm = MPI.COMM_WORLD
    for i, count, x, ref, exact in _cases_against_mpi(comm, dtype, op):
        check = np.array_equal if exact else (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-5))
        out = np.full(count, -7, dtype)
        backend.pack_buffer(count, x.dtype)[:] = x
        backend.allreduce_packed(count, x.dtype, op, out=out)
        assert check(out, ref), f"allreduce_packed into out, count={count}"
        out2 = np.full(count, -7, dtype)
        backend.allreduce_array(x.reshape(1, -1) if count else x, out2.reshape(1, -1) if count else out2, op)
        assert check(out2, ref), f"allreduce_array, count={count}"
        assert np.array_equal(x, _data(count, dtype, comm.rank, seed=i)), "the input must be untouched"
        backend.allreduce_array(MPI.IN_PLACE, x, op)
        assert check(x, ref), f"allreduce_array(IN_PLACE), count={count}"
        if exact:  # every rank holds the very same bits
            gathered = comm.allgather(out2)
            assert all(np.array_equal(g, out2) for g in gathered)


@pytest.mark.mpi(min_size=2)
def test_one_synchronisation_survives_a_slow_reader(monkeypatch):
    """A fast rank must never repack a bucket that a slow peer is still summing, also when
    one-synchronisation reduces (small arrays) and two-synchronisation ones (large) alternate."""
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0)
    try:
        assert b.direct_max_bytes >= 8 * 5000, "one node: small buckets take one synchronisation"
        slow = comm.rank == comm.size - 1
        original = np.add
        calls = []

        def slow_add(*args, **kwargs):  # the last rank lingers over every sum it reads
            calls.append(1)
            time.sleep(0.005)
            return original(*args, **kwargs)

        if slow:
            monkeypatch.setitem(ops.WIRE_OPS, "sum", ops.WIRE_OPS["sum"]._replace(ufunc=slow_add))
        n = comm.size
        bad = []
        large = b.direct_max_bytes // 8 + 4099
        counts = [5000, 5000, large, 5000, large, large, 5000, 5000, large]
        for step, count in enumerate(counts):  # no other collective in between: the fast ranks race ahead
            x = np.arange(count, dtype=np.int64) + 1000 * comm.rank + step
            out = np.empty_like(x)
            b.allreduce_array(x, out, "sum")
            expect = n * np.arange(count) + 1000 * n * (n - 1) // 2 + n * step
            if not np.array_equal(out, expect):
                bad.append(step)
        monkeypatch.setitem(ops.WIRE_OPS, "sum", ops.WIRE_OPS["sum"]._replace(ufunc=original))
        everyone = comm.allgather(bad)
        assert not any(everyone), f"corrupted steps per rank: {everyone}"
        assert not slow or len(calls) >= 6
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
def test_one_synchronisation_path_gives_the_reduce_scatter_bits(backend):
    """Every rank summing all segments (small buckets) adds in the reduce-scatter's order: same bits."""
    comm = MPI.COMM_WORLD
    x = _data(70001, "float32", comm.rank, seed=3) * np.float32(1e3)
    scattered = _run(backend, x, "sum")  # 280 KB: above the one-synchronisation size
    if backend.direct_max_bytes < 0:
        assert backend.layout.num_nodes > 1  # hierarchical: always the reduce-scatter
        return
    out = np.empty_like(x)
    backend.direct_max_bytes, saved = 1 << 40, backend.direct_max_bytes
    try:
        backend.pack_buffer(x.size, x.dtype)[:] = x
        backend.allreduce_packed(x.size, x.dtype, "sum", out=out)
    finally:
        backend.direct_max_bytes = saved
    assert np.array_equal(out, scattered)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [40000, 40001, 16384 * 3])
def test_long_arrays_reduced_chunk_by_chunk_give_the_same_bits(count):
    """allreduce_array in 64 KiB chunks (several, a partial last one) equals the unchunked reduction bit
    for bit, out of place and in place, and leaves the input untouched."""
    comm = MPI.COMM_WORLD
    chunked = ShmTransport(comm, min_bytes=0, chunk_bytes=64 << 10)
    whole = ShmTransport(comm, min_bytes=0, chunk_bytes=0)
    try:
        assert chunked.chunk_bytes == 64 << 10 and whole.chunk_bytes == 0
        x = _data(count, "float32", comm.rank, seed=3)
        expected = np.empty_like(x)
        whole.allreduce_array(x, expected, "sum")
        got = np.full_like(x, -7)
        chunked.allreduce_array(x, got, "sum")
        assert np.array_equal(got, expected)
        assert np.array_equal(x, _data(count, "float32", comm.rank, seed=3)), "the input must be untouched"
        chunked.allreduce_array(MPI.IN_PLACE, x, "sum")
        assert np.array_equal(x, expected)
        ref = _data(count, "float32", comm.rank, seed=3)
        comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
        assert np.allclose(got, ref, rtol=1e-5, atol=1e-5)
    finally:
        chunked.close()
        whole.close()


@pytest.mark.mpi(min_size=2)
def test_chunk_size_is_agreed_over_the_ranks():
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0, chunk_bytes=(1 << 20) + comm.rank * 4096)
    try:
        assert b.chunk_bytes == 1 << 20  # the smallest: every rank cuts the same chunks
    finally:
        b.close()
    with pytest.raises(ValueError, match="chunk_bytes"):
        ShmTransport(comm, min_bytes=0, chunk_bytes=-1)


@pytest.mark.mpi(min_size=2)
def test_automatic_chunks_are_measured_at_the_first_long_array_once_per_rank_set(monkeypatch):
    """With ``auto`` the chunk size is left open, decided (the same on every rank) by a measurement of the
    node's chunk (the default's size, where ranks outnumber cores too) against one pass at the first array
    of at least CHUNK_MEASURE_MIN, and reused by later backends on the same ranks."""
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", "auto")
    monkeypatch.setattr(shm_calibration, "CHUNK_DECISIONS", {})
    comm = MPI.COMM_WORLD
    long_count = shm_calibration.CHUNK_MEASURE_MIN // 4 + 1000  # float32: just long enough to decide
    first = ShmTransport(comm, min_bytes=0)
    try:
        assert first.chunk_bytes is None and first.chunk_calibration == []
        node_chunk = config.node_chunk_bytes(first.topology.machine_size)
        assert len(set(comm.allgather(node_chunk))) == 1  # one machine: the chunk every rank proposed
        assert first.default_chunk_bytes == (0 if first.topology.oversubscribed else node_chunk)
        for count in (1000, shm_calibration.CHUNK_MEASURE_MIN // 4 - 1):  # 4 KB, and one item short of deciding
            short = _data(count, "float32", comm.rank)
            first.allreduce_array(short, np.empty_like(short), "sum")
        assert first.chunk_bytes is None, "short arrays must not start the measurement"
        x = _data(long_count, "float32", comm.rank)
        ref = x.copy()
        comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
        got = np.empty_like(x)
        first.allreduce_array(x, got, "sum")
        assert first.chunk_bytes in (0, node_chunk)
        assert len(set(comm.allgather(first.chunk_bytes))) == 1, "every rank must cut the same chunks"
        [(nbytes, chunk, one_pass, chunked)] = first.chunk_calibration
        assert chunk == node_chunk == first.auto_chunk_bytes and one_pass > 0 and chunked > 0
        # at the deciding size, or four chunks where that is more: never one pass against one pass
        assert nbytes == max(long_count * 4, shm_calibration.CHUNKS_MEASURED * node_chunk)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        assert len({g.tobytes() for g in comm.allgather(got)}) == 1
    finally:
        first.close()
    second = ShmTransport(comm, min_bytes=0)
    try:
        x = _data(long_count, "float32", comm.rank)
        second.allreduce_array(MPI.IN_PLACE, x, "sum")
        assert second.chunk_bytes == first.chunk_bytes and second.chunk_calibration == []
    finally:
        second.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", ["0", "1M"])
def test_an_explicit_chunk_size_is_never_measured(monkeypatch, setting):
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", setting)
    monkeypatch.setattr(shm_calibration, "CHUNK_DECISIONS", {})
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0)
    try:
        x = _data(3 * config.default_chunk_bytes()[0] // 4, "float32", comm.rank)
        b.allreduce_array(MPI.IN_PLACE, x, "sum")
        assert b.chunk_bytes == parse_bytes(setting, "chunk") and b.chunk_calibration == []
        assert shm_calibration.CHUNK_DECISIONS == {}
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
def test_one_rank_explicit_chunk_size_wins_over_auto_elsewhere():
    comm = MPI.COMM_WORLD
    b = ShmTransport(comm, min_bytes=0, chunk_bytes=(256 << 10) if comm.rank == 0 else "auto")
    try:
        assert b.chunk_bytes == 256 << 10
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "bad, message",
    [
        ({"chunk_bytes": -1}, "chunk_bytes (0: no chunks, or 'auto') >= 0"),
        ({"max_bytes": -5}, "max_bytes >= 0"),
        ({"min_bytes": -1}, "min_bytes >= 0"),
        ({"block_bytes": "256K"}, "block_bytes >= 1"),
        ({"chunk_bytes": True}, "chunk_bytes"),
        ({"sync": "spin"}, "sync must be"),
    ],
)
def test_a_bad_setting_on_one_rank_raises_on_every_rank(bad, message):
    """The last rank alone passes a bad value: no rank may be left waiting in the constructor's collectives."""
    comm = MPI.COMM_WORLD
    last = comm.size - 1
    kwargs = {"min_bytes": 0, **(bad if comm.rank == last else {})}
    with pytest.raises(ValueError) as info:
        ShmTransport(comm, **kwargs)
    if comm.rank == last:
        assert message in str(info.value)
    else:
        assert f"failed on rank(s) [{last}]" in str(info.value) and message in str(info.value)
    ok = ShmTransport(comm, min_bytes=0)  # the communicator is still usable by all ranks
    try:
        x = np.full(8, comm.rank + 1.0)
        out = np.empty_like(x)
        ok.allreduce_array(x, out, "sum")
        assert np.all(out == comm.size * (comm.size + 1) / 2)
    finally:
        ok.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_a_bad_environment_on_one_rank_raises_on_every_rank(monkeypatch):
    comm = MPI.COMM_WORLD
    if comm.rank == comm.size - 1:
        monkeypatch.setenv("MPISTRAT_SHM_MIN_BYTES", "bogus")
    with pytest.raises(ValueError, match="MPISTRAT_SHM_MIN_BYTES"):
        ShmTransport(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(30)
def test_settings_that_differ_between_ranks_are_agreed(monkeypatch):
    """An explicit threshold or size on some ranks applies to all (no rank calibrates alone, no rank
    takes a path the others do not); different sync kinds cannot be reconciled and raise everywhere."""
    comm = MPI.COMM_WORLD
    first = comm.rank == 0
    b = ShmTransport(comm, min_bytes=4096 if first else None, max_bytes=(8 << 20) if first else None)
    try:
        assert (b.min_bytes, b.max_bytes) == (4096, 8 << 20)
        assert b.enabled(4096, np.float32, "sum") and not b.enabled((8 << 20) + 4, np.float32, "sum")
    finally:
        b.close()
    with pytest.raises(ValueError, match="different sync kinds"):
        ShmTransport(comm, min_bytes=0, sync="barrier" if first else "counter")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_every_rank_reads_the_whole_result_from_its_own_segment(backend):
    """The owners push their reduced slices into every segment: the result lies in this rank's own
    segment of the bucket it packed, right on every call (also across pretend nodes, after the
    cross-node reduction)."""
    comm = MPI.COMM_WORLD
    above = max(backend.direct_max_bytes // 4, 0)  # past the one-synchronisation size
    for k in range(6):
        x = _data(above + 50000 + k, "float32", comm.rank, seed=k)
        expected = np.sum(comm.allgather(x), axis=0, dtype=np.float64)
        backend.pack_buffer(x.size, x.dtype)[:] = x
        bucket = backend._bucket  # after pack_buffer: growing the window starts again at bucket 0
        piece = backend.allreduce_packed(x.size, x.dtype, "sum")
        own = backend._typed(bucket, x.dtype)[backend.layout.local_rank]
        assert np.shares_memory(piece, own), "the result must lie in this rank's segment"
        assert np.allclose(piece, expected, rtol=1e-5, atol=1e-5), f"call {k}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("outnumbered", [False, True])
def test_long_arrays_go_in_chunks_sized_to_the_last_level_cache_by_default(monkeypatch, outnumbered):
    """By default long arrays go in chunks sized to the node's last-level cache (config.node_chunk_bytes, at
    least half of L2), unless the ranks of a node outnumber its cores: then in one pass, on every rank
    (here only the last rank's answer says so). A size the user gives, as an argument or in the
    environment, stands either way."""
    monkeypatch.delenv("MPISTRAT_SHM_CHUNK_BYTES", raising=False)
    monkeypatch.setattr(shm_calibration, "CHUNK_DECISIONS", {})
    comm = MPI.COMM_WORLD
    chunk, source = config.default_chunk_bytes()
    l2 = config.l2_cache_bytes()
    assert source == ("default" if l2 is None else "hardware")
    assert chunk == (1 << 20 if l2 is None else max(1 << 18, 1 << ((l2 // 2).bit_length() - 1)))
    split = topology(comm)
    forced = dataclasses.replace(split, oversubscribed=outnumbered and comm.rank == comm.size - 1)
    try:
        b = ShmTransport(comm, topology=forced, min_bytes=0)
        try:
            want = 0 if outnumbered else config.node_chunk_bytes(forced.layout.local_size)
            assert want == 0 or want >= chunk
            assert b.chunk_bytes == want and b._chunk_items(4 << 20, np.dtype(np.float64)) == want // 8
            assert shm_calibration.CHUNK_DECISIONS == {}, "nothing measured"
        finally:
            b.close()
        b = ShmTransport(comm, topology=forced, min_bytes=0, chunk_bytes=1 << 20)
        try:
            assert b.chunk_bytes == 1 << 20
        finally:
            b.close()
        monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", str(chunk))  # the default's size, given
        b = ShmTransport(comm, topology=forced, min_bytes=0)
        try:
            assert b.chunk_bytes == chunk
        finally:
            b.close()
    finally:
        split.free()


@pytest.mark.mpi(min_size=2)
def test_node_sync_sleeps_after_yielding_only_where_ranks_outnumber_cores():
    """Waiting ranks sleep after their yields (polling) exactly where the machine's ranks outnumber its
    cores; with a core each they never sleep (only latency to lose). At 4 ranks on a 2-core machine the
    first branch runs, at 2 ranks the second."""
    comm = MPI.COMM_WORLD
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED)
    expected = OVERSUBSCRIBED_YIELDS if ranks_outnumber_cores(machine) else None
    machine.Free()
    b = ShmTransport(comm, min_bytes=0, sync="counter")
    try:
        x = np.arange(1000, dtype=np.float64)
        out = np.empty_like(x)
        b.allreduce_array(x, out, "sum")
        np.testing.assert_array_equal(out, x * comm.size)
        assert b.waiter.yields == expected and b._sync.waiter is b.waiter
    finally:
        b.close()
