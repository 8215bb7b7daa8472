"""Port of TF 2.21's distributed_variable_test.py: distributed variables of every synchronization and aggregation.

TF's ``DistributedVariableTest`` runs every method over strategies x synchronization
(ON_READ, ON_WRITE) x aggregation (MEAN, SUM, ONLY_FIRST_REPLICA). The strategies
become ``MirroredStrategy`` on one logical CPU (``mirrored_strategy_with_one_cpu``) and
on two (``..._with_gpu_and_cpu``, ``..._with_two_gpus_no_merge_call``), and
``MultiWorkerMirroredStrategy`` with one and two local CPUs per rank under mpiexec
(``multi_worker_mirrored_2x1_cpu``, ``..._2x2_gpu``). Eager mode only.
"""

import copy
import itertools

import numpy as np
import pytest
from strategies import mirrored_one_cpu, mirrored_two_cpus, multi_worker_one_cpu, multi_worker_two_cpus
from tfsource import tf_source

import mpistrat as ms
from mpistrat.checkpoint import Checkpoint
from mpistrat.distribute.regroup import select_replica

SYNC = ms.VariableSynchronization
AGG = ms.VariableAggregation

_MPI = pytest.mark.mpi(min_size=1)


STRATEGIES = [
    pytest.param(mirrored_one_cpu, id="mirrored_1cpu"),
    pytest.param(mirrored_two_cpus, id="mirrored_2cpu"),
    pytest.param(multi_worker_one_cpu, id="multi_worker_1cpu", marks=_MPI),
    pytest.param(multi_worker_two_cpus, id="multi_worker_2cpu", marks=_MPI),
]
SYNC_AGG = [pytest.param(s, a, id=f"{s.name}-{a.name}")
            for s, a in itertools.product([SYNC.ON_READ, SYNC.ON_WRITE], [AGG.MEAN, AGG.SUM, AGG.ONLY_FIRST_REPLICA])]

combinations = pytest.mark.parametrize("make", STRATEGIES)
sync_and_aggregation = pytest.mark.parametrize("synchronization,aggregation", SYNC_AGG)


@tf_source("distributed_variable_test.py::DistributedVariableTest::testExtendsVariable")
@combinations
@sync_and_aggregation
def test_extends_variable(make, synchronization, aggregation):
    distribution = make()
    with distribution.scope():
        v = ms.Variable(1., synchronization=synchronization, aggregation=aggregation)
    assert isinstance(v, ms.Variable)


@tf_source("distributed_variable_test.py::DistributedVariableTest::testCheckpointing")
@combinations
@sync_and_aggregation
def test_checkpointing(make, synchronization, aggregation, tmp_path):
    """TF's ``checkpoint_test_helper`` (synchronous). ``Checkpoint.write``/``restore`` stand for TF's
    ``save``/``restore(...).assert_consumed()``: mpistrat's restore checks that every variable matches."""
    distribution = make()
    with distribution.scope():
        v = ms.Variable(np.array([1., 2., 3., 4.], np.float32), synchronization=synchronization,
                        aggregation=aggregation)
    before_save = np.array(v.read_value())

    # Save random weights into checkpoint.
    checkpoint = Checkpoint(v=v)
    save_path = checkpoint.write(str(tmp_path / "ckpt-1"))

    # Assign inverted value.
    v.assign(np.array([4., 3., 2., 1.], np.float32))
    after_assign = np.array(v.read_value())
    assert not np.allclose(before_save, after_assign)

    # Restore from the checkpoint.
    checkpoint.restore(save_path)
    after_restore = np.array(v.read_value())
    np.testing.assert_allclose(before_save, after_restore)

    # Another round of saving/restoring.
    v.assign(np.array([5., 6., 7., 8.], np.float32))
    before_save_1 = np.array(v.read_value())
    assert not np.allclose(before_save_1, after_restore)
    save_path = checkpoint.write(str(tmp_path / "ckpt-2"))

    v.assign(np.array([8., 7., 6., 5.], np.float32))
    after_assign_1 = np.array(v.read_value())
    assert not np.allclose(before_save_1, after_assign_1)

    checkpoint.restore(save_path)
    after_restore_1 = np.array(v.read_value())
    np.testing.assert_allclose(before_save_1, after_restore_1)


@tf_source("distributed_variable_test.py::DistributedVariableTest::testSelectReplica")
@combinations
@sync_and_aggregation
def test_select_replica(make, synchronization, aggregation):
    """``distribute_utils.select_replica`` keeps a distributed variable whole; so does mpistrat's, and so
    ``run`` hands the replica function the variable itself."""
    distribution = make()
    with distribution.scope():
        v = ms.Variable(1., synchronization=synchronization, aggregation=aggregation)
    assert select_replica(0, v) is v
    seen = []
    distribution.run(lambda x: seen.append(x is v), args=(v,))
    assert seen == [True] * len(distribution.extended.worker_devices)


@tf_source("distributed_variable_test.py::DistributedVariableTest::testIsTensorLike")
@combinations
@sync_and_aggregation
def test_is_tensor_like(make, synchronization, aggregation):
    """TF checks ``isinstance(v, core.Tensor)``; mpistrat's tensors are NumPy arrays, so a variable is
    tensor-like when it converts to a float32 array of its shape, in cross-replica and in replica context."""
    distribution = make()
    with distribution.scope():
        v = ms.Variable(0., synchronization=synchronization, aggregation=aggregation)

    def assert_is_tensor_like(x):
        array = np.asarray(x)
        assert array.dtype == np.float32 and array.shape == ()

    # In cross replica context.
    assert_is_tensor_like(v)
    # In replica context.
    distribution.run(assert_is_tensor_like, args=(v,))


@tf_source("distributed_variable_test.py::DistributedVariableTest::testAssignReturnValueIsTensorLike")
@combinations
@sync_and_aggregation
def test_assign_return_value_is_tensor_like(make, synchronization, aggregation):
    distribution = make()
    with distribution.scope():
        v = ms.Variable(0., synchronization=synchronization, aggregation=aggregation)

    def assert_is_tensor_like(var):
        # Not a Python literal: TF treats literals as non-distributed values, not allowed with SUM.
        delta = np.asarray(1., np.float32)
        for result in (var.assign(delta), var.assign_sub(delta), var.assign_add(delta)):
            array = np.asarray(result)
            assert array.dtype == np.float32 and array.shape == ()

    # In cross replica context TF returns a PerReplica, which is not tensor-like, except for these.
    if synchronization == SYNC.ON_READ and aggregation != AGG.SUM:
        assert_is_tensor_like(v)

    # In replica context.
    distribution.run(assert_is_tensor_like, args=(v,))


@tf_source("distributed_variable_test.py::DistributedVariableTest::testDeepCopy")
@combinations
@sync_and_aggregation
def test_deep_copy(make, synchronization, aggregation):
    """TF also compares the variables' private ``_policy`` objects; mpistrat has no variable policies."""
    distribution = make()
    with distribution.scope():
        v = ms.Variable(0., synchronization=synchronization, aggregation=aggregation)
        in_dist_copy = copy.deepcopy(v)

    out_dist_copy = copy.deepcopy(v)

    def assert_is_deep_copy(v1, v2):
        assert isinstance(v2, type(v1))
        assert v1.aggregation == v2.aggregation
        assert v1.distribute_strategy == v2.distribute_strategy
        assert len(v1.values) == len(v2.values)
        for v1v, v2v in zip(v1.values, v2.values):
            assert v1v.device == v2v.device
            assert id(v1v) != id(v2v)
            np.testing.assert_array_equal([c.numpy() for c in v1.values], [c.numpy() for c in v2.values])

    distribution.run(assert_is_deep_copy, args=(v, in_dist_copy))
    distribution.run(assert_is_deep_copy, args=(v, out_dist_copy))


@tf_source("distributed_variable_test.py::DistributedVariableTest::testAssignSignature")
@combinations
@sync_and_aggregation
def test_assign_signature(make, synchronization, aggregation):
    """assign*() can be called the way a plain variable's are: (value, use_locking, name, read_value)."""
    distribution = make()
    with distribution.scope():
        v = ms.Variable(0., synchronization=synchronization, aggregation=aggregation)

        def assign():
            one = np.asarray(1., np.float32)
            v.assign(one, True, "assign", False)
            v.assign(one, use_locking=True, name="assign", read_value=False)
            v.assign_add(one, True, "assign", False)
            v.assign_add(one, use_locking=True, name="assign", read_value=False)
            v.assign_sub(one, True, "assign", False)
            v.assign_sub(one, use_locking=True, name="assign", read_value=False)
            return np.asarray(1)

        if not (synchronization == SYNC.ON_READ and aggregation == AGG.SUM):
            assert distribution.experimental_local_results(assign()) == (1,)
        results = distribution.experimental_local_results(distribution.run(assign))
        assert list(results) == [1] * len(distribution.extended.worker_devices)


@tf_source("distributed_variable_test.py::DistributedVariableTest::testStrategyExtendedUpdate")
@pytest.mark.parametrize("make", [  # TF skips strategies without exactly two parameter devices
    pytest.param(mirrored_two_cpus, id="mirrored_2cpu"),
    pytest.param(multi_worker_two_cpus, id="multi_worker_2cpu", marks=_MPI),
])
@pytest.mark.parametrize("aggregation", [AGG.MEAN, AGG.SUM, AGG.ONLY_FIRST_REPLICA], ids=lambda a: a.name)
def test_strategy_extended_update(make, aggregation):
    """TF skips ON_WRITE variables with an aggregation (every aggregation here), so only ON_READ runs."""
    distribution = make()
    assert len(distribution.extended.parameter_devices) == 2
    with distribution.scope():
        v = ms.Variable(0., synchronization=SYNC.ON_READ, aggregation=aggregation)
    value = ms.PerReplica([1., 2.])

    def values():
        return [float(c.numpy()) for c in v.values]

    distribution.extended.update(v, lambda var, value: var.assign(value), args=(value,))
    assert values() == [1., 2.]

    distribution.extended.update(v, lambda var, value: var.assign_add(value), args=(value,))
    assert values() == [2., 4.]

    distribution.extended.update(v, lambda var, value: var.assign_sub(value), args=(value,))
    assert values() == [1., 2.]

    read_assign_fn = lambda var, value: var.assign_add(var.value() + var.read_value())
    distribution.extended.update(v, read_assign_fn, args=(value,))
    assert values() == [3., 6.]
