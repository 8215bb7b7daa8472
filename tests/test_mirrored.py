"""MirroredStrategy on logical CPU devices: run, reductions, replica context, merge_call."""

import threading

import numpy as np
import pytest

import mpistrat as ms

REPLICAS = [1, 2, 4]


def make(n):
    return ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def local(strategy, value):
    return strategy.experimental_local_results(value)


def test_constructor_defaults_and_errors():
    s = ms.MirroredStrategy()
    assert s.num_replicas_in_sync == max(1, ms.devices.num_gpus()) if hasattr(ms, "devices") else True
    with pytest.raises(ValueError, match="No duplicates allowed"):
        ms.MirroredStrategy(["/cpu:0", "CPU:0"])
    with pytest.raises(ValueError, match="must be a list"):
        ms.MirroredStrategy("/cpu:0")
    with pytest.raises(ValueError, match="Malformed device string"):
        ms.MirroredStrategy(["/cpu:0", "/cpux:1"])
    with pytest.raises(ValueError, match="CrossDeviceOps"):
        ms.MirroredStrategy(["/cpu:0"], cross_device_ops=object())


@pytest.mark.parametrize("n", REPLICAS)
def test_run_regroups_per_replica(n):
    s = make(n)
    assert s.num_replicas_in_sync == n
    out = s.run(lambda: ms.get_replica_context().replica_id_in_sync_group * 10)
    assert local(s, out) == tuple(i * 10 for i in range(n))
    if n > 1:
        assert isinstance(out, ms.PerReplica)
    same = object()
    assert s.run(lambda: same) is same  # identical object -> returned as it is


@pytest.mark.parametrize("n", REPLICAS)
def test_run_each_replica_in_its_own_thread(n):
    s = make(n)
    names = local(s, s.run(lambda: threading.current_thread().name))
    assert len(set(names)) == n


@pytest.mark.parametrize("n", [2, 4])
def test_run_unwraps_distributed_arguments(n):
    s = make(n)
    pr = s.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group + 1)
    out = s.run(lambda a, b, k: (a * b, k), args=(pr, 3), kwargs={"k": pr})
    assert local(s, out[0]) == tuple(3 * (i + 1) for i in range(n))
    assert local(s, out[1]) == tuple(i + 1 for i in range(n))


def test_run_mismatched_structures_raise():
    s = make(2)
    with pytest.raises(ValueError, match="different structures"):
        s.run(lambda: [1] if ms.get_replica_context().replica_id_in_sync_group == 0 else (1, 2))


def test_run_rejects_per_replica_of_other_size():
    with pytest.raises(ValueError, match="probably made by another strategy"):
        make(2).run(lambda x: x, args=(ms.PerReplica([1, 2, 3]),))


@pytest.mark.parametrize("n", REPLICAS)
def test_reduce_axis_semantics(n):
    s = make(n)
    # Replica i holds i+1 rows of value i: MEAN over axis 0 divides by the global row count.
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((ctx.replica_id_in_sync_group + 1, 2), float(ctx.replica_id_in_sync_group)))
    rows = [np.full((i + 1, 2), float(i)) for i in range(n)]
    everything = np.concatenate(rows)
    assert np.allclose(s.reduce("mean", pr, axis=0), everything.mean(axis=0))
    assert np.allclose(s.reduce("sum", pr, axis=0), everything.sum(axis=0))
    assert np.allclose(s.reduce("max", pr, axis=0), everything.max(axis=0))
    assert np.allclose(s.reduce("min", pr, axis=0), everything.min(axis=0))
    vec = s.experimental_distribute_values_from_function(lambda ctx: np.arange(3.0) * (ctx.replica_id_in_sync_group + 1))
    expect = sum(np.arange(3.0) * (i + 1) for i in range(n))
    assert np.allclose(s.reduce("sum", vec, axis=None), expect)
    assert np.allclose(s.reduce("mean", vec, axis=None), expect / n)


def test_reduce_mean_with_empty_replica_batches():
    s = make(4)
    pr = ms.PerReplica([np.ones((2, 3)), np.ones((1, 3)) * 4, np.zeros((0, 3)), np.zeros((0, 3))])
    assert np.allclose(s.reduce("mean", pr, axis=0), np.full(3, 2.0))
    assert np.allclose(s.reduce("max", pr, axis=0), np.full(3, 4.0))


@pytest.mark.parametrize("n", [2, 4])
def test_plain_value_reduction_rules(n):
    s = make(n)
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        s.reduce("sum", np.ones(2), axis=None)
    assert np.array_equal(s.reduce("mean", np.ones(2), axis=None), np.ones(2))
    assert s.reduce("sum", 0, axis=None) == 0


def test_one_replica_plain_sum_is_value():
    assert np.array_equal(make(1).reduce("sum", np.arange(3), axis=None), np.arange(3))


@pytest.mark.parametrize("n", REPLICAS)
def test_gather(n):
    s = make(n)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((ctx.replica_id_in_sync_group + 1, 2), ctx.replica_id_in_sync_group))
    g = s.gather(pr, axis=0)
    assert np.array_equal(g, np.concatenate([np.full((i + 1, 2), i) for i in range(n)]))
    cols = s.gather(s.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 1)) * ctx.replica_id_in_sync_group), axis=1)
    assert cols.shape == (2, n) and cols[0].tolist() == list(range(n))


@pytest.mark.parametrize("n", REPLICAS)
def test_values_from_function(n):
    s = make(n)
    array_value = np.array([3.0, 2.0, 1.0, 0.0])
    dv = s.experimental_distribute_values_from_function(lambda ctx: array_value[ctx.replica_id_in_sync_group])
    assert local(s, dv) == tuple(array_value[:n])
    nums = s.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert local(s, nums) == (n,) * n


@pytest.mark.parametrize("n", REPLICAS)
def test_all_reduce_nested_structure(n):
    s = make(n)

    def fn():
        ctx = ms.get_replica_context()
        r = ctx.replica_id_in_sync_group
        value = {"a": np.full(3, r, dtype=np.float32), "b": [np.int64(r), (2.0 * r, np.ones((2, 2)) * r)]}
        return ctx.all_reduce("sum", value), ctx.all_reduce(ms.ReduceOp.MEAN, value), \
            ctx.all_reduce("max", value), ctx.all_reduce("min", value)

    total = sum(range(n))
    for s_, m_, mx, mn in zip(*[local(s, x) for x in s.run(fn)]) if n > 1 else [s.run(fn)]:
        assert s_["a"].dtype == np.float32 and s_["a"].tolist() == [total] * 3
        assert int(s_["b"][0]) == total and float(s_["b"][1][0]) == 2.0 * total
        assert np.allclose(s_["b"][1][1], total)
        assert np.allclose(m_["a"], total / n)
        assert float(mx["b"][1][0]) == 2.0 * (n - 1) and float(mn["b"][1][0]) == 0.0


@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_results_cannot_leak_between_replicas(n):
    s = make(n)
    outs = local(s, s.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(4))))
    # CPU replicas share one read-only result: an in-place write raises instead of changing the others.
    with pytest.raises(ValueError, match="read-only"):
        outs[0][0] = 99.0
    assert all(o.tolist() == [n] * 4 for o in outs)


@pytest.mark.parametrize("n", REPLICAS)
def test_all_gather(n):
    s = make(n)

    def fn():
        r = ms.get_replica_context().replica_id_in_sync_group
        return ms.get_replica_context().all_gather([np.full((1, 2), r), np.full((r + 1,), r)], axis=0)

    for a, b in [local(s, x) for x in zip(*[local(s, v) for v in s.run(fn)])] if False else \
            zip(*[local(s, v) for v in s.run(fn)]):
        assert a.tolist() == [[i, i] for i in range(n)]
        assert b.tolist() == [i for i in range(n) for _ in range(i + 1)]


@pytest.mark.parametrize("n", REPLICAS)
def test_merge_call(n):
    s = make(n)
    calls = []

    def merge_fn(strategy, value, offset=0):
        calls.append(threading.current_thread().name)
        assert ms.in_cross_replica_context() and strategy is s
        vals = strategy.experimental_local_results(value)
        # Return a PerReplica: each replica gets its own component back.
        return ms.PerReplica([v + sum(vals) + offset for v in vals]) if n > 1 else value + value + offset

    def fn():
        r = ms.get_replica_context().replica_id_in_sync_group
        return ms.get_replica_context().merge_call(merge_fn, args=(r,), kwargs={"offset": 100})

    out = local(s, s.run(fn))
    total = sum(range(n))
    assert out == tuple(i + total + 100 for i in range(n))
    assert len(calls) == 1  # merge_fn ran once


def test_merge_call_in_cross_replica_context_raises():
    s = make(2)
    with s.scope():
        with pytest.raises(AttributeError):
            ms.get_replica_context().merge_call(lambda s: None)


@pytest.mark.parametrize("n", [2, 4])
def test_replica_exception_propagates_without_hang(n):
    s = make(n)

    def fn():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group == n - 1:
            raise KeyError("boom in last replica")
        return ctx.all_reduce("sum", 1.0)  # the others wait here and must be released

    with pytest.raises(KeyError, match="boom in last replica"):
        s.run(fn)
    # The strategy still works afterwards.
    assert local(s, s.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))) == (float(n),) * n


def test_merge_fn_exception_reaches_every_replica():
    s = make(2)
    seen = []

    def fn():
        try:
            ms.get_replica_context().merge_call(lambda strategy: 1 / 0)
        except BaseException as exc:  # record what each replica saw, then re-raise
            seen.append(type(exc).__name__)
            raise

    with pytest.raises(ZeroDivisionError):
        s.run(fn)
    assert sorted(seen) == ["ReplicaAbortedError", "ZeroDivisionError"]


def test_collectives_in_different_order_raise():
    s = make(2)

    def fn():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            return ctx.all_reduce("sum", 1.0)
        return ctx.all_gather(np.ones(1), axis=0)

    with pytest.raises(Exception, match="different collectives"):
        s.run(fn)


def test_collective_skipped_by_one_replica_raises():
    s = make(2)

    def fn():
        ctx = ms.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            return ctx.all_reduce("sum", 1.0)
        return 0.0

    with pytest.raises(Exception, match="every replica must call the same collectives"):
        s.run(fn)


def test_all_reduce_of_distributed_value_raises():
    s = make(2)
    pr = ms.PerReplica([1.0, 2.0])
    with pytest.raises(ValueError, match="DistributedValues"):
        s.run(lambda: ms.get_replica_context().all_reduce("sum", pr))


@pytest.mark.parametrize("n", REPLICAS)
def test_extended_properties(n):
    s = make(n)
    devs = tuple(f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n))
    assert s.extended.worker_devices == devs and s.extended.parameter_devices == devs
    assert s.extended.should_checkpoint and s.cluster_resolver is None
    ctx_devices = local(s, s.run(lambda: ms.get_replica_context().devices))
    assert ctx_devices == tuple((d,) for d in devs)


@pytest.mark.parametrize("n", REPLICAS)
def test_reduce_to_and_batch_reduce_to(n):
    s = make(n)
    pr = s.experimental_distribute_values_from_function(lambda ctx: np.ones(2) * (ctx.replica_id_in_sync_group + 1))
    total = n * (n + 1) / 2
    with s.scope():
        on_all = s.extended.reduce_to("sum", pr, list(s.extended.worker_devices))
        one = s.extended.reduce_to("sum", pr, "/cpu:0")
        a, b = s.extended.batch_reduce_to("mean", [(pr, "/cpu:0"), (pr, "/cpu:1")])
    assert all(np.array_equal(v, [total] * 2) for v in local(s, on_all))
    if n > 1:
        assert isinstance(on_all, ms.Mirrored)
    assert one.tolist() == [total] * 2
    assert np.allclose(a, total / n) and np.allclose(b, total / n)


def test_replica_threads_are_reused_and_stopped_with_the_strategy():
    import gc

    s = make(4)
    s.run(lambda: None)
    threads = list(s.extended._group._threads)
    for _ in range(50):
        s.run(lambda: None)
    assert s.extended._group._threads == threads and len(threads) == 3  # persistent, not one per step
    del s
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


def test_strategy_is_collected_after_a_step_whose_replicas_met():
    # The last meeting's outcome (here the strategy itself; often variables that
    # hold it) must not stay with the replica threads, which are alive until the
    # strategy is collected: that cycle would keep both for ever.
    import gc
    import weakref

    s = make(2)
    s.run(lambda: ms.get_replica_context().merge_call(lambda strategy: strategy))
    threads = list(s.extended._group._threads)
    ref = weakref.ref(s)
    del s
    gc.collect()
    assert ref() is None
    for t in threads:
        t.join(timeout=5)
    assert threads and not any(t.is_alive() for t in threads)
