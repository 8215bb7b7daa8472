"""TF 2.21's mirrored_strategy_test.py ported: MirroredStrategy in one process, eager, NumPy values.

TF runs these cases on a GPU and the CPU (``mirrored_strategy_with_gpu_and_cpu``) or
on two GPUs; here two logical CPU devices give the two replicas (docs/design.md,
"Logical CPU devices"), and ``["/cpu:0"]`` stands for TF's one-device
combinations. The bodies TF shares through strategy_test_lib are ported in
``distribution_test_base.py``. What is left out, and why: NOT_PORTED.md.
"""

from __future__ import annotations

from typing import Any, Callable

import distribution_test_base as base
import numpy as np
import pytest
from tfsource import tf_source

import mpistrat as ms
from mpistrat.devices import parse_device

AGG = ms.VariableAggregation
SYNC = ms.VariableSynchronization


def two_devices() -> ms.MirroredStrategy:
    """TF's mirrored_strategy_with_gpu_and_cpu / with_two_gpus: two replicas."""
    return ms.MirroredStrategy(["/cpu:0", "/cpu:1"])


def one_device() -> ms.MirroredStrategy:
    """TF's mirrored_strategy_with_one_cpu / with_one_gpu: one replica."""
    return ms.MirroredStrategy(["/cpu:0"])


BOTH = pytest.mark.parametrize("make_strategy", [two_devices, one_device], ids=["two_devices", "one_device"])


def _replica_id() -> np.ndarray:
    """mirrored_strategy_test._replica_id: this replica's id as an array."""
    return np.asarray(ms.get_replica_context().replica_id_in_sync_group)


# -- MirroredTwoDeviceDistributionTest and MirroredOneDeviceDistributionTest ---------------------------------------


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testMinimizeLoss",
           "mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testMinimizeLoss")
@BOTH
def test_minimize_loss(make_strategy: Callable[[], Any]) -> None:
    base.minimize_loss(make_strategy())


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testReplicaId",
           "mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testReplicaId")
@BOTH
def test_replica_id(make_strategy: Callable[[], Any]) -> None:
    base.replica_id(make_strategy())


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testNumReplicasInSync")
def test_num_replicas_in_sync() -> None:
    assert two_devices().num_replicas_in_sync == 2


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testCallAndMergeExceptions",
           "mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testCallAndMergeExceptions")
@BOTH
def test_call_and_merge_exceptions(make_strategy: Callable[[], Any]) -> None:
    base.call_and_merge_exceptions(make_strategy())


def _lists_of_replica_id_length() -> list:
    return list(range(int(_replica_id())))


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testRunRegroupError")
def test_run_regroup_error() -> None:
    """Replicas returning lists of different lengths cannot be regrouped: mpistrat raises ValueError naming
    each replica's structure (TF's AssertionError: test_run_regroup_error_tf_exception)."""
    strategy = two_devices()
    with strategy.scope(), pytest.raises(ValueError, match=r"different structures: replica 0: \[\], replica 1: "):
        strategy.extended.call_for_each_replica(_lists_of_replica_id_length)


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testRunRegroupError")
@pytest.mark.xfail(strict=True, raises=ValueError,
                   reason="deliberate difference: TF's regroup fails an `assert` (AssertionError); mpistrat raises "
                          "a ValueError naming the structures that differ")
def test_run_regroup_error_tf_exception() -> None:
    """TF: ``with self.assertRaises(AssertionError)`` (mirrored_strategy_test.py testRunRegroupError)."""
    strategy = two_devices()
    with strategy.scope(), pytest.raises(AssertionError):
        strategy.extended.call_for_each_replica(_lists_of_replica_id_length)


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testReduceToCpu")
def test_reduce_to_cpu() -> None:
    strategy = two_devices()
    with strategy.scope():
        result = strategy.extended.call_for_each_replica(_replica_id)
        reduced = strategy.reduce(ms.ReduceOp.SUM, result, axis=None)
        assert reduced == sum(range(strategy.num_replicas_in_sync))


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testReduceToCpuNested")
def test_reduce_to_cpu_nested() -> None:
    """``Strategy.reduce`` of a tuple of per-replica values reduces each (TF: testReduceToCpuNested)."""
    strategy = two_devices()
    with strategy.scope():
        run_result = strategy.run(lambda t: (t + np.float32(1.0), t - np.float32(1.0)), args=(np.float32(3.0),))
        reduced_result = strategy.reduce("SUM", run_result, axis=None)
        n = strategy.num_replicas_in_sync
        assert tuple(float(r) for r in reduced_result) == (4.0 * n, 2.0 * n)


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testReduceAxisToCpu")
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_reduce_axis_to_cpu(dtype: Any) -> None:
    """SUM and MEAN along axis 0 of per-replica arrays of different lengths: the MEAN is over all elements of
    all replicas (TF divides the global sum by the global count, also for int32)."""
    strategy = two_devices()

    def replica_squared_fn() -> np.ndarray:  # replica r: r+1 copies of r
        rid = ms.get_replica_context().replica_id_in_sync_group
        return np.asarray([rid] * (rid + 1), dtype)

    with strategy.scope():
        num_replicas = strategy.num_replicas_in_sync
        result = strategy.extended.call_for_each_replica(replica_squared_fn)
        expected = sum(x * (x + 1) for x in range(num_replicas))
        np.testing.assert_allclose(strategy.reduce(ms.ReduceOp.SUM, result, axis=0), expected, atol=1e-5)
        expected /= sum(x + 1 for x in range(num_replicas))
        np.testing.assert_allclose(strategy.reduce(ms.ReduceOp.MEAN, result, axis=0), expected, atol=1e-5)


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testReplicateDataset")
def test_replicate_dataset() -> None:
    base.replicate_dataset(two_devices())


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testGlobalStepUpdate")
def test_global_step_update() -> None:
    base.global_step_update(two_devices())


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testRun",
           "mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testRun")
@pytest.mark.parametrize("make_strategy, check", [(two_devices, base.run_two_device), (one_device, base.run_one_device)],
                         ids=["two_devices", "one_device"])
def test_run(make_strategy: Callable[[], Any], check: Callable[[Any], None]) -> None:
    check(make_strategy())


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testAllReduceSum",
           "mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testAllReduceSum",
           "mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testAllReduceMean",
           "mirrored_strategy_test.py::MirroredOneDeviceDistributionTest::testAllReduceMean")
@pytest.mark.parametrize("make_strategy, comm_fn, inputs, expected, sliced", [
    # TwoDeviceDistributionTestBase feeds replica i element i of `inputs`, the one-device base all of it.
    pytest.param(two_devices, base.all_sum, base.TWO_DEVICE_INPUTS, (4.0, [42.0, 43.0]), True, id="sum-two_devices"),
    pytest.param(one_device, base.all_sum, (4.0, [42.0, 43.0]), (4.0, [42.0, 43.0]), False, id="sum-one_device"),
    pytest.param(two_devices, base.all_mean, base.TWO_DEVICE_INPUTS, (2.0, [21.0, 21.5]), True, id="mean-two_devices"),
    pytest.param(one_device, base.all_mean, (2.0, [21.0, 22.0]), (2.0, [21.0, 22.0]), False, id="mean-one_device"),
])
def test_all_reduce(make_strategy: Callable[[], Any], comm_fn: Callable[[Any], Any], inputs: tuple,
                    expected: tuple, sliced: bool) -> None:
    base.collective_comms(make_strategy(), comm_fn, inputs, expected, sliced)


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::testTrainableVariables")
def test_trainable_variables() -> None:
    base.trainable_variable(two_devices())


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::test_prefetch_to_device_dataset")
def test_prefetch_to_device_dataset() -> None:
    """``experimental_fetch_to_device=True``: each replica's part is on a device of its replica's device type."""
    strategy = two_devices()
    device_types = base.first_item_device_types(strategy, ms.InputOptions(experimental_fetch_to_device=True))
    assert device_types == [parse_device(d).device_type for d in strategy.extended.worker_devices]


@tf_source("mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest::test_prefetch_to_host_dataset")
def test_prefetch_to_host_dataset() -> None:
    """``experimental_fetch_to_device=False``: every replica's part stays on the host CPU."""
    strategy = two_devices()
    device_types = base.first_item_device_types(strategy, ms.InputOptions(experimental_fetch_to_device=False))
    assert set(device_types) == {"CPU"}


# -- MirroredThreeDeviceDistributionTest ---------------------------------------------------------------------------


def _variable_in_three_replicas(strategy: Any) -> Any:
    def model_fn() -> Any:
        v = ms.Variable(1.0, name="foo")
        ms.get_replica_context().merge_call(lambda _: _)
        return v

    return strategy.extended.call_for_each_replica(model_fn)


@tf_source("mirrored_strategy_test.py::MirroredThreeDeviceDistributionTest::testThreeDevices")
def test_three_devices() -> None:
    """A variable created in the replica function of a three-replica strategy is one mirrored variable, named
    ``"foo"`` (TF's ``"foo:0"``: test_three_devices_tf_name). TF uses two GPUs and the CPU; three logical CPU
    devices here."""
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        result = _variable_in_three_replicas(strategy)
        assert isinstance(result, ms.MirroredVariable)  # distribute_utils.is_mirrored
        assert len(strategy.experimental_local_results(result)) == 3
        assert result.name == "foo"


@tf_source("mirrored_strategy_test.py::MirroredThreeDeviceDistributionTest::testThreeDevices")
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="deliberate difference: TF's variable name is a graph tensor's name ('foo:0'); mpistrat's "
                          "names carry no ':0', because names key checkpoints and the matching of variables "
                          "created inside run")
def test_three_devices_tf_name() -> None:
    """TF: ``self.assertEqual("foo:0", result.name)``."""
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    with strategy.scope():
        assert _variable_in_three_replicas(strategy).name == "foo:0"


# -- MirroredVariableUpdateTest: assign, assign_add, assign_sub in replica and cross-replica context ---------------


def _var_in_replicas(strategy: Any, initial: float, aggregation: Any = AGG.NONE) -> Any:
    """TF's ``var_fn`` run by ``call_for_each_replica``: one MirroredVariable for all replicas."""
    mirrored_var = strategy.extended.call_for_each_replica(
        lambda: ms.Variable(initial, name="foo", aggregation=aggregation))
    assert isinstance(mirrored_var, ms.MirroredVariable)  # distribute_utils.is_mirrored
    return mirrored_var


@tf_source("mirrored_strategy_test.py::MirroredVariableUpdateTest::"
           "testAssignMirroredVarReplicaContextWithoutAggregationType")
def test_assign_mirrored_var_replica_context_without_aggregation_type() -> None:
    """Aggregation NONE: each replica assigns its own copy; all assigned 5.0, so the variable reads 5.0."""
    strategy = two_devices()
    with strategy.scope():
        mirrored_var = _var_in_replicas(strategy, 1.0)
        strategy.experimental_local_results(
            strategy.extended.call_for_each_replica(lambda: mirrored_var.assign(5.0)))
        assert float(mirrored_var) == 5.0


@tf_source("mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignMirroredVarReplicaContextWithSum")
def test_assign_mirrored_var_replica_context_with_sum() -> None:
    """Aggregation SUM: a value that is the same on every replica cannot be summed (TF's error and message)."""
    strategy = two_devices()
    with strategy.scope():
        mirrored_var = _var_in_replicas(strategy, 1.0, AGG.SUM)
        with pytest.raises(ValueError, match=r"A non-DistributedValues value 5\.0 cannot be reduced with the "
                                             r"given reduce op ReduceOp\.SUM\."):
            strategy.extended.call_for_each_replica(lambda: mirrored_var.assign(5.0))


@tf_source("mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignMirroredVarCrossDeviceContext")
def test_assign_mirrored_var_cross_device_context() -> None:
    strategy = two_devices()
    with strategy.scope():
        mirrored_var = _var_in_replicas(strategy, 1.0)
        assert float(mirrored_var) == 1.0
        assert float(mirrored_var.assign(6.0)) == 6.0


def _assert_copies(strategy: Any, mirrored_var: Any, value: float) -> None:
    """Every local copy holds ``value`` and copy i lives on worker device i (TF: ``_devices[i]``)."""
    copies = strategy.experimental_local_results(mirrored_var)
    assert [float(c) for c in copies] == [value] * len(copies)
    assert [c.device for c in copies] == list(strategy.extended.worker_devices)


@tf_source("mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignAddMirroredVarCrossDeviceContext")
def test_assign_add_mirrored_var_cross_device_context() -> None:
    strategy = two_devices()
    with strategy.scope():
        mirrored_var = _var_in_replicas(strategy, 1.0)
        assert float(mirrored_var) == 1.0
        assert float(mirrored_var.assign_add(6.0, read_value=True)) == 7.0
        _assert_copies(strategy, mirrored_var, 7.0)
        mirrored_var.assign_add(2.0, read_value=False)
        _assert_copies(strategy, mirrored_var, 9.0)


@tf_source("mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignSubMirroredVarCrossDeviceContext")
def test_assign_sub_mirrored_var_cross_device_context() -> None:
    strategy = two_devices()
    with strategy.scope():
        mirrored_var = _var_in_replicas(strategy, 5.0)
        assert float(mirrored_var) == 5.0
        assert float(mirrored_var.assign_sub(2.0)) == 3.0
        _assert_copies(strategy, mirrored_var, 3.0)


def _replica_id_value() -> np.float32:
    return np.float32(ms.get_replica_context().replica_id_in_sync_group)


@tf_source("mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignMirroredVarReplicaContext",
           "mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignMirroredVarReplicaContextWithSingleValue",
           "mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignAddMirroredVarReplicaContext",
           "mirrored_strategy_test.py::MirroredVariableUpdateTest::"
           "testAssignAddMirroredVarReplicaContextWithSingleValue",
           "mirrored_strategy_test.py::MirroredVariableUpdateTest::testAssignSubMirroredVarReplicaContext",
           "mirrored_strategy_test.py::MirroredVariableUpdateTest::"
           "testAssignSubMirroredVarReplicaContextWithSingleValue")
@pytest.mark.parametrize("method, initial, replica_value, expected", [
    pytest.param("assign", 1.0, _replica_id_value, 0.5, id="assign-replica_id"),  # mean of 0 and 1
    pytest.param("assign", 1.0, lambda: 5.0, 5.0, id="assign-single_value"),
    pytest.param("assign_add", 1.0, _replica_id_value, 1.5, id="assign_add-replica_id"),
    pytest.param("assign_add", 1.0, lambda: 5.0, 6.0, id="assign_add-single_value"),
    pytest.param("assign_sub", 5.0, _replica_id_value, 4.5, id="assign_sub-replica_id"),
    pytest.param("assign_sub", 5.0, lambda: 1.0, 4.0, id="assign_sub-single_value"),
])
def test_update_mirrored_var_replica_context_with_mean(method: str, initial: float,
                                                       replica_value: Callable[[], Any], expected: float) -> None:
    """Aggregation MEAN: every replica's update is averaged and the average applied to every copy."""
    strategy = two_devices()
    with strategy.scope():
        mirrored_var = _var_in_replicas(strategy, initial, AGG.MEAN)
        assert float(mirrored_var) == initial
        strategy.experimental_local_results(
            strategy.extended.call_for_each_replica(lambda: getattr(mirrored_var, method)(replica_value())))
        assert float(mirrored_var) == expected


# -- SyncOnReadVariableAssignTest ------------------------------------------------------------------------------------


@tf_source("mirrored_strategy_test.py::SyncOnReadVariableAssignTest::testAssignReplicaLocalVarSumAggregation",
           "mirrored_strategy_test.py::SyncOnReadVariableAssignTest::testAssignReplicaLocalVarMeanAggregation")
@pytest.mark.parametrize("aggregation, first_read, copy_value", [(AGG.SUM, 2.0, 3.0), (AGG.MEAN, 1.0, 6.0)],
                         ids=["sum", "mean"])
def test_assign_replica_local_var(aggregation: Any, first_read: float, copy_value: float) -> None:
    """An ON_READ variable created in the replicas reads the SUM (MEAN) of its copies in cross-replica context;
    assigning 6.0 there sets the copies so that the read gives 6.0 back (TF's comment: SUM assigns
    "6.0/num_replicas to each replica")."""
    strategy = two_devices()
    with strategy.scope():
        sync_on_read_var = strategy.extended.call_for_each_replica(
            lambda: ms.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=aggregation))
        assert isinstance(sync_on_read_var, ms.SyncOnReadVariable)  # distribute_utils.is_sync_on_read
        assert float(strategy.extended.read_var(sync_on_read_var)) == first_read
        sync_on_read_var.assign(6.0)
        assert [float(c) for c in strategy.experimental_local_results(sync_on_read_var)] == [copy_value] * 2
        assert float(strategy.extended.read_var(sync_on_read_var)) == 6.0
