"""RankCommunicator collectives: correctness at 1, 2 and 4 ranks.

Every test runs once per backend variant (``backend_variants.py``): shared
memory as configured, forced on, forced off, and forced on across two pretend
nodes.
"""

import numpy as np
import pytest
from mpi4py import MPI
from backend_variants import backend_variant  # noqa: F401  (autouse)

from mpistrat.comm import CommunicationOptions, RankCommunicator, Transport
from mpistrat.comm.communicator import normalize_op

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (1000,), (33, 65)]
DTYPES = ["float32", "float64", "int32", "int64", "uint8", "int16", "complex64"]


@pytest.fixture
def rc(comm):
    c = RankCommunicator(comm)
    yield c
    c.close()


def local_value(rank, shape, dtype, salt=0):
    rng = np.random.default_rng(1000 * rank + salt)
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return (rng.integers(-5, 6, shape) + 1j * rng.integers(-5, 6, shape)).astype(dt)
    if dt.kind == "u":
        return rng.integers(0, 40, shape).astype(dt)
    return rng.integers(-50, 51, shape).astype(dt)


def expected(size, shape, dtype, op, salt=0):
    values = [local_value(r, shape, dtype, salt) for r in range(size)]
    if op == "sum":
        out = values[0].copy()
        for v in values[1:]:
            out = (out + v).astype(values[0].dtype)
        return out
    return np.minimum.reduce(values) if op == "min" else np.maximum.reduce(values)


@pytest.mark.mpi(min_size=2)
def test_backend_variant_in_effect(rc, backend_variant):  # noqa: F811
    names = [b.name for b in rc.transports]
    assert names[-1] == "mpi"
    if backend_variant == "shm-off":
        assert names == ["mpi"]
    elif backend_variant != "auto":
        shm = rc.transports[0]
        assert shm.name == "shm" and shm.min_bytes == 0
        assert shm.layout.num_nodes == (2 if backend_variant == "pretend-2-nodes" else 1)
        assert shm.layout.pretend == (backend_variant == "pretend-2-nodes")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["sum", "min", "max"])
def test_allreduce_shapes_dtypes(rc, op):
    for dtype in DTYPES:
        if np.dtype(dtype).kind == "c" and op != "sum":
            continue
        arrays = [local_value(rc.rank, s, dtype, i) for i, s in enumerate(SHAPES)]
        before = [a.copy() for a in arrays]
        out = rc.allreduce(arrays, op)
        for i, (o, s) in enumerate(zip(out, SHAPES)):
            assert o.shape == s and o.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(o, expected(rc.size, s, dtype, op, i))
        for a, b in zip(arrays, before):  # inputs untouched
            np.testing.assert_array_equal(a, b)


@pytest.mark.mpi(min_size=1)
def test_mixed_dtypes_tiny_buckets_and_scalars(rc):
    specs = [((5,), "float32"), ((2, 2), "int64"), ((3,), "float32"), ((), "float64"), ((9,), "int64"), ((4,), "float32")]
    arrays = [local_value(rc.rank, s, d, i) for i, (s, d) in enumerate(specs)]
    for opts in (None, CommunicationOptions(bytes_per_pack=8), CommunicationOptions(bytes_per_pack=1)):
        out = rc.allreduce(arrays + [rc.rank + 1, 0.5], "sum", opts)
        for i, (s, d) in enumerate(specs):
            np.testing.assert_array_equal(out[i], expected(rc.size, s, d, "sum", i))
            assert out[i].dtype == np.dtype(d)
        assert out[-2] == rc.size * (rc.size + 1) // 2
        assert out[-1] == 0.5 * rc.size


@pytest.mark.mpi(min_size=1)
def test_many_buckets_many_arrays(rc):
    arrays = [np.full((i % 7 + 1,), rc.rank + i, dtype=np.float64) for i in range(200)]
    out = rc.allreduce(arrays, "max", CommunicationOptions(bytes_per_pack=64))
    for i, o in enumerate(out):
        np.testing.assert_array_equal(o, np.full((i % 7 + 1,), rc.size - 1 + i, np.float64))


@pytest.mark.mpi(min_size=1)
def test_inplace_overwrites_and_returns_inputs(rc):
    a = np.full((4, 3), rc.rank + 1.0, np.float32)
    b = np.arange(6, dtype=np.int32) * (rc.rank + 1)
    c = np.asfortranarray(np.ones((3, 2)) * rc.rank)  # non-contiguous in C order: packed
    out = rc.allreduce([a, b, c], "sum", inplace=True)
    assert out[0] is a and out[1] is b and out[2] is c
    n = rc.size
    np.testing.assert_array_equal(a, np.full((4, 3), n * (n + 1) / 2, np.float32))
    np.testing.assert_array_equal(b, np.arange(6) * n * (n + 1) // 2)
    np.testing.assert_array_equal(c, np.ones((3, 2)) * n * (n - 1) / 2)
    big = np.full(300_000, rc.rank, np.float32)  # single large array: straight to MPI
    (res,) = rc.allreduce([big], "min", inplace=True)
    assert res is big and big.max() == 0


@pytest.mark.mpi(min_size=1)
def test_results_not_overwritten_by_later_calls(rc):
    x = np.full(1000, rc.rank + 1.0)
    y = [np.full(10, rc.rank + 1.0), np.full(3, 2.0)]
    first = rc.allreduce([x], "sum")[0]
    first_list = rc.allreduce(y, "sum")
    total = rc.size * (rc.size + 1) / 2
    for _ in range(5):
        later = rc.allreduce([x * 3], "sum")[0]
        later_list = rc.allreduce([v * 7 for v in y], "sum")
        np.testing.assert_array_equal(later, 3 * total)
        np.testing.assert_array_equal(later_list[0], 7 * total)
    np.testing.assert_array_equal(first, total)
    np.testing.assert_array_equal(first_list[0], total)
    np.testing.assert_array_equal(first_list[1], 2.0 * rc.size)
    # A large single array (it may go through the shared-memory backend).
    big = np.full(300_000, rc.rank + 1.0, np.float32)
    big_first = rc.allreduce([big], "sum")[0]
    big_later = rc.allreduce([big * 2], "sum")[0]
    np.testing.assert_array_equal(big_first, np.float32(total))
    np.testing.assert_array_equal(big_later, np.float32(2 * total))
    np.testing.assert_array_equal(big, rc.rank + 1.0)
    # A dropped result may be recycled, but a view of one pins it.
    view = rc.allreduce([x], "sum")[0][:10]
    rc.allreduce([x * 5], "sum")
    np.testing.assert_array_equal(view, total)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_allgather_uneven(rc, axis):
    n = rc.rank + 1 if axis == 0 else rc.rank % 2 + 1
    shape = [2, 3, 2]
    shape[axis] = n
    local = np.full(shape, rc.rank, np.int32)
    out = rc.allgather(local, axis=axis)
    sizes = [r + 1 if axis == 0 else r % 2 + 1 for r in range(rc.size)]
    expect = np.concatenate([np.full([*shape[:axis % 3], s, *shape[axis % 3 + 1:]], r, np.int32)
                             for r, s in enumerate(sizes)], axis=axis)
    np.testing.assert_array_equal(out, expect)
    assert out.flags.c_contiguous


@pytest.mark.mpi(min_size=1)
def test_allgather_empty_contribution(rc):
    local = np.zeros((0, 2)) if rc.rank == 0 else np.ones((1, 2))
    out = rc.allgather(local)
    assert out.shape == (rc.size - 1, 2)


@pytest.mark.mpi(min_size=1)
def test_broadcast_from_each_root(rc):
    for root in range(rc.size):
        arrays = [np.full((3,), rc.rank, np.float32), np.full((2, 2), rc.rank * 10, np.int64), np.float64(rc.rank)]
        out = rc.broadcast(arrays, root=root, options=CommunicationOptions(bytes_per_pack=4))
        np.testing.assert_array_equal(out[0], np.full((3,), root, np.float32))
        np.testing.assert_array_equal(out[1], np.full((2, 2), root * 10))
        assert out[2] == root and out[1].dtype == np.int64
        np.testing.assert_array_equal(arrays[0], rc.rank)  # input untouched


@pytest.mark.mpi(min_size=1)
def test_objects_step_agreement_barrier(rc):
    assert rc.broadcast_object({"r": rc.rank}, root=rc.size - 1) == {"r": rc.size - 1}
    assert rc.allgather_object(("x", rc.rank)) == [("x", r) for r in range(rc.size)]
    codes = rc.step_agreement(rc.rank * 3 - 1)
    assert codes.dtype == np.int64 and codes.tolist() == [r * 3 - 1 for r in range(rc.size)]
    rc.barrier()


@pytest.mark.mpi(min_size=1)
def test_shm_and_mpi_implementations_agree(comm):
    x = [np.arange(300_000, dtype=np.float32) * (comm.rank + 1), np.ones(7, np.int64),
         np.ones(1000, np.float32) * comm.rank, np.arange(3, dtype=np.int64)]
    results = []
    for impl in ("MPI", "SHM", "AUTO"):
        with RankCommunicator(comm, CommunicationOptions(implementation=impl)) as c:
            names = [b.name for b in c.transports]
            assert names[-1] == "mpi" and (impl != "MPI" or names == ["mpi"])
            for _ in range(3):  # buckets are reused across calls
                results.append(c.allreduce(x, "sum"))
            results.append(c.allreduce([a.copy() for a in x], "sum", inplace=True))
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            np.testing.assert_array_equal(a, b)


def test_normalize_op():
    from mpistrat.ops import ReduceOp

    assert normalize_op("SUM") == "sum" and normalize_op(ReduceOp.MAX) == "max"
    with pytest.raises(ValueError, match="divide"):
        normalize_op(ReduceOp.MEAN)
    with pytest.raises(ValueError, match="Unknown"):
        normalize_op("prod")


class DupAllreduceTransport(Transport):
    """A small extra transport: ``Allreduce`` on a duplicate of the communicator, sums only.

    It is the whole contract a new transport implements: a subclass of ``Transport`` and one
    ``register_transport`` row; nothing else in the library changes.
    """

    name = "dup-allreduce"
    calls = 0  # counted over every instance: the strategy's communicator makes its own

    def __init__(self, comm):
        self.comm = comm.Dup()
        self.buf = {}

    @classmethod
    def create(cls, ctx):
        """The table's factory."""
        return cls(ctx.comm)

    def enabled(self, nbytes, dtype, op):
        return op == "sum"

    def pack_buffer(self, count, dtype):
        buf = self.buf.get(np.dtype(dtype))
        if buf is None or buf.size < count:
            buf = self.buf[np.dtype(dtype)] = np.empty(count, dtype)
        return buf[:count]

    def allreduce_packed(self, count, dtype, op, hook, out=None):
        hook.staged()
        DupAllreduceTransport.calls += 1
        buf = self.buf[np.dtype(dtype)][:count]
        if out is None:
            self.comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
            return buf
        self.comm.Allreduce(buf, out, MPI.SUM)
        return out

    def allreduce_array(self, src, dst, op, hook):
        hook.staged()
        DupAllreduceTransport.calls += 1
        self.comm.Allreduce(src, dst, MPI.SUM)

    def close(self):
        self.buf.clear()
        self.comm.Free()


@pytest.fixture
def dup_transport(monkeypatch):
    """The table with ``DupAllreduceTransport`` first for RING (restored afterwards)."""
    from mpistrat.comm import register_transport
    from mpistrat.comm.transport import table

    monkeypatch.setattr(table, "FACTORIES", dict(table.FACTORIES))
    monkeypatch.setattr(table, "PREFERENCES", dict(table.PREFERENCES))
    register_transport("dup-allreduce", DupAllreduceTransport.create, implementations=("RING",))
    monkeypatch.setattr(DupAllreduceTransport, "calls", 0)


@pytest.mark.mpi(min_size=2)
def test_a_registered_transport_serves_the_communicator(comm, dup_transport):
    with RankCommunicator(comm, CommunicationOptions(implementation="RING")) as c:
        assert [t.name for t in c.transports] == ["dup-allreduce", "mpi"]
        out = c.allreduce([np.ones(3), np.ones(2) * comm.rank], "sum")  # one packed bucket
        assert DupAllreduceTransport.calls == 1
        np.testing.assert_array_equal(out[1], np.full(2, comm.size * (comm.size - 1) / 2))
        out = c.allreduce([np.full(5, comm.rank + 1.0)], "sum")  # one array, twice: check overlapped
        out = c.allreduce([np.full(5, comm.rank + 1.0)], "sum")
        assert DupAllreduceTransport.calls == 3 and out[0][0] == comm.size * (comm.size + 1) / 2
        out = c.allreduce([np.ones(3), np.ones(2)], "max")  # not enabled for max: plain MPI
        assert DupAllreduceTransport.calls == 3 and out[0].tolist() == [1, 1, 1]
    with RankCommunicator(comm) as c:  # AUTO's row is unchanged
        assert "dup-allreduce" not in [t.name for t in c.transports]


@pytest.mark.mpi(min_size=2)
def test_register_backend_keeps_its_calling_convention(comm, monkeypatch):
    """``register_backend(name, factory)``: the factory gets ``(comm, options)``, as it always did."""
    from mpistrat.comm import register_backend
    from mpistrat.comm.transport import table

    monkeypatch.setattr(table, "FACTORIES", dict(table.FACTORIES))
    monkeypatch.setattr(table, "PREFERENCES", dict(table.PREFERENCES))
    monkeypatch.setattr(DupAllreduceTransport, "calls", 0)
    seen = []

    def factory(c, options):
        seen.append(options.implementation.name)
        return DupAllreduceTransport(c)

    register_backend("old-style", factory, implementations=("RING",))
    with RankCommunicator(comm, CommunicationOptions(implementation="RING")) as c:
        assert [t.name for t in c.transports] == ["dup-allreduce", "mpi"] and seen == ["RING"]
        assert c.allreduce([np.ones(3)], "sum")[0].tolist() == [comm.size] * 3
        assert DupAllreduceTransport.calls == 1


@pytest.mark.mpi(min_size=2)
def test_the_strategy_picks_a_registered_transport(comm, dup_transport):
    import mpistrat as ms

    strategy = ms.MultiWorkerMirroredStrategy(communication_options=ms.experimental.CommunicationOptions(
        implementation="RING"))
    try:
        def step(x):
            return ms.get_replica_context().all_reduce("sum", x)

        out = strategy.run(step, args=(np.full(4, comm.rank + 1.0, np.float32),))
        assert out.tolist() == [comm.size * (comm.size + 1) / 2] * 4
        assert DupAllreduceTransport.calls == 1
        assert strategy.reduce("sum", np.ones(2, np.float32), axis=None).tolist() == [comm.size] * 2
        assert DupAllreduceTransport.calls == 2
    finally:
        strategy.extended._communicator.close()


@pytest.mark.mpi(min_size=2)
def test_hot_path_allocates_no_arrays(rc):
    import tracemalloc

    arrays = [np.ones(100_000, np.float32), np.ones(50_000, np.float32), np.ones(10, np.float64)]

    def step():
        rc.allreduce(arrays, "sum")  # results dropped: their pooled arrays are free again
        rc.allreduce(arrays[:1], "max")
        rc.allreduce([a.copy() for a in arrays[1:]], "min", inplace=True)

    for _ in range(3):
        step()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            step()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # Only the test's own input copies (200 KB each step) may be allocated, not results or buckets.
    assert peak < 50_000 * 4 + 100_000, peak


@pytest.mark.mpi(min_size=2)
def test_dropped_communicator_is_released_once_dropped_on_every_rank(comm):
    from mpi4py import MPI

    from mpistrat.comm.runtime import lifetime

    lifetime.release_dropped(comm)  # earlier tests' leftovers
    kept = RankCommunicator(comm, CommunicationOptions(implementation="SHM"))
    assert kept.allreduce([np.ones(10), np.ones(3)], "sum")[0].tolist() == [comm.size] * 10  # a packed bucket
    win = kept.transports[0]._window.win
    dup = kept.comm
    if comm.rank == 0:
        del kept  # dropped here only: nothing collective may happen yet
    assert lifetime.release_dropped(comm) == 0
    assert win != MPI.WIN_NULL and dup != MPI.COMM_NULL
    if comm.rank != 0:
        del kept
    assert lifetime.release_dropped(comm) == 1
    assert win == MPI.WIN_NULL and dup == MPI.COMM_NULL and lifetime.dropped_count() == 0


@pytest.mark.mpi(min_size=2)
def test_dropped_sub_communicator_is_released_by_a_collective_point_over_all_ranks(comm):
    # A strategy on a Split of the ranks that is never rebuilt: the next collective
    # point over all ranks releases it once every rank of the split has dropped it.
    from mpi4py import MPI

    from mpistrat.comm.runtime import lifetime

    lifetime.release_dropped(comm)  # earlier tests' leftovers
    sub = comm.Split(color=comm.rank % 2, key=comm.rank)
    try:
        c = RankCommunicator(sub, CommunicationOptions(implementation="SHM"))
        assert c.allreduce([np.ones(10), np.ones(3)], "sum")[0].tolist() == [sub.size] * 10
        window = getattr(c.transports[0], "_window", None)  # none on a one-rank split
        win = window.win if window is not None else None
        dup = c.comm
        sub_size = sub.size
    finally:
        sub.Free()  # the user's communicator; the strategy holds its own duplicate
    # World rank 0 drops it first: released at once only where it was alone in its split.
    first = 1 if comm.rank == 0 and sub_size == 1 else 0
    if comm.rank == 0:
        del c
    assert lifetime.release_dropped(comm) == first
    if comm.rank == 0 and sub_size > 1:
        assert dup != MPI.COMM_NULL and (win is None or win != MPI.WIN_NULL)  # rank 2 still holds it
    if comm.rank != 0:
        del c
    assert lifetime.release_dropped(comm) == 1 - first
    assert dup == MPI.COMM_NULL and (win is None or win == MPI.WIN_NULL) and lifetime.dropped_count() == 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunks", ["auto", "2M"])
@pytest.mark.parametrize("inplace", [False, True])
def test_ranks_with_strided_and_contiguous_arrays_of_one_shape_meet(comm, monkeypatch, chunks, inplace):
    """The ranks agree on shapes and dtypes, not on memory layout: a rank passing a strided view must
    take the same collective path as one passing a contiguous array (with chunked reduction, the paths
    used to differ, and the ranks waited for each other forever)."""
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", chunks)
    c = RankCommunicator(comm)
    try:
        shape = (2048, 1024)  # 8 MiB of float32: long enough for chunks and for the chunk measurement
        if comm.rank % 2:
            a = np.full((shape[0], 2 * shape[1]), comm.rank + 1.0, np.float32)[:, ::2]
            assert not a.flags.c_contiguous
        else:
            a = np.full(shape, comm.rank + 1.0, np.float32)
        [out] = c.allreduce([a], "sum", inplace=inplace)
        total = comm.size * (comm.size + 1) / 2
        assert out.shape == shape and np.all(out == total)
        assert (out is a) == inplace and np.all(a == (total if inplace else comm.rank + 1.0))
    finally:
        c.close()
