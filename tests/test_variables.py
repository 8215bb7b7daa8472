"""Distributed variables on MirroredStrategy: creation, aggregation and tf.distribute's assign semantics."""

import numpy as np
import pytest

import mpistrat as ms

AGG = ms.VariableAggregation
SYNC = ms.VariableSynchronization


def make(n):
    return ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def copies(v):
    return [c.numpy().tolist() for c in v.values]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mirrored_variable_creation(n):
    s = make(n)
    with s.scope():
        v = ms.Variable(lambda: np.arange(3.0), name="w")
        auto = ms.Variable(1.0, synchronization=SYNC.AUTO)
    assert isinstance(v, ms.MirroredVariable) and isinstance(v, ms.Variable) and isinstance(v, ms.DistributedValues)
    assert isinstance(auto, ms.MirroredVariable)
    assert len(v.values) == n and copies(v) == [[0.0, 1.0, 2.0]] * n
    assert [c.device for c in v.values] == list(s.extended.worker_devices)
    assert len({id(c.value()) for c in v.values}) == n  # separate buffers per device
    assert v.name == "w" and v.shape == (3,) and v.dtype == np.float64 and v.trainable
    assert s.extended.variable_created_in_scope(v)
    assert s.experimental_local_results(v) == tuple(v.values)


def test_variable_creation_errors():
    s = make(2)
    with s.scope():
        with pytest.raises(ValueError, match="`NONE` variable synchronization mode is not supported"):
            ms.Variable(1.0, synchronization=SYNC.NONE)
        with pytest.raises(ValueError, match="Invalid variable aggregation mode"):
            ms.Variable(1.0, aggregation="sum")
        on_read = ms.Variable(1.0, synchronization=SYNC.ON_READ)
        assert not on_read.trainable


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mirrored_sum_assign_sub_in_replica_context(n):
    s = make(n)
    with s.scope():
        v = ms.Variable(10.0, aggregation=AGG.SUM)
    s.run(lambda: v.assign_sub(float(ms.get_replica_context().replica_id_in_sync_group + 1)))
    expect = 10.0 - n * (n + 1) / 2
    assert copies(v) == [expect] * n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mirrored_mean_and_first_replica(n):
    s = make(n)
    with s.scope():
        mean = ms.Variable(0.0, aggregation=AGG.MEAN)
        first = ms.Variable(0.0, aggregation=AGG.ONLY_FIRST_REPLICA)

    def fn():
        r = float(ms.get_replica_context().replica_id_in_sync_group)
        mean.assign_add(r)
        first.assign(r + 7.0)
        return mean.value(), first.value()

    seen_mean, seen_first = s.run(fn)
    assert copies(mean) == [sum(range(n)) / n] * n
    assert copies(first) == [7.0] * n
    # Inside the step every replica read its own (updated) copy.
    assert [float(x) for x in s.experimental_local_results(seen_first)] == [7.0] * n


def test_mirrored_update_without_aggregation_changes_only_the_replicas_copy():
    # As current tf.distribute (values._on_write_update_replica): aggregation NONE in replica
    # context updates the replica's own copy; keeping the copies equal is the caller's job.
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0)
    s.run(lambda: v.assign(10.0 + ms.get_replica_context().replica_id_in_sync_group))
    assert copies(v) == [10.0, 11.0]


def test_mirrored_mean_on_integer_variable_raises():
    s = make(2)
    with s.scope():  # as TF 2.x: refused at creation
        with pytest.raises(ValueError, match="aggregation=MEAN and a non-floating dtype"):
            ms.Variable(np.int32(1), aggregation=AGG.MEAN)


def test_identical_value_sum_in_replica_context_raises():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0, aggregation=AGG.SUM)
    same = np.float32(3.0)
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        s.run(lambda: v.assign(same))


def test_distributed_value_to_update_in_replica_context_raises():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0, aggregation=AGG.SUM)
    captured = ms.PerReplica([1.0, 2.0])
    with pytest.raises(ValueError, match="in replica context with a PerReplica"):
        s.run(lambda: v.assign(captured) if False else v._assign("assign", captured))


def test_mirrored_cross_replica_assign():
    s = make(2)
    with s.scope():
        v = ms.Variable([1.0, 2.0])
        v.assign([3.0, 4.0])
        assert copies(v) == [[3.0, 4.0]] * 2
        v.assign_add(np.ones(2))
        assert v.numpy().tolist() == [4.0, 5.0]
        v.assign(ms.Mirrored([np.zeros(2), np.zeros(2)]))
        assert copies(v) == [[0.0, 0.0]] * 2
        with pytest.raises(ValueError, match="Cannot assign a PerReplica value to MirroredVariable"):
            v.assign(ms.PerReplica([np.zeros(2), np.ones(2)]))


def test_sync_on_read_semantics():
    s = make(2)
    with s.scope():
        total = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        avg = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.MEAN)
        first = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.ONLY_FIRST_REPLICA)
        plain = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.NONE)
    assert isinstance(total, ms.SyncOnReadVariable)

    def fn():
        r = float(ms.get_replica_context().replica_id_in_sync_group)
        for var in (total, avg, first, plain):
            var.assign_add(r + 1.0)
        return total.value()

    local_reads = s.experimental_local_results(s.run(fn))
    assert [float(x) for x in local_reads] == [1.0, 2.0]  # replica context reads the local copy
    with s.scope():
        assert float(total.value()) == 3.0  # cross-replica: sum of the copies
        assert float(avg.value()) == 1.5
        assert float(first.value()) == 1.0
        assert float(s.reduce("sum", total, axis=None)) == 3.0
        with pytest.raises(ValueError, match="aggregation NONE"):
            plain.value()
        total.assign(6.0)
        assert copies(total) == [3.0, 3.0]  # 6.0 / 2 replicas per copy
        assert float(total.value()) == 6.0
        with pytest.raises(ValueError, match="does not support `assign_add` in cross-replica context"):
            total.assign_add(1.0)
        with pytest.raises(ValueError, match="does not support `assign_sub` in cross-replica context"):
            total.assign_sub(1.0)
        avg.assign_add(1.0)
        assert copies(avg) == [2.0, 3.0]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_extended_update(n):
    s = make(n)
    with s.scope():
        v = ms.Variable(np.zeros(2))
        pr = s.experimental_distribute_values_from_function(lambda ctx: np.full(2, 1.0))
        out = s.extended.update(v, lambda comp, d: comp.assign_add(d), args=(pr,), group=False)
        assert copies(v) == [[1.0, 1.0]] * n
        seen = s.extended.update(v, lambda comp: ms.get_replica_context() is None, group=True)
    assert seen is True
    assert out is not None


def test_update_in_replica_context_goes_through_merge_call():
    # As tf.distribute's _replica_ctx_update: every replica calls update, the replicas'
    # arguments are regrouped and each copy gets its own replica's argument.
    s = make(2)
    with s.scope():
        v = ms.Variable(0.0)

    def step():
        rid = ms.get_replica_context().replica_id_in_sync_group
        return s.extended.update(v, lambda c, x: c.assign(x), args=(np.float32(5 + rid),))

    assert s.run(step) is v
    assert copies(v) == [5.0, 6.0]


def test_merge_call_update_pattern():
    """The optimizer pattern: gradients per replica, reduced and applied in merge_call."""
    s = make(4)
    with s.scope():
        w = ms.Variable(np.ones(3))

    def apply(strategy, grad):
        reduced = strategy.extended.reduce_to("mean", grad, w)
        strategy.extended.update(w, lambda comp, g: comp.assign_sub(0.5 * g), args=(reduced,))

    def step():
        r = ms.get_replica_context().replica_id_in_sync_group
        ms.get_replica_context().merge_call(apply, args=(np.full(3, float(r)),))

    s.run(step)
    assert copies(w) == [[1.0 - 0.5 * 1.5] * 3] * 4


def test_variable_used_with_another_strategy_raises():
    a, b = make(2), make(2)
    with a.scope():
        v = ms.Variable(0.0)
    with b.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            v.assign(1.0)


def test_updates_never_change_a_value_someone_holds():
    """value() is a snapshot (TF: a read is a tensor later assignments do not change), even when updates run in place."""
    v = ms.Variable(np.arange(4, dtype=np.float32))
    held = v.value()
    view = v.value()[1:3]
    exported = memoryview(v.value())
    v.assign_sub(np.ones(4, np.float32))
    v.assign_add(np.float32(0.5))
    np.testing.assert_array_equal(held, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(view, [1, 2])
    np.testing.assert_array_equal(np.asarray(exported), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(v.numpy(), np.arange(4, dtype=np.float32) - 0.5)
    assert not v.value().flags.writeable


@pytest.mark.parametrize("take", ["getitem", "slice", "transpose", "reshape", "buffer"])
def test_a_view_alone_keeps_updates_off_the_memory_it_shows(take):
    # A view is all the caller keeps (no value() held beside it). Variables keep their arrays on a cache line
    # (mpistrat.aligned), views of the memory's owner: a view of one holds that owner, which the in-place
    # check must count too. Sizes whose NumPy allocations land on and off a cache line.
    for n in (3, 4, 5, 8, 13, 64, 1000, 4099):
        v = ms.Variable(np.arange(n, dtype=np.float32).reshape(1, n))
        kept = {"getitem": lambda: v[0, 1:3], "slice": lambda: v.value()[:, 1:3], "transpose": lambda: v.value().T,
                "reshape": lambda: v.value().reshape(-1), "buffer": lambda: memoryview(v.value())}[take]()
        before = np.array(kept)
        v.assign_add(np.ones((1, n), np.float32))
        v.assign_sub(np.full((1, n), 0.5, np.float32))
        np.testing.assert_array_equal(np.asarray(kept), before)
        np.testing.assert_array_equal(v.numpy(), np.arange(n, dtype=np.float32).reshape(1, n) + 0.5)


def test_updates_of_an_unshared_value_reuse_its_memory_with_the_same_bits():
    rng = np.random.default_rng(0)
    start = rng.standard_normal(1000).astype(np.float32)
    deltas = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    v = ms.Variable(start)
    address = v.value().ctypes.data
    for d in deltas:
        v.assign_sub(d)
    v.assign_add(deltas[0])
    assert v.value().ctypes.data == address  # no one held the array: updated where it was
    expected = start.copy()
    for d in deltas:
        expected = expected - d
    expected = expected + deltas[0]
    np.testing.assert_array_equal(v.numpy(), expected)
    mixed = ms.Variable(start)
    mixed.assign_sub(deltas[0].astype(np.float64))  # another dtype: the copying path, same result as before
    np.testing.assert_array_equal(mixed.numpy(), (start - deltas[0].astype(np.float64)).astype(np.float32))
