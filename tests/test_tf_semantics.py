"""tf.distribute semantics that a review found missing (each test failed before its fix).

Cases that could deadlock run the body in a daemon thread with a join
timeout, so a deadlock fails the test instead of hanging the suite.
"""

import threading
import time

import numpy as np
import pytest

import mpistrat as ms

SYNC = ms.VariableSynchronization
AGG = ms.VariableAggregation


def make(n=2):
    return ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def finishes(body, timeout=5.0):
    """Run ``body`` in a daemon thread; return (finished, result_or_exception)."""
    box = {}

    def target():
        try:
            box["result"] = body()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), box


# run passes a distributed variable itself to the replica function (TF's select_replica keeps it).
def test_run_passes_the_distributed_variable_not_a_component():
    s = make(2)
    with s.scope():
        v = ms.Variable(0.0, aggregation=AGG.SUM)

    seen = []

    def step(var):
        seen.append(type(var).__name__)
        rid = ms.get_replica_context().replica_id_in_sync_group
        var.assign_add(np.float32(rid + 1))  # SUM-aggregated: every copy becomes 1 + 2
        return var

    out = s.run(step, args=(v,))
    copies = [float(c.numpy()) for c in v.values]
    assert seen == ["MirroredVariable", "MirroredVariable"], seen
    assert copies == [3.0, 3.0], f"mirrored copies diverged: {copies}"
    assert out is v  # every replica returned the variable itself


# A SyncOnRead variable used with no scope behaves as in its strategy's cross-replica context.
def test_sync_on_read_outside_scope_is_cross_replica():
    s = make(2)
    with s.scope():
        total = ms.Variable(0.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    s.run(lambda: total.assign_add(1.0))
    with s.scope():
        assert float(total.numpy()) == 2.0
    # TF: reading outside the scope enters the strategy (enter_or_assert_strategy) -> 2.0
    assert float(total.numpy()) == 2.0
    total.assign(6.0)  # TF: every copy gets 3.0
    assert [float(c.numpy()) for c in total.values] == [3.0, 3.0]


# strategy.reduce with an axis inside a merge_fn completes (it used to deadlock on the replica threads).
def test_reduce_with_axis_inside_merge_fn_does_not_hang():
    s = make(2)

    def merge_fn(strategy, x):
        return strategy.reduce("sum", x, axis=0)

    def step():
        rid = ms.get_replica_context().replica_id_in_sync_group
        return ms.get_replica_context().merge_call(merge_fn, args=(np.arange(3.0) + rid,))

    done, box = finishes(lambda: s.run(step))
    assert done, "strategy.reduce(..., axis=0) inside merge_fn deadlocked"
    assert "error" not in box, box.get("error")
    assert float(box["result"]) == 3.0 + 6.0  # sum of [0, 1, 2] and [1, 2, 3]


def test_strategy_run_inside_merge_fn_runs_on_fresh_replica_threads():
    s = make(2)

    def merge_fn(strategy, x):
        return strategy.run(lambda v: ms.get_replica_context().all_reduce("sum", v) * 10, args=(x,))

    def step():
        rid = ms.get_replica_context().replica_id_in_sync_group
        return ms.get_replica_context().merge_call(merge_fn, args=(np.float64(rid + 1),))

    done, box = finishes(lambda: s.run(step))
    assert done, "strategy.run inside merge_fn deadlocked"
    assert "error" not in box, box.get("error")
    assert [float(x) for x in s.experimental_local_results(box["result"])] == [30.0, 30.0]
    # the strategy's own replica threads still work afterwards
    assert float(s.reduce("sum", s.run(lambda: np.float64(1.0)), axis=None)) == 2.0


# merge_call runs replica 0's merge_fn whatever the arrival order (as TF).
@pytest.mark.parametrize("late", [0, 1])
def test_merge_call_runs_replica_zero_merge_fn(late):
    s = make(2)

    def step():
        rid = ms.get_replica_context().replica_id_in_sync_group
        if rid == late:
            time.sleep(0.2)
        return ms.get_replica_context().merge_call(lambda strategy: rid)

    out = s.run(step)
    assert out == 0, f"merge_fn of replica {out} ran (depends on thread timing)"


# Replicas passing different reduce ops to all_reduce raise instead of using one of them.
def test_all_reduce_with_different_ops_raises():
    s = make(2)

    def step():
        rid = ms.get_replica_context().replica_id_in_sync_group
        if rid == 0:
            time.sleep(0.2)
        return ms.get_replica_context().all_reduce("sum" if rid == 0 else "max", np.float64(rid + 1))

    with pytest.raises(ValueError, match="different reduce ops"):
        s.run(step)


# A CrossDeviceOps shared by two strategies divides MEAN by each call's own replica count.
def test_shared_cross_device_ops_mean():
    ops = ms.ReductionToOneDevice()
    s2 = ms.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    ms.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"], cross_device_ops=ops)
    pr = s2.experimental_distribute_values_from_function(lambda ctx: np.float64(2.0))
    assert float(s2.reduce("mean", pr, axis=None)) == 2.0


# extended.reduce_to in replica context raises (TF: cross-replica context required).
def test_reduce_to_in_replica_context_raises():
    s = make(2)

    def step():
        return s.extended.reduce_to("mean", np.float64(1.0), "/cpu:0")

    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(step)


# A captured ReplicaContext used inside a merge_fn raises instead of hanging.
def test_all_reduce_inside_merge_fn_raises_instead_of_hanging():
    s = make(2)

    def step():
        ctx = ms.get_replica_context()
        return ctx.merge_call(lambda strategy: ctx.all_reduce("sum", np.float64(1.0)))

    done, box = finishes(lambda: s.run(step))
    assert done, "ReplicaContext.all_reduce called from a merge_fn hangs"
    assert isinstance(box.get("error"), RuntimeError) and "call_for_each_replica" in str(box["error"]), box


# extended.update(group=False) gives a tuple of per-copy results (TF's update_regroup).
def test_update_group_false_returns_local_results():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0)
        out = s.extended.update(v, lambda c: float(c.numpy()) + 1, group=False)
    assert isinstance(out, (tuple, list)) and list(out) == [2.0, 2.0], out


# Strategy.reduce accepts a tuple of axes (as TF).
def test_reduce_mean_with_tuple_axis():
    s = make(2)
    pr = s.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 3)) * ctx.replica_id_in_sync_group)
    assert float(s.reduce("sum", pr, axis=(0, 1))) == 6.0
    assert float(s.reduce("mean", pr, axis=(0, 1))) == 0.5


# Entering the same scope object twice keeps the outer scope until its own exit.
def test_same_scope_object_nested():
    s = make(2)
    sc = s.scope()
    with sc:
        with sc:
            pass
        assert ms.in_cross_replica_context() and ms.get_strategy() is s


# experimental_distribute_values_from_function regroups nested results (TF: regroup(always_wrap=True)).
def test_values_from_function_nested_is_regrouped():
    s = make(2)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: {"a": np.float64(ctx.replica_id_in_sync_group), "b": np.float64(1.0)})
    assert isinstance(pr, dict), type(pr)


# MirroredVariable with aggregation NONE updated in replica context changes the replica's own copy,
#     as current TF does (values._on_write_update_replica).
def test_mirrored_aggregation_none_replica_update_is_local():
    s = make(2)
    with s.scope():
        v = ms.Variable(0.0)

    def step():
        v.assign(1.0)

    s.run(step)
    assert [float(c.numpy()) for c in v.values] == [1.0, 1.0]


# extended.update with no strategy in scope updates every copy (TF enters the strategy).
def test_update_outside_scope_is_allowed():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0)
    s.extended.update(v, lambda c, x: c.assign(x), args=(5.0,))
    assert [float(c.numpy()) for c in v.values] == [5.0, 5.0]


# value_container of a plain (non-distributed) variable is the variable itself.
def test_value_container_of_plain_variable():
    s = make(2)
    v = ms.Variable(1.0)
    assert s.extended.value_container(v) is v


# extended.update(group=True) maps the copies back to their distributed variable (TF's regroup).
def test_update_returns_the_distributed_variable():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0)
        out = s.extended.update(v, lambda c, x: c.assign(x), args=(2.0,))
    assert out is v, out


# Replicas passing different axes to all_gather, or differently structured merge_call arguments,
#     raise instead of using one replica's choice.
def test_all_gather_with_different_axes_raises():
    s = make(2)

    def step():
        ctx = ms.get_replica_context()
        rid = ctx.replica_id_in_sync_group
        return ctx.all_gather(np.ones((2, 2)) * rid, axis=rid)

    with pytest.raises(ValueError, match="all_gather with different axes"):
        s.run(step)


def test_merge_call_with_different_argument_structures_raises():
    s = make(2)

    def step():
        rid = ms.get_replica_context().replica_id_in_sync_group
        args = () if rid == 0 else (1.0,)
        return ms.get_replica_context().merge_call(lambda strategy, *a: len(a), args=args)

    with pytest.raises(ValueError, match="merge_call arguments with different structures"):
        s.run(step)
