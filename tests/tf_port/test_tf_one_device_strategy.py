"""Port of TF 2.21's one_device_strategy_test.py (and the strategy_test_lib helpers its methods call).

TF runs ``OneDeviceStrategyTest`` on ``one_device_strategy`` (CPU) and
``one_device_strategy_gpu``, in eager and graph mode; here ``OneDeviceStrategy("/cpu:0")``,
eager. Where a helper feeds its input through the TF1-era ``make_input_fn_iterator`` and
``experimental_run``, the port passes the same input to ``strategy.run``.
"""

import numpy as np
import pytest
from tfsource import tf_source

import mpistrat as ms
from mpistrat.devices import parse_device


@pytest.fixture
def distribution():
    return ms.OneDeviceStrategy("/cpu:0")


class _TestException(Exception):
    pass


# The argument to call_for_each_replica() or merge_call().
def _raise_exception_fn(_=None):
    raise _TestException()


# Runs in a replica: a merge_call that raises.
def _merge_raises_fn():
    ms.get_replica_context().merge_call(_raise_exception_fn)


# Runs in a merge_call: a call_for_each_replica whose function raises.
def _call_raises_fn(dist):
    dist.extended.call_for_each_replica(_raise_exception_fn)


# Runs in a replica: a merge_call that calls a call_for_each_replica that raises.
def _merge_call_raises_fn():
    ms.get_replica_context().merge_call(_call_raises_fn)


# Runs in a merge_call: a call_for_each_replica whose function's merge_call raises.
def _call_merge_raises_fn(dist):
    dist.extended.call_for_each_replica(_merge_raises_fn)


# Runs in a replica: merge_call -> call_for_each_replica -> merge_call -> raise.
def _merge_call_merge_raises_fn():
    ms.get_replica_context().merge_call(_call_merge_raises_fn)


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testMinimizeLoss")
def test_minimize_loss(distribution):
    """strategy_test_lib's ``_test_minimize_loss_eager``. TF differentiates with ``backprop.implicit_grad``;
    mpistrat has no autodiff, so ``grad_fn`` returns the gradient of the same loss in closed form,
    d/dk (x k - 1)^2 = 2 (x k - 1) x, as the (gradient, variable) pairs implicit_grad returns."""
    d = distribution
    rng = np.random.default_rng(0)
    limit = np.sqrt(6.0 / 2.0)  # GlorotUniform for a (1, 1) kernel
    with d.scope():
        kernel = ms.Variable(rng.uniform(-limit, limit, (1, 1)).astype(np.float32), name="kernel", trainable=True)

        def grad_fn(x):
            y = (x @ kernel.value()).reshape(()) - np.float32(1.)
            return [(2. * y * x.T, kernel)]

        def update(v, g):
            return v.assign_sub(0.2 * g)

        one = np.array([[1.]], np.float32)

        def step():
            """Perform one optimization step."""
            # Run forward & backward to get gradients, variables list.
            g_v = d.extended.call_for_each_replica(grad_fn, args=(one,))
            # Update the variables using the gradients and the update() function.
            before_list = []
            after_list = []
            for g, v in g_v:
                before_list.append(np.array(d.extended.read_var(v)))
                g = d.extended.reduce_to(ms.ReduceOp.SUM, g, destinations=v)
                d.extended.update(v, update, args=(g,), group=False)
                after_list.append(np.array(d.extended.read_var(v)))
            return before_list, after_list

        for i in range(10):
            b, a = step()
            if i == 0:
                before, = b
            after, = a

        error_before = abs(before - 1)
        error_after = abs(after - 1)
        # Error should go down
        assert error_after < error_before


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testReplicaId")
def test_replica_id(distribution):
    d = distribution
    with d.scope():
        expected_devices = [False] * len(d.extended.worker_devices)

        def mark_devices_fn():
            replica_id = ms.get_replica_context().replica_id_in_sync_group
            assert replica_id < len(d.extended.worker_devices)
            assert not expected_devices[replica_id]
            expected_devices[replica_id] = True

        d.extended.call_for_each_replica(mark_devices_fn)
        assert expected_devices == [True] * len(d.extended.worker_devices)


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testCallAndMergeExceptions")
def test_call_and_merge_exceptions(distribution):
    dist = distribution
    with dist.scope():
        with pytest.raises(_TestException):
            dist.extended.call_for_each_replica(_raise_exception_fn)
        with pytest.raises(_TestException):
            dist.extended.call_for_each_replica(_merge_raises_fn)
        with pytest.raises(_TestException):
            dist.extended.call_for_each_replica(_merge_call_raises_fn)
        with pytest.raises(_TestException):
            dist.extended.call_for_each_replica(_merge_call_merge_raises_fn)


def _input_fn_to_test_input_context(dataset_fn, expected_num_replicas_in_sync, expected_num_input_pipelines,
                                    expected_input_pipeline_id):
    """strategy_test_lib's helper: an input_fn that checks the InputContext it is called with."""

    def _input_fn(input_context):
        assert input_context is not None
        assert input_context.num_replicas_in_sync == expected_num_replicas_in_sync
        assert input_context.num_input_pipelines == expected_num_input_pipelines
        assert input_context.input_pipeline_id == expected_input_pipeline_id
        return dataset_fn()

    return _input_fn


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testReplicateDataset")
def test_replicate_dataset(distribution):
    """strategy_test_lib's ``_test_input_fn_iterable``, eager: elements of an unbatched dataset, one replica."""
    dataset_fn = lambda: ms.data.Dataset.range(10)
    expected_values = [[i] for i in range(10)]
    input_fn = _input_fn_to_test_input_context(dataset_fn, expected_num_replicas_in_sync=1,
                                               expected_num_input_pipelines=1, expected_input_pipeline_id=0)
    iterable = distribution.distribute_datasets_from_function(input_fn)
    iterator = iter(iterable)
    for expected_value in expected_values:
        computed_value = [int(x) for x in distribution.experimental_local_results(next(iterator))]
        assert computed_value == expected_value
    with pytest.raises(StopIteration):
        distribution.experimental_local_results(next(iterator))

    # After re-initializing the iterator, should be able to iterate again.
    iterator = iter(iterable)
    for expected_value in expected_values:
        computed_value = [int(x) for x in distribution.experimental_local_results(next(iterator))]
        assert computed_value == expected_value


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testRun")
def test_run(distribution):
    """OneDeviceDistributionTestBase's ``_test_run``; ``strategy.unwrap`` is ``experimental_local_results``."""
    strategy = distribution
    unwrap = strategy.experimental_local_results
    out1 = strategy.run(lambda: np.float32(4.))
    np.testing.assert_array_equal(unwrap(out1), [4.])

    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(unwrap(out2["a"]), [8.])
    np.testing.assert_array_equal(unwrap(out2["b"]), [16.])

    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(unwrap(out3), [42.])


def _all_sum(value):
    return ms.get_replica_context().all_reduce(ms.ReduceOp.SUM, value)


def _all_mean(value):
    return ms.get_replica_context().all_reduce(ms.ReduceOp.MEAN, value)


def _test_collective_comms(strategy, comm_fn, inputs, expected):
    outputs = list(map(strategy.experimental_local_results, strategy.run(comm_fn, args=(inputs,))))
    np.testing.assert_array_equal(outputs[0], [expected[0]])
    np.testing.assert_array_equal(outputs[1], [expected[1]])


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testAllReduceSum")
def test_all_reduce_sum(distribution):
    _test_collective_comms(distribution, _all_sum, inputs=(4., [42., 43.]), expected=(4., [42., 43.]))


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testAllReduceMean")
def test_all_reduce_mean(distribution):
    _test_collective_comms(distribution, _all_mean, inputs=(2., [21., 22.]), expected=(2., [21., 22.]))


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::testTrainableVariables")
def test_trainable_variables(distribution):
    """strategy_test_lib's ``_test_trainable_variable`` runs it for ``VariableV1`` (tf.compat.v1) and
    ``Variable``; mpistrat has ``Variable``. Documented in tf.Variable: ``trainable`` defaults to True unless
    ``synchronization`` is ON_READ, in which case it defaults to False."""
    with distribution.scope():
        v1 = ms.Variable(1.0)
        assert v1.trainable is True

        v2 = ms.Variable(1.0, synchronization=ms.VariableSynchronization.ON_READ)
        assert v2.trainable is False

        v3 = ms.Variable(1.0, synchronization=ms.VariableSynchronization.ON_READ, trainable=True)
        assert v3.trainable is True

        v4 = ms.Variable(1.0, synchronization=ms.VariableSynchronization.ON_READ, trainable=False)
        assert v4.trainable is False


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::test_prefetch_to_device_dataset")
def test_prefetch_to_device_dataset(distribution):
    input_options = ms.InputOptions(experimental_fetch_to_device=True)
    dataset = ms.data.Dataset.range(100)
    dataset = dataset.batch(distribution.num_replicas_in_sync)
    dataset = distribution.experimental_distribute_dataset(dataset, options=input_options)
    item = next(iter(dataset))
    device_types = parse_device(ms.device_of(item)).device_type
    expected_device_types = parse_device(distribution.extended.worker_devices[0]).device_type
    assert device_types == expected_device_types


@tf_source("one_device_strategy_test.py::OneDeviceStrategyTest::test_prefetch_to_host_dataset")
def test_prefetch_to_host_dataset(distribution):
    input_options = ms.InputOptions(experimental_fetch_to_device=False)
    dataset = ms.data.Dataset.range(100)
    dataset = dataset.batch(distribution.num_replicas_in_sync)
    dataset = distribution.experimental_distribute_dataset(dataset, options=input_options)
    item = next(iter(dataset))
    assert parse_device(ms.device_of(item)).device_type == "CPU"
