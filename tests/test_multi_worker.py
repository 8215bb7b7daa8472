"""MultiWorkerMirroredStrategy across MPI ranks (run at 1, 2 and 4 ranks).

Every test runs once per backend variant (``backend_variants.py``): shared
memory as configured, forced on, forced off, and forced on across two pretend
nodes.
"""

import weakref

import numpy as np
import pytest
from backend_variants import backend_variant  # noqa: F401  (autouse)
from mpi4py import MPI

import mpistrat as ms

AGG = ms.VariableAggregation
SYNC = ms.VariableSynchronization


def world():
    return MPI.COMM_WORLD


@pytest.fixture(params=[1, 2], ids=["1local", "2local"])
def strategy(request):
    devices = [f"/cpu:{i}" for i in range(request.param)]
    return ms.MultiWorkerMirroredStrategy(local_devices=devices)


def replica_value(global_id):
    """A value that depends only on the global replica id (same program on any layout)."""
    rng = np.random.default_rng(global_id)
    return rng.standard_normal((global_id % 3 + 1, 4))


@pytest.mark.mpi(min_size=1)
def test_layout_and_ids(strategy):
    size, rank = world().size, world().rank
    local = len(strategy.extended.worker_devices)
    assert strategy.num_replicas_in_sync == size * local
    assert strategy.extended.worker_devices == tuple(
        f"/job:worker/replica:0/task:{rank}/device:CPU:{i}" for i in range(local))
    ids = strategy.experimental_local_results(strategy.run(lambda: ms.get_replica_context().replica_id_in_sync_group))
    assert ids == tuple(rank * local + i for i in range(local))
    assert strategy.extended.should_checkpoint == (rank == 0)
    assert strategy.cluster_resolver.task_id == rank and strategy.cluster_resolver.task_type == "worker"


@pytest.mark.mpi(min_size=1)
def test_all_reduce_and_all_gather_across_ranks(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = ms.get_replica_context()
        g = ctx.replica_id_in_sync_group
        value = {"v": np.full(5, g, np.float32), "i": np.int64(g), "s": [float(g)]}
        return (ctx.all_reduce("sum", value), ctx.all_reduce("mean", value), ctx.all_reduce("max", value),
                ctx.all_gather(np.full((g % 2 + 1, 2), g), axis=0))

    total = n * (n - 1) / 2
    expect_gather = np.concatenate([np.full((g % 2 + 1, 2), g) for g in range(n)])
    out = strategy.run(fn)
    for s_, m_, mx, gath in zip(*(strategy.experimental_local_results(x) for x in out)):
        assert s_["v"].tolist() == [total] * 5 and int(s_["i"]) == total and float(s_["s"][0]) == total
        assert np.allclose(m_["v"], total / n)
        assert float(mx["s"][0]) == n - 1
        assert np.array_equal(gath, expect_gather)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("container", ["array", "list", "tuple", "mixed list", "empty list"])
def test_all_reduce_keeps_the_structure_of_arrays_lists_and_tuples(strategy, container):
    # One local replica takes a shortcut for arrays and flat lists or tuples of arrays; two do not.
    n = strategy.num_replicas_in_sync
    make = {
        "array": lambda g: np.full(3, g, np.float32),
        "list": lambda g: [np.full(3, g, np.float32), np.full((2, 2), 2 * g)],
        "tuple": lambda g: (np.full(3, g, np.float32), np.full((2, 2), 2 * g)),
        "mixed list": lambda g: [np.full(3, g, np.float32), float(g)],
        "empty list": lambda g: [],
    }[container]

    def fn():
        g = ms.get_replica_context().replica_id_in_sync_group
        value = make(g)
        before = [np.array(v, copy=True) for v in (value if isinstance(value, (list, tuple)) else [value])]
        out = [ms.get_replica_context().all_reduce(op, value) for op in ("sum", "mean", "max")]
        after = value if isinstance(value, (list, tuple)) else [value]
        assert all(np.array_equal(b, a) for b, a in zip(before, after)), "the input must be untouched"
        if isinstance(value, (list, tuple)):
            assert all(o is not value for o in out), "a list or tuple comes back as a new one"
        return out

    for sums, means, maxes in strategy.experimental_local_results(strategy.run(fn)):
        expected = [make(n * (n - 1) / 2), make((n - 1) / 2), make(n - 1)]
        for got, want in zip((sums, means, maxes), expected):
            assert type(got) is type(want), (type(got), type(want))
            pairs = zip(got, want) if isinstance(want, (list, tuple)) else [(got, want)]
            assert len(got) == len(want) if isinstance(want, (list, tuple)) else got.shape == want.shape
            for g_, w_ in pairs:
                assert np.allclose(g_, w_), (g_, w_)


@pytest.mark.mpi(min_size=1)
def test_reduce_and_gather_in_cross_replica_context(strategy):
    n = strategy.num_replicas_in_sync
    pr = strategy.experimental_distribute_values_from_function(lambda ctx: replica_value(ctx.replica_id_in_sync_group))
    everything = np.concatenate([replica_value(g) for g in range(n)])
    assert np.allclose(strategy.reduce("mean", pr, axis=0), everything.mean(axis=0))
    assert np.allclose(strategy.reduce("sum", pr, axis=0), everything.sum(axis=0))
    assert np.allclose(strategy.reduce("min", pr, axis=0), everything.min(axis=0))
    assert np.array_equal(strategy.gather(pr, axis=0), everything)
    vec = strategy.experimental_distribute_values_from_function(lambda ctx: np.full(3, ctx.replica_id_in_sync_group + 1.0))
    assert np.allclose(strategy.reduce("sum", vec, axis=None), n * (n + 1) / 2)


@pytest.mark.mpi(min_size=2)
def test_plain_value_is_this_workers_value():
    s = ms.MultiWorkerMirroredStrategy()
    rank, size = world().rank, world().size
    assert float(s.reduce("sum", np.float64(rank + 1), axis=None)) == size * (size + 1) / 2
    assert float(s.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))) == size


@pytest.mark.mpi(min_size=1)
def test_merge_call_across_ranks(strategy):
    n = strategy.num_replicas_in_sync

    def merge_fn(strat, value):
        return strat.reduce("sum", value, axis=None)

    out = strategy.run(lambda: ms.get_replica_context().merge_call(
        merge_fn, args=(float(ms.get_replica_context().replica_id_in_sync_group),)))
    assert all(float(x) == n * (n - 1) / 2 for x in strategy.experimental_local_results(out))


@pytest.mark.mpi(min_size=1)
def test_variables_start_from_the_chief_and_stay_in_sync(strategy):
    rank = world().rank
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = ms.Variable(np.full(3, float(rank)), aggregation=AGG.SUM)  # differs per rank on purpose
        mean = ms.Variable(0.0, aggregation=AGG.MEAN)
        first = ms.Variable(0.0, aggregation=AGG.ONLY_FIRST_REPLICA)
        counter = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    assert all(c.numpy().tolist() == [0.0] * 3 for c in v.values)  # the chief's value

    def step():
        g = float(ms.get_replica_context().replica_id_in_sync_group)
        v.assign_add(np.full(3, g))
        mean.assign(g)
        first.assign(g + 10.0)
        counter.assign_add(1.0)

    strategy.run(step)
    total = n * (n - 1) / 2
    assert all(c.numpy().tolist() == [total] * 3 for c in v.values)
    assert all(float(c.numpy()) == total / n for c in mean.values)
    assert all(float(c.numpy()) == 10.0 for c in first.values)
    with strategy.scope():
        assert float(counter.value()) == n  # summed over every replica of every rank
        counter.assign(float(n) * 2)
        assert float(counter.value()) == 2.0 * n


@pytest.mark.mpi(min_size=2)
def test_same_numbers_as_mirrored_with_all_replicas_in_one_process():
    """N ranks x R local replicas == one process with N*R replicas, same program."""
    size = world().size
    local = 2
    multi = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    single = ms.MirroredStrategy([f"/cpu:{i}" for i in range(size * local)])

    def program(strategy):
        with strategy.scope():
            w = ms.Variable(np.linspace(0, 1, 4), aggregation=AGG.MEAN)
        data = strategy.experimental_distribute_values_from_function(lambda ctx: replica_value(ctx.replica_id_in_sync_group))

        def step(x):
            grad = ms.get_replica_context().all_reduce("mean", (x @ w.value()).sum() * np.ones(4))
            w.assign_sub(0.01 * grad)
            return (x @ w.value()).sum()

        for _ in range(3):
            out = strategy.run(step, args=(data,))
        return strategy.reduce("sum", out, axis=None), w.numpy()

    loss_m, w_m = program(multi)
    loss_s, w_s = program(single)
    assert np.allclose(loss_m, loss_s, rtol=1e-12) and np.allclose(w_m, w_s, rtol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_different_local_device_counts_raise_on_every_rank():
    devices = ["/cpu:0"] if world().rank == 0 else ["/cpu:0", "/cpu:1"]
    with pytest.raises(ValueError, match="same number of local devices.*rank 0: 1.*rank 1: 2"):
        ms.MultiWorkerMirroredStrategy(local_devices=devices)


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_raise_on_every_rank():
    s = ms.MultiWorkerMirroredStrategy()
    shape = 4 if world().rank == 0 else 5
    with pytest.raises(Exception, match=r"(?i)mismatch"):
        s.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(shape)))
    # The strategy is still usable afterwards (nothing left half-done).
    assert float(s.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))) == world().size


@pytest.mark.mpi(min_size=2)
def test_sub_communicator_strategies():
    comm = world()
    sub = comm.Split(color=comm.rank % 2, key=comm.rank)
    try:
        s = ms.MultiWorkerMirroredStrategy(cluster_resolver=ms.cluster_resolver.MPIClusterResolver(sub))
        assert s.num_replicas_in_sync == sub.size
        total = s.run(lambda: ms.get_replica_context().all_reduce("sum", float(comm.rank)))
        assert float(total) == sum(r for r in range(comm.size) if r % 2 == comm.rank % 2)
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_non_finite_check_names_the_replica_on_every_rank():
    s = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    s.extended._cross_device_ops.check_numerics = True
    bad_replica = 2 * world().size - 1  # the last replica of the last rank

    def step():
        g = ms.get_replica_context().replica_id_in_sync_group
        grad = np.full(3, np.nan if g == bad_replica else 1.0, np.float32)
        return ms.get_replica_context().all_reduce("sum", [np.ones(2), grad])

    with pytest.raises(FloatingPointError, match=rf"replica {bad_replica} \(rank {world().size - 1}\) value #1"):
        s.run(step)
    s.extended._cross_device_ops.check_numerics = False
    assert np.isnan(s.experimental_local_results(s.run(step))[0][1]).all()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_reduce_to_in_replica_context_raises_without_collective(strategy):
    # Every replica of every rank raises before any collective starts (TF's cross-replica rule),
    # so concurrent replica threads never enter MPI and nothing hangs.
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.extended.reduce_to("mean", np.float64(1.0), "/cpu:0"))
    assert strategy.reduce("sum", strategy.run(lambda: np.float64(1.0)), axis=None) == strategy.num_replicas_in_sync


@pytest.mark.mpi(min_size=1)
def test_cross_rank_semantics_outside_scope_and_in_merge_fn(strategy):
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        total = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        w = ms.Variable(np.zeros(2, np.float32))
    strategy.run(lambda: total.assign_add(np.float32(ms.get_replica_context().replica_id_in_sync_group + 1)))
    assert float(total.numpy()) == n * (n + 1) / 2  # read with no scope: aggregated across ranks

    def merge_fn(s, x):  # strategy.reduce with an axis inside a merge_fn (a nested run)
        return s.reduce("sum", x, axis=(0, 1))

    def step():
        g = ms.get_replica_context().replica_id_in_sync_group
        reduced = ms.get_replica_context().merge_call(merge_fn, args=(np.full((2, 3), float(g)),))
        strategy.extended.update(w, lambda c, r: c.assign(np.full(2, r, np.float32)), args=(reduced,))
        return reduced

    out = strategy.run(step)
    expect = 6.0 * n * (n - 1) / 2
    assert float(out) == expect  # merge_fn's one result, handed to every replica (returned as is)
    assert all(np.array_equal(c.numpy(), [expect, expect]) for c in w.values)


@pytest.mark.mpi(min_size=2)
def test_dropped_strategy_frees_its_shared_window():
    from mpistrat.comm.runtime import lifetime
    from mpistrat.comm.runtime import shm_window

    lifetime.release_dropped()  # earlier tests' strategies
    base = len(shm_window._OPEN)
    opts = ms.experimental.CommunicationOptions(implementation="SHM")
    for _ in range(3):  # a job that builds strategy after strategy does not pile up windows
        s = ms.MultiWorkerMirroredStrategy(communication_options=opts)
        grads = [np.ones(50_000), np.ones(7)]  # one packed bucket: it goes through the window
        assert float(s.run(lambda: ms.get_replica_context().all_reduce("sum", grads))[0][0]) == world().size
        shm = s.extended._communicator.transports[0]
        # data and counter windows, and the packed bucket's shared result blocks
        assert shm.name == "shm" and len(shm_window._OPEN) <= base + 3
        win, segment = shm._window.win, weakref.ref(shm._window.segment(0))
        del s, shm
    # The next strategy on these ranks (plain MPI: no window of its own) releases the dropped one's.
    ms.MultiWorkerMirroredStrategy(communication_options=ms.experimental.CommunicationOptions(implementation="MPI"))
    assert win == MPI.WIN_NULL, "the dropped strategy's window must be freed"
    assert segment() is None, "no view may outlive Win.Free"
    assert len(shm_window._OPEN) <= base


@pytest.mark.mpi(min_size=2)
def test_all_reduce_in_strategy_run_allocates_no_arrays_per_step():
    import tracemalloc

    s = ms.MultiWorkerMirroredStrategy()
    grads = {"w": np.ones((300, 100), np.float32), "b": np.ones(100, np.float32), "big": np.ones(300_000, np.float32)}

    def step():
        ctx = ms.get_replica_context()
        return ctx.all_reduce("sum", grads), ctx.all_reduce("max", grads["big"])

    for _ in range(3):
        s.run(step)  # results dropped: their pooled arrays are free for the next step
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            out = s.run(step)
            del out
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # Fusion buckets, staging and result arrays are reused: far less than one step's 1.3 MB of results.
    assert peak < 100_000, peak
