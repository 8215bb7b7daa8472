"""Port of TF 2.21's mirrored_variable_test.py: variables created inside replica functions, named, mirrored.

TF runs ``MirroredVariableCreationTest`` with ``mirrored_strategy_with_gpu_and_cpu`` and a
single-worker ``CollectiveAllReduceStrategy`` on two CPUs; here ``MirroredStrategy`` on two
logical CPUs and ``MultiWorkerMirroredStrategy`` with two local CPUs per rank (under
mpiexec each rank is a worker with two replicas; replica ids are global). Eager mode only.

Variable names differ deliberately: TF's ``v.name`` is a graph tensor's name with its output index
(``"foo:0"``, unnamed ``"Variable:0"``); mpistrat's carry no ``:0`` and unnamed variables get unique
names ``Variable_N``, because names key mpistrat's checkpoints and the matching of variables created
inside ``run``. Each TF check of a name is a strict expected failure of its own (``*_tf_name``); the
test beside it keeps the method's other checks and mpistrat's name.
"""

import re

import numpy as np
import pytest
from strategies import mirrored_two_cpus
from tfsource import tf_source

import mpistrat as ms

SYNC = ms.VariableSynchronization
AGG = ms.VariableAggregation


def collective_two_cpus():
    return ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])


combinations = pytest.mark.parametrize("make", [
    pytest.param(mirrored_two_cpus, id="mirrored_2cpu"),
    pytest.param(collective_two_cpus, id="collective_2cpu", marks=pytest.mark.mpi(min_size=1)),
])
tf_name = pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="deliberate difference: TF's variable name is a graph tensor's name ('foo:0', unnamed 'Variable:0'); "
           "mpistrat's names carry no ':0' and unnamed variables get unique names Variable_N, because names key "
           "checkpoints and the matching of variables created inside run")
UNIQUE_UNNAMED = re.compile(r"Variable_\d+")


def _replica_id():
    return ms.get_replica_context().replica_id_in_sync_group


def _merge_noop():
    ms.get_replica_context().merge_call(lambda _: _)


def _local_ids(strategy):
    """Global ids of this worker's replicas (0 and 1 in a single worker, as in TF's test)."""
    ids = []
    strategy.run(lambda: ids.append(_replica_id()))
    return sorted(ids)


def _test_mv_properties(var, strategy):
    """TF's helper without its name check (the name is checked apart: see the module docstring)."""
    assert isinstance(var, ms.MirroredVariable)
    assert var.distribute_strategy is strategy
    components = strategy.experimental_local_results(var)
    assert [c.device for c in components] == list(strategy.extended.worker_devices)
    for component in components:
        assert strategy.extended.variable_created_in_scope(component)


def _single_variable(distribution):
    def model_fn():
        # Created only once across the replica threads.
        v = ms.Variable(1.0, name="foo")
        _merge_noop()
        return v

    return distribution.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testSingleVariable")
@combinations
def test_single_variable(make):
    distribution = make()
    with distribution.scope():
        result = _single_variable(distribution)
        _test_mv_properties(result, distribution)
        assert result.name == "foo"


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testSingleVariable")
@tf_name
@combinations
def test_single_variable_tf_name(make):
    distribution = make()
    with distribution.scope():
        assert _single_variable(distribution).name == "foo:0"


def _unnamed_variable(distribution):
    def model_fn():
        v = ms.Variable(1.0)
        _merge_noop()
        return v

    return distribution.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testUnnamedVariable")
@combinations
def test_unnamed_variable(make):
    distribution = make()
    with distribution.scope():
        result = _unnamed_variable(distribution)
        _test_mv_properties(result, distribution)
        assert UNIQUE_UNNAMED.fullmatch(result.name), result.name
        assert _unnamed_variable(distribution).name != result.name


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testUnnamedVariable")
@tf_name
@combinations
def test_unnamed_variable_tf_name(make):
    distribution = make()
    with distribution.scope():
        assert _unnamed_variable(distribution).name == "Variable:0"


def _multiple_variables(distribution):
    def model_fn():
        vs = [ms.Variable(1.0, name="foo" + str(i)) for i in range(5)]
        _merge_noop()
        return vs

    return distribution.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariables")
@combinations
def test_multiple_variables(make):
    distribution = make()
    with distribution.scope():
        result = _multiple_variables(distribution)
        for i, v in enumerate(result):
            _test_mv_properties(v, distribution)
            assert v.name == "foo" + str(i)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariables")
@tf_name
@combinations
def test_multiple_variables_tf_name(make):
    distribution = make()
    with distribution.scope():
        assert [v.name for v in _multiple_variables(distribution)] == ["foo" + str(i) + ":0" for i in range(5)]


def _multiple_variables_with_same_canonical_name(distribution):
    def model_fn():
        vs = [ms.Variable(1.0, name="foo/bar"), ms.Variable(1.0, name="foo_1/bar"),
              ms.Variable(1.0, name="foo_1/bar_1"), ms.Variable(1.0, name="foo/bar_1")]
        _merge_noop()
        return vs

    return distribution.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariablesWithSameCanonicalName")
@combinations
def test_multiple_variables_with_same_canonical_name(make):
    distribution = make()
    with distribution.scope():
        result = _multiple_variables_with_same_canonical_name(distribution)
        for v in result:
            assert isinstance(v, ms.MirroredVariable)
        assert len(result) == 4
        assert [v.name for v in result] == ["foo/bar", "foo_1/bar", "foo_1/bar_1", "foo/bar_1"]


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testMultipleVariablesWithSameCanonicalName")
@tf_name
@combinations
def test_multiple_variables_with_same_canonical_name_tf_name(make):
    distribution = make()
    with distribution.scope():
        result = _multiple_variables_with_same_canonical_name(distribution)
        assert [v.name for v in result] == ["foo/bar:0", "foo_1/bar:0", "foo_1/bar_1:0", "foo/bar_1:0"]


def _variable_with_same_canonical_name_across_threads(distribution):
    def model_fn():
        v = ms.Variable(1.0, name="foo_" + str(_replica_id()))
        _merge_noop()
        return v

    return distribution.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testVariableWithSameCanonicalNameAcrossThreads")
@combinations
def test_variable_with_same_canonical_name_across_threads(make):
    distribution = make()
    first = _local_ids(distribution)[0]
    with distribution.scope():
        result = _variable_with_same_canonical_name_across_threads(distribution)
        assert isinstance(result, ms.MirroredVariable)
        # The resulting mirrored variable uses the name from the first device.
        assert result.name == f"foo_{first}"


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testVariableWithSameCanonicalNameAcrossThreads")
@tf_name
@combinations
def test_variable_with_same_canonical_name_across_threads_tf_name(make):
    distribution = make()
    first = _local_ids(distribution)[0]
    with distribution.scope():
        assert _variable_with_same_canonical_name_across_threads(distribution).name == f"foo_{first}:0"


def _variables_and_variable_scope(distribution):
    """TF also opens ``variable_scope("common")`` (tf.compat.v1) around v1-v3, prefixing their names with
    ``common/``; mpistrat has no variable scopes, so the names here carry no prefix."""
    def model_fn():
        v0 = ms.Variable(1.0, name="var0", aggregation=AGG.NONE)
        v1 = ms.Variable(1.0, name="var1")
        # This pauses the current thread and runs the other replicas.
        _merge_noop()
        v2 = ms.Variable(1.0, name="var2", synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        v3 = ms.Variable(1.0, name="var3", synchronization=SYNC.ON_WRITE, aggregation=AGG.MEAN)
        return v0, v1, v2, v3

    v = ms.Variable(1.0, name="var-main0")
    return v, distribution.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testWithVariableAndVariableScope")
@combinations
def test_with_variable_and_variable_scope(make):
    distribution = make()
    with distribution.scope():
        v, result = _variables_and_variable_scope(distribution)
        assert len(result) == 4
        v0, v1, v2, v3 = result
        assert isinstance(v0, ms.MirroredVariable)
        assert isinstance(v1, ms.MirroredVariable)
        assert isinstance(v2, ms.SyncOnReadVariable)
        assert v2.aggregation == AGG.SUM
        assert isinstance(v3, ms.MirroredVariable)
        assert v3.aggregation == AGG.MEAN
        assert v.name == "var-main0"
        assert [v0.name, v1.name, v2.name, v3.name] == ["var0", "var1", "var2", "var3"]


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testWithVariableAndVariableScope")
@tf_name
@combinations
def test_with_variable_and_variable_scope_tf_name(make):
    distribution = make()
    with distribution.scope():
        v, result = _variables_and_variable_scope(distribution)
        assert [v.name] + [r.name for r in result] == ["var-main0:0", "var0:0", "var1:0", "var2:0", "var3:0"]


def _only_first_replica_updates(distribution):
    """TF's steps: create ``ONLY_FIRST_REPLICA`` variables, update them twice with per-replica values.

    Returns what TF's test reads after each step: ``v0`` (sync-on-read) and ``v1`` (mirrored), each copy
    of this worker and the cross-replica read (``read_var``). TF's ``state_ops.assign_add(v, x)`` is
    ``v.assign_add(x)`` and reads the same.
    """
    def create_fn():
        aggregation = AGG.ONLY_FIRST_REPLICA
        v0 = ms.Variable(2.0, name="on_read", synchronization=SYNC.ON_READ, aggregation=aggregation)
        v1 = ms.Variable(3.0, name="on_write", synchronization=SYNC.ON_WRITE, aggregation=aggregation)
        return v0, v1

    def update_fn(scale0, scale1):
        replica_id_plus_one = np.float32(_replica_id() + 1)
        return v0.assign_add(scale0 * replica_id_plus_one), v1.assign_add(scale1 * replica_id_plus_one)

    def observe():
        def local(var):
            return [float(c.numpy()) for c in distribution.experimental_local_results(var)]

        return {"v0": local(v0), "v0_read": float(distribution.extended.read_var(v0)),
                "v1": local(v1), "v1_read": float(distribution.extended.read_var(v1))}

    with distribution.scope():
        v0, v1 = distribution.extended.call_for_each_replica(create_fn)
        steps = [observe()]
        for scale0, scale1 in ((5.0, 7.0), (11.0, 13.0)):
            distribution.extended.call_for_each_replica(update_fn, args=(scale0, scale1))
            steps.append(observe())
    return steps


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testOnlyFirstReplicaUpdatesVariables")
@combinations
def test_only_first_replica_updates_variables(make):
    """A sync-on-read variable's copies each take their own replica's update; ``ONLY_FIRST_REPLICA`` reads and
    updates use global replica 0's value on every worker, so mirrored copies stay identical across workers.
    In one worker (TF's test) global replica 0 is this worker's first replica, as TF's rule has it
    (``apply_aggregation`` broadcasts ``experimental_local_results(value)[0]``, a sync-on-read variable reads
    ``_get_replica(0)``: values.py, values_util.py); with several workers test_only_first_replica_tf_workers."""
    distribution = make()
    first = _local_ids(distribution)[0]
    steps = _only_first_replica_updates(distribution)
    assert steps[0] == {"v0": [2.0, 2.0], "v0_read": 2.0, "v1": [3.0, 3.0], "v1_read": 3.0}
    for step, (scale0, scale1) in zip(steps[1:], ((5.0, 7.0), (5.0 + 11.0, 7.0 + 13.0))):
        # Writes are not synchronized for "sync on read" variables, so each copy has its replica's update.
        assert step["v0"] == [2.0 + (first + 1) * scale0, 2.0 + (first + 2) * scale0]
        # Reads from global replica 0 (TF: the first device of this worker).
        assert step["v0_read"] == 2.0 + 1 * scale0
        # Writes are synchronized for v1: only global replica 0's argument to assign_add is used.
        assert step["v1"] == [3.0 + 1 * scale1] * 2
        assert step["v1_read"] == 3.0 + 1 * scale1


def _not_first_worker() -> bool:
    """Whether this rank's first replica is not global replica 0 (for the xfail condition below)."""
    from mpi4py import MPI as _MPI

    return _MPI.COMM_WORLD.rank != 0


@tf_source("mirrored_variable_test.py::MirroredVariableCreationTest::testOnlyFirstReplicaUpdatesVariables")
@pytest.mark.mpi(min_size=1)
@pytest.mark.xfail(
    condition="_not_first_worker()", strict=True, raises=AssertionError,
    reason="deliberate difference: with several workers TF applies each worker's own first local replica's "
           "value (a mirrored variable's copies then differ across workers); mpistrat applies global replica 0's "
           "value on every worker, so mirrored copies stay identical")
def test_only_first_replica_tf_workers():
    """TF's values with several workers: each worker reads and applies its own first replica's value."""
    distribution = collective_two_cpus()
    first = _local_ids(distribution)[0]
    steps = _only_first_replica_updates(distribution)
    for step, (scale0, scale1) in zip(steps[1:], ((5.0, 7.0), (5.0 + 11.0, 7.0 + 13.0))):
        assert step["v0_read"] == 2.0 + (first + 1) * scale0
        assert step["v1"] == [3.0 + (first + 1) * scale1] * 2
        assert step["v1_read"] == 3.0 + (first + 1) * scale1


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
