"""Ports of TF 2.21's strategy_test_lib helpers (the test bodies several TF test classes share).

TensorFlow's ``strategy_test_lib.py`` (a non-test module of the 2.21 wheel) holds
``DistributionTestBase``, ``OneDeviceDistributionTestBase`` and
``TwoDeviceDistributionTestBase``, whose ``_test_*`` methods the TF test files call
with their strategies. Each function here is the eager path of one of them (or a
test body several TF files repeat), translated to NumPy and mpistrat; its
docstring names the TF code. The two translations every port needs:

- ``backprop.implicit_grad(loss)`` becomes the loss's gradient written out by hand
  (mpistrat has no autodiff); what the strategy does with the gradients is TF's.
- ``make_input_fn_iterator`` / ``experimental_run`` (TF 1.x only APIs) become
  ``distribute_datasets_from_function`` and ``run``, which feed each replica the
  same elements.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import Dataset
from mpistrat.devices import parse_device

__all__ = [
    "TWO_DEVICE_INPUTS",
    "TestException",
    "all_mean",
    "all_sum",
    "call_and_merge_exceptions",
    "collective_comms",
    "create_variable_like_keras_layer",
    "first_item_device_types",
    "global_step_update",
    "input_fn_iterable",
    "input_fn_to_test_input_context",
    "minimize_loss",
    "replica_id",
    "replicate_dataset",
    "run_one_device",
    "run_two_device",
    "trainable_variable",
]


class TestException(Exception):
    """strategy_test_lib._TestException: the error the exception tests raise and expect back."""

    __test__ = False  # not a test class, whatever its name


def _raise_exception_fn(_: Any = None) -> None:
    raise TestException()


def _merge_raises_fn() -> None:
    ms.get_replica_context().merge_call(_raise_exception_fn)


def _call_raises_fn(strategy: Any) -> None:
    strategy.extended.call_for_each_replica(_raise_exception_fn)


def _merge_call_raises_fn() -> None:
    ms.get_replica_context().merge_call(_call_raises_fn)


def _call_merge_raises_fn(strategy: Any) -> None:
    strategy.extended.call_for_each_replica(_merge_raises_fn)


def _merge_call_merge_raises_fn() -> None:
    ms.get_replica_context().merge_call(_call_merge_raises_fn)


def call_and_merge_exceptions(strategy: Any) -> None:
    """DistributionTestBase._test_call_and_merge_exceptions: an error raised in a replica function, in a
    merge_call's merge_fn, or in a replica function called from a merge_fn reaches the caller as it is."""
    with strategy.scope():
        for fn in (_raise_exception_fn, _merge_raises_fn, _merge_call_raises_fn, _merge_call_merge_raises_fn):
            with pytest.raises(TestException):
                strategy.extended.call_for_each_replica(fn)


def create_variable_like_keras_layer(name: str, shape: Sequence[int], dtype: Any, seed: int = 0) -> Any:
    """strategy_test_lib.create_variable_like_keras_layer: a trainable variable with a Glorot-uniform start.

    TF draws from ``init_ops_v2.GlorotUniform()``; here NumPy draws from the same
    distribution with a fixed seed, so every run starts from the same kernel.
    """
    fan_in, fan_out = shape[0], shape[-1]
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    rng = np.random.default_rng(seed)
    return ms.Variable(lambda: rng.uniform(-limit, limit, tuple(shape)).astype(dtype), name=name, trainable=True)


def minimize_loss(strategy: Any, learning_rate: float = 0.2) -> None:
    """DistributionTestBase._test_minimize_loss_eager (and the graph variant's steps, with its learning rate).

    Ten steps of ``kernel -= lr * sum over replicas of d/dkernel (x @ kernel - 1)^2``
    through ``call_for_each_replica``, ``read_var``, ``reduce_to`` onto the
    variable and ``update(..., group=False)``; the error must go down.
    """
    with strategy.scope():
        kernel = create_variable_like_keras_layer("kernel", (1, 1), np.float32)

        def grad_fn(x: np.ndarray) -> list:
            y = (x @ kernel).reshape(()) - np.float32(1.0)  # loss = y * y
            return [(np.float32(2.0) * y * x.T, kernel)]  # what implicit_grad(loss) returns: (gradient, variable)

        def update(v: Any, g: Any) -> Any:
            return v.assign_sub(np.float32(learning_rate) * g)

        one = np.array([[1.0]], np.float32)

        def step() -> tuple[list, list]:
            g_v = strategy.extended.call_for_each_replica(grad_fn, args=(one,))
            before_list, after_list = [], []
            for g, v in g_v:
                before_list.append(strategy.extended.read_var(v))
                g = strategy.extended.reduce_to(ms.ReduceOp.SUM, g, destinations=v)
                strategy.extended.update(v, update, args=(g,), group=False)
                after_list.append(strategy.extended.read_var(v))
            return before_list, after_list

        for i in range(10):
            b, a = step()
            if i == 0:
                (before,) = b
            (after,) = a

    error_before = abs(np.asarray(before) - 1)
    error_after = abs(np.asarray(after) - 1)
    assert error_after < error_before, (error_before, error_after)  # the error goes down


def replica_id(strategy: Any) -> None:
    """DistributionTestBase._test_replica_id: each local replica runs once, with an id below the device count."""
    with strategy.scope():
        seen = [False] * len(strategy.extended.worker_devices)

        def mark_devices_fn() -> None:
            rid = ms.get_replica_context().replica_id_in_sync_group
            assert rid < len(strategy.extended.worker_devices)
            assert not seen[rid]
            seen[rid] = True

        strategy.extended.call_for_each_replica(mark_devices_fn)
    assert seen == [True] * len(strategy.extended.worker_devices)


def input_fn_to_test_input_context(dataset_fn: Callable[[], Any], expected_num_replicas_in_sync: int,
                                   expected_num_input_pipelines: int,
                                   expected_input_pipeline_id: int | None) -> Callable[[Any], Any]:
    """DistributionTestBase._input_fn_to_test_input_context: an input_fn that checks the InputContext it gets.

    With ``expected_input_pipeline_id=None`` the ids must count up from 0, one per call.
    """
    worker_id_counter = [0]

    def input_fn(input_context: Any) -> Any:
        assert input_context is not None
        assert input_context.num_replicas_in_sync == expected_num_replicas_in_sync
        assert input_context.num_input_pipelines == expected_num_input_pipelines
        if expected_input_pipeline_id is not None:
            assert input_context.input_pipeline_id == expected_input_pipeline_id
        else:
            assert input_context.input_pipeline_id == worker_id_counter[0]
            worker_id_counter[0] += 1
        return dataset_fn()

    return input_fn


def input_fn_iterable(strategy: Any, input_fn: Callable[[Any], Any], expected_values: Sequence[Sequence[Any]]) -> None:
    """DistributionTestBase._test_input_fn_iterable (eager): each step's local results are the expected values,
    then StopIteration; a new iterator over the same distributed dataset starts again from the beginning."""
    iterable = strategy.distribute_datasets_from_function(input_fn)
    for _ in range(2):  # the second pass: "after re-initializing the iterator, should be able to iterate again"
        iterator = iter(iterable)
        for expected_value in expected_values:
            computed_value = list(strategy.experimental_local_results(next(iterator)))
            np.testing.assert_array_equal(computed_value, expected_value)
        with pytest.raises(StopIteration):
            strategy.experimental_local_results(next(iterator))


def first_item_device_types(strategy: Any, options: Any) -> list[str]:
    """The device type of each replica's part of the first batch of ``Dataset.range(100)`` distributed with
    ``options`` (the body of TF's test_prefetch_to_device_dataset / test_prefetch_to_host_dataset)."""
    dataset = Dataset.range(100).batch(strategy.num_replicas_in_sync)
    item = next(iter(strategy.experimental_distribute_dataset(dataset, options=options)))
    return [parse_device(ms.device_of(t)).device_type for t in item.values]


def replicate_dataset(strategy: Any) -> None:
    """The body of TF's testReplicateDataset (two replicas, one worker): ``distribute_datasets_from_function``
    makes one input pipeline whose consecutive elements go to the two replicas."""
    expected_values = [[i, i + 1] for i in range(0, 10, 2)]
    input_fn = input_fn_to_test_input_context(lambda: Dataset.range(10), expected_num_replicas_in_sync=2,
                                              expected_num_input_pipelines=1, expected_input_pipeline_id=0)
    input_fn_iterable(strategy, input_fn, expected_values)


def global_step_update(strategy: Any) -> None:
    """DistributionTestBase._test_global_step_update: an ONLY_FIRST_REPLICA int64 step incremented by every
    replica in one step reads 1 on every replica."""
    with strategy.scope():
        global_step = ms.Variable(np.int64(0), name="global_step", dtype=np.int64, trainable=False,
                                  aggregation=ms.VariableAggregation.ONLY_FIRST_REPLICA)

        def model_fn() -> tuple:
            train_op = global_step.assign_add(1)
            value = global_step.read_value()
            return train_op, value

        _, value = strategy.extended.call_for_each_replica(model_fn)
        global_step_values = [int(v) for v in strategy.experimental_local_results(value)]
    assert global_step_values == [1] * len(strategy.extended.worker_devices)


def trainable_variable(strategy: Any) -> None:
    """DistributionTestBase._test_trainable_variable: trainable defaults to True, to False with ON_READ, and an
    explicit ``trainable`` wins in both (TF 2.21 accepts ``trainable=True`` with ON_READ).

    TF runs it for ``VariableV1`` and ``Variable``; mpistrat has one class.
    """
    sync = ms.VariableSynchronization
    with strategy.scope():
        assert ms.Variable(1.0).trainable is True
        assert ms.Variable(1.0, synchronization=sync.ON_READ).trainable is False
        assert ms.Variable(1.0, synchronization=sync.ON_READ, trainable=True).trainable is True
        assert ms.Variable(1.0, synchronization=sync.ON_READ, trainable=False).trainable is False


def run_one_device(strategy: Any) -> None:
    """OneDeviceDistributionTestBase._test_run: ``run`` with no arguments, positional and keyword arguments."""
    out1 = strategy.run(lambda: np.float32(4.0))
    np.testing.assert_array_equal(strategy.experimental_local_results(out1), [4.0])
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(strategy.experimental_local_results(out2["a"]), [8.0])
    np.testing.assert_array_equal(strategy.experimental_local_results(out2["b"]), [16.0])
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(strategy.experimental_local_results(out3), [42.0])


def run_two_device(strategy: Any) -> None:
    """TwoDeviceDistributionTestBase._test_run: per-replica results feed the next ``run`` per replica."""
    out1 = strategy.run(lambda: ms.get_replica_context().replica_id_in_sync_group + 1)
    np.testing.assert_array_equal(strategy.experimental_local_results(out1), [1, 2])
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(strategy.experimental_local_results(out2["a"]), [2, 4])
    np.testing.assert_array_equal(strategy.experimental_local_results(out2["b"]), [1, 4])
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(strategy.experimental_local_results(out3), [6, 14])


# TwoDeviceDistributionTestBase's all-reduce inputs: replica i gets element i of each member.
TWO_DEVICE_INPUTS = ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]])


def all_sum(value: Any) -> Any:
    """strategy_test_lib._all_sum."""
    return ms.get_replica_context().all_reduce(ms.ReduceOp.SUM, value)


def all_mean(value: Any) -> Any:
    """strategy_test_lib._all_mean."""
    return ms.get_replica_context().all_reduce(ms.ReduceOp.MEAN, value)


def collective_comms(strategy: Any, comm_fn: Callable[[Any], Any], inputs: tuple, expected: tuple,
                     sliced: bool) -> None:
    """One/TwoDeviceDistributionTestBase._test_collective_comms: ``comm_fn`` (an all-reduce) of each replica's
    input element gives ``expected`` on every local replica.

    TF's two-device base slices ``inputs`` (``from_tensor_slices``: replica i gets
    element i), the one-device base gives the whole of it to its replica
    (``from_tensors``); ``sliced`` chooses which.
    """
    make = Dataset.from_tensor_slices if sliced else Dataset.from_tensors
    iterator = iter(strategy.distribute_datasets_from_function(lambda _: make(inputs)))
    outputs = strategy.run(comm_fn, args=(next(iterator),))
    num_local = len(strategy.extended.worker_devices)
    np.testing.assert_array_equal(strategy.experimental_local_results(outputs[0]), [expected[0]] * num_local)
    np.testing.assert_array_equal(strategy.experimental_local_results(outputs[1]), [expected[1]] * num_local)
