"""Port of TF 2.21's mirrored_variable_test.py: variables created inside replica functions, named, mirrored.

TF runs ``MirroredVariableCreationTest`` with ``mirrored_strategy_with_gpu_and_cpu`` and a
single-worker ``CollectiveAllReduceStrategy`` on two CPUs; here ``MirroredStrategy`` on two
logical CPUs and ``MultiWorkerMirroredStrategy`` with two local CPUs per rank (under
mpiexec each rank is a worker with two replicas; replica ids are global). Eager mode only.
Variable names are TF's: a variable's ``name`` carries the output index (``"foo:0"``).
"""

import numpy as np
import pytest
from tfsource import tf_source

import mpistrat as ms

SYNC = ms.VariableSynchronization
AGG = ms.VariableAggregation


def mirrored_two_cpus():
    return ms.MirroredStrategy(["/cpu:0", "/cpu:1"])


def collective_two_cpus():
    return ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])


combinations = pytest.mark.parametrize("make", [
    pytest.param(mirrored_two_cpus, id="mirrored_2cpu"),
    pytest.param(collective_two_cpus, id="collective_2cpu", marks=pytest.mark.mpi(min_size=1)),
])


def _replica_id():
    return ms.get_replica_context().replica_id_in_sync_group


def _merge_noop():
    ms.get_replica_context().merge_call(lambda _: _)


def _local_ids(strategy):
    """Global ids of this worker's replicas (0 and 1 in a single worker, as in TF's test)."""
    ids = []
    strategy.run(lambda: ids.append(_replica_id()))
    return sorted(ids)


def _test_mv_properties(var, name, strategy):
    """TF's helper; the name is checked last, so that a wrong name is the only failure it can hide."""
    assert isinstance(var, ms.MirroredVariable)
    assert var.distribute_strategy is strategy
    components = strategy.experimental_local_results(var)
    assert [c.device for c in components] == list(strategy.extended.worker_devices)
    for component in components:
        assert strategy.extended.variable_created_in_scope(component)
    assert var.name == name


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testSingleVariable")
@combinations
def test_single_variable(make):
    distribution = make()

    def model_fn():
        # Created only once across the replica threads.
        v = ms.Variable(1.0, name="foo")
        _merge_noop()
        return v

    with distribution.scope():
        result = distribution.extended.call_for_each_replica(model_fn)
        _test_mv_properties(result, "foo:0", distribution)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testUnnamedVariable")
@combinations
def test_unnamed_variable(make):
    distribution = make()

    def model_fn():
        v = ms.Variable(1.0)
        _merge_noop()
        return v

    with distribution.scope():
        result = distribution.extended.call_for_each_replica(model_fn)
        _test_mv_properties(result, "Variable:0", distribution)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariables")
@combinations
def test_multiple_variables(make):
    distribution = make()

    def model_fn():
        vs = [ms.Variable(1.0, name="foo" + str(i)) for i in range(5)]
        _merge_noop()
        return vs

    with distribution.scope():
        result = distribution.extended.call_for_each_replica(model_fn)
        for i, v in enumerate(result):
            _test_mv_properties(v, "foo" + str(i) + ":0", distribution)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariablesWithSameCanonicalName")
@combinations
def test_multiple_variables_with_same_canonical_name(make):
    distribution = make()

    def model_fn():
        vs = [ms.Variable(1.0, name="foo/bar"), ms.Variable(1.0, name="foo_1/bar"),
              ms.Variable(1.0, name="foo_1/bar_1"), ms.Variable(1.0, name="foo/bar_1")]
        _merge_noop()
        return vs

    with distribution.scope():
        result = distribution.extended.call_for_each_replica(model_fn)
        for v in result:
            assert isinstance(v, ms.MirroredVariable)
        assert len(result) == 4
        assert result[0].name == "foo/bar:0"
        assert result[1].name == "foo_1/bar:0"
        assert result[2].name == "foo_1/bar_1:0"
        assert result[3].name == "foo/bar_1:0"


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testVariableWithSameCanonicalNameAcrossThreads")
@combinations
def test_variable_with_same_canonical_name_across_threads(make):
    distribution = make()
    first = _local_ids(distribution)[0]

    def model_fn():
        v = ms.Variable(1.0, name="foo_" + str(_replica_id()))
        _merge_noop()
        return v

    with distribution.scope():
        result = distribution.extended.call_for_each_replica(model_fn)
        assert isinstance(result, ms.MirroredVariable)
        # The resulting mirrored variable uses the name from the first device.
        assert result.name == f"foo_{first}:0"


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testWithVariableAndVariableScope")
@combinations
def test_with_variable_and_variable_scope(make):
    """TF also opens ``variable_scope("common")`` (tf.compat.v1) around v1-v3, prefixing their names with
    ``common/``; mpistrat has no variable scopes, so the names here carry no prefix."""
    distribution = make()

    def model_fn():
        v0 = ms.Variable(1.0, name="var0", aggregation=AGG.NONE)
        v1 = ms.Variable(1.0, name="var1")
        # This pauses the current thread and runs the other replicas.
        _merge_noop()
        v2 = ms.Variable(1.0, name="var2", synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        v3 = ms.Variable(1.0, name="var3", synchronization=SYNC.ON_WRITE, aggregation=AGG.MEAN)
        return v0, v1, v2, v3

    with distribution.scope():
        v = ms.Variable(1.0, name="var-main0")
        result = distribution.extended.call_for_each_replica(model_fn)
        assert len(result) == 4
        v0, v1, v2, v3 = result
        assert isinstance(v0, ms.MirroredVariable)
        assert isinstance(v1, ms.MirroredVariable)
        assert isinstance(v2, ms.SyncOnReadVariable)
        assert v2.aggregation == AGG.SUM
        assert isinstance(v3, ms.MirroredVariable)
        assert v3.aggregation == AGG.MEAN
        # The names last (see _test_mv_properties).
        assert v.name == "var-main0:0"
        assert [v0.name, v1.name, v2.name, v3.name] == ["var0:0", "var1:0", "var2:0", "var3:0"]


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testOnlyFirstReplicaUpdatesVariables")
@combinations
def test_only_first_replica_updates_variables(make):
    """TF's ``ONLY_FIRST_REPLICA`` takes this worker's first local replica: ``apply_aggregation`` broadcasts
    ``experimental_local_results(value)[0]`` and a sync-on-read variable reads ``_get_replica(0)`` (values.py,
    values_util.py). TF's test has one worker, whose first replica is replica 0; under mpiexec each rank is a
    worker and its first replica is ``first`` below. TF's ``state_ops.assign_add(v, x)`` is ``v.assign_add(x)``."""
    distribution = make()
    first = _local_ids(distribution)[0]

    def create_fn():
        aggregation = AGG.ONLY_FIRST_REPLICA
        v0 = ms.Variable(2.0, name="on_read", synchronization=SYNC.ON_READ, aggregation=aggregation)
        v1 = ms.Variable(3.0, name="on_write", synchronization=SYNC.ON_WRITE, aggregation=aggregation)
        return v0, v1

    def local(var):
        return [float(c.numpy()) for c in distribution.experimental_local_results(var)]

    with distribution.scope():
        v0, v1 = distribution.extended.call_for_each_replica(create_fn)
        assert local(v0) == [2.0, 2.0]
        assert float(distribution.extended.read_var(v0)) == 2.0
        assert local(v1) == [3.0, 3.0]
        assert float(distribution.extended.read_var(v1)) == 3.0

        def replica_id_plus_one():
            return np.float32(_replica_id() + 1)

        # Update using the assign_add member function.
        def update_member_fn():
            update0 = v0.assign_add(5.0 * replica_id_plus_one())
            update1 = v1.assign_add(7.0 * replica_id_plus_one())
            return update0, update1

        distribution.extended.call_for_each_replica(update_member_fn)
        # Writes are not synchronized for "sync on read" variables, so each copy has its replica's update.
        assert local(v0) == [2.0 + (first + 1) * 5.0, 2.0 + (first + 2) * 5.0]
        # Always reads from the first device.
        assert float(distribution.extended.read_var(v0)) == 2.0 + (first + 1) * 5.0
        # Writes are synchronized for v1: only the argument to assign_add on the first device is used.
        assert local(v1) == [3.0 + (first + 1) * 7.0] * 2
        assert float(distribution.extended.read_var(v1)) == 3.0 + (first + 1) * 7.0

        def update_again_fn():
            update0 = v0.assign_add(11.0 * replica_id_plus_one())
            update1 = v1.assign_add(13.0 * replica_id_plus_one())
            return update0, update1

        distribution.extended.call_for_each_replica(update_again_fn)
        assert local(v0) == [2.0 + (first + 1) * (5.0 + 11.0), 2.0 + (first + 2) * (5.0 + 11.0)]
        assert float(distribution.extended.read_var(v0)) == 2.0 + (first + 1) * (5.0 + 11.0)
        assert local(v1) == [3.0 + (first + 1) * (7.0 + 13.0)] * 2
        assert float(distribution.extended.read_var(v1)) == 3.0 + (first + 1) * (7.0 + 13.0)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testNoneSynchronizationWithVariable")
@combinations
def test_none_synchronization_with_variable(make):
    distribution = make()
    with distribution.scope(), pytest.raises(
            ValueError, match="`NONE` variable synchronization mode is not supported with "):
        ms.Variable(1.0, name="v", synchronization=SYNC.NONE)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testInvalidSynchronizationWithVariable")
@combinations
def test_invalid_synchronization_with_variable(make):
    distribution = make()
    with distribution.scope(), pytest.raises(
            ValueError, match="Invalid variable synchronization mode: Invalid for variable: v"):
        ms.Variable(1.0, name="v", synchronization="Invalid")


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testInvalidAggregationWithVariable")
@combinations
def test_invalid_aggregation_with_variable(make):
    distribution = make()
    with distribution.scope(), pytest.raises(
            ValueError, match="Invalid variable aggregation mode: invalid for variable: v"):
        ms.Variable(1.0, name="v", synchronization=SYNC.ON_WRITE, aggregation="invalid")


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testNonMatchingVariableCreation")
@combinations
def test_non_matching_variable_creation(make):
    distribution = make()

    def model_fn(name):
        v = ms.Variable(1.0, name=name)
        _merge_noop()
        return v

    with distribution.scope():
        names = ms.PerReplica(("foo", "bar"))
        with pytest.raises(RuntimeError):
            distribution.extended.call_for_each_replica(model_fn, args=(names,))


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testSyncOnReadVariable")
@combinations
def test_sync_on_read_variable(make):
    """TF reads a replica's component with the private ``v._get()``; here the replica's local result."""
    distribution = make()
    num_local = len(distribution.extended.worker_devices)
    all_v_sum = {}
    all_v_mean = {}
    components_sum = {}
    components_mean = {}

    def model_fn():
        replica_id = _replica_id()
        v_sum = ms.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        v_mean = ms.Variable(4.0, synchronization=SYNC.ON_READ, aggregation=AGG.MEAN)
        assert isinstance(v_sum, ms.SyncOnReadVariable)
        assert isinstance(v_mean, ms.SyncOnReadVariable)
        updates = [v_sum.assign_add(2.0 + replica_id), v_mean.assign(6.0 * replica_id)]
        all_v_sum[replica_id] = v_sum
        all_v_mean[replica_id] = v_mean
        c_sum = distribution.experimental_local_results(v_sum)[replica_id % num_local]
        c_mean = distribution.experimental_local_results(v_mean)[replica_id % num_local]
        components_sum[replica_id] = c_sum
        components_mean[replica_id] = c_mean
        assert v_sum is not c_sum
        assert v_mean is not c_mean
        return updates, v_sum, v_mean, c_sum, c_mean

    with distribution.scope():
        first = _local_ids(distribution)[0]
        # Create "sum" and "mean" versions of SyncOnReadVariables.
        _, ret_v_sum, ret_v_mean, regrouped_sum, regrouped_mean = (
            distribution.extended.call_for_each_replica(model_fn))
        # Should see the same wrapping instance in all replicas.
        assert all_v_sum[first] is ret_v_sum
        assert all_v_mean[first] is ret_v_mean
        assert all_v_sum[first] is all_v_sum[first + 1]
        assert all_v_mean[first] is all_v_mean[first + 1]

        # Regroup should recover the same wrapper.
        assert ret_v_sum is regrouped_sum
        assert ret_v_mean is regrouped_mean
        assert components_sum[first] is not components_sum[first + 1]
        assert components_mean[first] is not components_mean[first + 1]

        for i in range(num_local):
            # Should see different values on different devices.
            gid = first + i
            assert float(distribution.experimental_local_results(ret_v_sum)[i].read_value()) == gid + 3.0
            assert float(distribution.experimental_local_results(ret_v_mean)[i].read_value()) == gid * 6.0
        n = distribution.num_replicas_in_sync
        expected_sum = sum(g + 3.0 for g in range(n))
        expected_mean = sum(g * 6.0 for g in range(n)) / n

        # In cross-replica context the value is the reduction across all replicas (read_var or the variable).
        assert float(distribution.extended.read_var(ret_v_sum)) == expected_sum
        assert float(distribution.extended.read_var(ret_v_mean)) == expected_mean
        assert float(ret_v_sum.value()) == expected_sum
        assert float(ret_v_mean.value()) == expected_mean
        assert float(np.asarray(ret_v_sum)) == expected_sum
        assert float(np.asarray(ret_v_mean)) == expected_mean


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testSyncOnReadVariableUpdate")
@combinations
def test_sync_on_read_variable_update(make):
    distribution = make()
    n = distribution.num_replicas_in_sync

    def model_fn():
        v_sum = ms.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        assert isinstance(v_sum, ms.SyncOnReadVariable)
        return v_sum

    def update(var, value):
        return var.assign(value)

    with distribution.scope():
        ret_v_sum = distribution.extended.call_for_each_replica(model_fn)
        # The aggregated value of the sync-on-read variable is the sum of the copies before the update...
        assert float(distribution.experimental_local_results(ret_v_sum)[0].read_value()) == 1.0
        assert float(np.asarray(ret_v_sum)) == 1.0 * n
        distribution.extended.update(ret_v_sum, update, args=(5.0,), group=False)
        # ...and after it.
        assert float(distribution.experimental_local_results(ret_v_sum)[0].read_value()) == 5.0
        assert float(np.asarray(ret_v_sum)) == 5.0 * n


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testVarDistributeStrategy")
@combinations
def test_var_distribute_strategy(make):
    distribution = make()
    with distribution.scope():
        mirrored = ms.Variable(1.0)
        sync_on_read = ms.Variable(1.0, synchronization=SYNC.ON_READ)
        assert mirrored.distribute_strategy is distribution
        assert sync_on_read.distribute_strategy is distribution
