"""TF 2.21's strategy_common_test.py, ported: what every strategy does alike (reduce, all-reduce, results).

TF's strategy lists become pytest parameters: ``default_strategy`` is
``ms.get_strategy()`` outside any scope, ``one_device_strategy`` is
``OneDeviceStrategy("/cpu:0")``, ``mirrored_strategy_with_gpu_and_cpu`` (and
``..._two_gpus``, ``..._cpu_1_and_2``) are ``MirroredStrategy`` on two logical
CPU devices, and ``multi_worker_mirrored_2x1_*`` / ``2x2_*`` are
``MultiWorkerMirroredStrategy`` on two ranks with one or two local CPU devices
(two_workers.py), run under mpiexec. mpistrat has no central-storage or TPU
strategy; the ``*_no_merge_call`` variants are the same strategies here. TF's
``tf_function=True`` variants are graph mode and not ported; each ported test
runs TF's eager body. ``tf.constant`` values become NumPy scalars or arrays made
inside the replica function, so each replica returns its own object, as TF's
tensors are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tfsource import tf_source
from two_workers import task_type, two_worker_strategy

import mpistrat as ms
from mpistrat.data import Dataset

TASK_IDS = ("deliberate difference (one MPI rank = one worker, docs/design.md): the ranks are tasks "
            "0..W-1 of one 'worker' job; TF's 2x1 test cluster is chief:0 plus worker:0, so TF's second "
            "worker has task_id 0 where mpistrat's has 1")


def default_strategy() -> Any:
    return ms.get_strategy()


def one_device() -> Any:
    return ms.OneDeviceStrategy("/cpu:0")


def mirrored_two_cpus() -> Any:
    return ms.MirroredStrategy(["/cpu:0", "/cpu:1"])


def mirrored_cpu_1_and_2() -> Any:
    return ms.MirroredStrategy(["/cpu:1", "/cpu:2"])


def two_workers_one_cpu() -> Any:
    return two_worker_strategy(["/cpu:0"])


def two_workers_two_cpus() -> Any:
    return two_worker_strategy(["/cpu:0", "/cpu:1"])


MPI = pytest.mark.mpi(min_size=2)
SINGLE_WORKER = [pytest.param(default_strategy, id="default"), pytest.param(one_device, id="one_device"),
                 pytest.param(mirrored_two_cpus, id="mirrored_two_cpus")]
MWMS_2X1 = pytest.param(two_workers_one_cpu, id="mwms_2x1", marks=MPI)
MWMS_2X2 = pytest.param(two_workers_two_cpus, id="mwms_2x2", marks=MPI)
# TF's strategy_combinations.all_strategies (TPU and central storage left out) plus multi_worker_mirrored_2x1.
ALL_AND_2X1 = pytest.mark.parametrize("make_strategy", SINGLE_WORKER + [MWMS_2X1])


def local(strategy: Any, value: Any) -> list[Any]:
    return list(strategy.experimental_local_results(value))


def num_local_replicas(strategy: Any) -> int:
    """TF's ``_get_num_replicas_per_client``: the replicas of this worker."""
    return len(strategy.extended.worker_devices)


def local_replica_id() -> int:
    """TF's ``extended._get_local_replica_id(replica_id_in_sync_group)`` (global id = worker x local + local id)."""
    ctx = ms.get_replica_context()
    return ctx.replica_id_in_sync_group % len(ctx.strategy.extended.worker_devices)


def _odd_pair_rank() -> bool:
    """Whether this rank is the second worker of its pair (for the xfail condition below)."""
    from mpi4py import MPI as _MPI

    return _MPI.COMM_WORLD.size >= 2 and _MPI.COMM_WORLD.rank % 2 == 1


# -- StrategyTest -----------------------------------------------------------------------------------------
@tf_source("strategy_common_test.py::StrategyTest::testMergeCallInitScope")
@ALL_AND_2X1
def test_merge_call(make_strategy):
    """``merge_call``'s result reaches every replica (TF calls it under ``init_scope`` in a ``tf.function``)."""
    strategy = make_strategy()
    with strategy.scope():

        def merge_fn(unused_strategy):
            return np.asarray(11, np.int32)

        def replica_fn():
            y = ms.get_replica_context().merge_call(merge_fn)
            return y + 1

        result = local(strategy, strategy.run(replica_fn))
        np.testing.assert_array_equal(result, [12] * num_local_replicas(strategy))


# -- StrategyLocalResultTest --------------------------------------------------------------------------------
LOCAL_RESULT = pytest.mark.parametrize("make_strategy", [
    pytest.param(mirrored_cpu_1_and_2, id="mirrored_cpu_1_and_2"), MWMS_2X2])


def run_in_scope(strategy: Any, model_fn: Any) -> tuple:
    with strategy.scope():
        return strategy.experimental_local_results(strategy.run(model_fn))


def as_python(value: Any) -> Any:
    """Leaves as Python numbers, containers kept (TF's ``self.evaluate``)."""
    if isinstance(value, dict):
        return {k: as_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(as_python(v) for v in value)
    return np.asarray(value).tolist()


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForDictionary")
@LOCAL_RESULT
def test_local_result_for_dictionary(make_strategy):
    strategy = make_strategy()
    got = run_in_scope(strategy, lambda: {"a": np.float32(1.), "b": np.float32(2.)})
    assert as_python(got) == ({"a": 1., "b": 2.}, {"a": 1., "b": 2.})


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForList")
@LOCAL_RESULT
def test_local_result_for_list(make_strategy):
    strategy = make_strategy()
    got = run_in_scope(strategy, lambda: [np.float32(1.), np.float32(2.)])
    assert as_python(got) == ([1., 2.], [1., 2.])


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForTuple")
@LOCAL_RESULT
def test_local_result_for_tuple(make_strategy):
    strategy = make_strategy()
    got = run_in_scope(strategy, lambda: (np.float32(1.), np.float32(2.), np.float32(3.)))
    assert as_python(got) == ((1., 2., 3.), (1., 2., 3.))


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForNestedStruct")
@LOCAL_RESULT
def test_local_result_for_nested_struct(make_strategy):
    strategy = make_strategy()
    got = run_in_scope(strategy, lambda: ({"a": np.float32(1.), "b": np.float32(2.)},
                                          {"a": np.float32(4.), "b": np.float32(6.)}))
    one = ({"a": 1., "b": 2.}, {"a": 4., "b": 6.})
    assert as_python(got) == (one, one)


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForNestedStructWithoutTensor")
@LOCAL_RESULT
def test_local_result_for_nested_struct_without_tensor(make_strategy):
    """Python floats (the same objects on every replica): still one result per local replica."""
    strategy = make_strategy()
    v = run_in_scope(strategy, lambda: {"a": 1., "b": 2.})
    assert isinstance(v, tuple)
    assert as_python(v) == ({"a": 1., "b": 2.}, {"a": 1., "b": 2.})


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForScalarValue")
@LOCAL_RESULT
def test_local_result_for_scalar_value(make_strategy):
    strategy = make_strategy()
    v = run_in_scope(strategy, local_replica_id)
    assert isinstance(v, tuple)
    assert as_python(v) == (0, 1)


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForDictionaryDifferentReplicas")
@LOCAL_RESULT
def test_local_result_for_dictionary_different_replicas(make_strategy):
    strategy = make_strategy()

    def model_fn():
        replica_id = local_replica_id()
        return {"a": np.float32(replica_id + 1), "b": np.float32(replica_id + 2)}

    got = run_in_scope(strategy, model_fn)
    assert as_python(got) == ({"a": 1., "b": 2.}, {"a": 2., "b": 3.})


@tf_source("strategy_common_test.py::StrategyLocalResultTest::testLocalResultForTensor")
@LOCAL_RESULT
def test_local_result_for_tensor(make_strategy):
    strategy = make_strategy()
    v = run_in_scope(strategy, lambda: np.array([2., 3.], np.float32))
    assert as_python(v) == ([2., 3.], [2., 3.])


# -- ReduceTest -----------------------------------------------------------------------------------------------
@tf_source("strategy_common_test.py::ReduceTest::testBasic")
@ALL_AND_2X1
def test_reduce_basic(make_strategy):
    """SUM of a value of 1 per replica, in the strategy's scope and outside it (TF's eager half)."""
    strategy = make_strategy()
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda _: np.ones((), np.float32))

    def fn_eager():
        return strategy.reduce(ms.ReduceOp.SUM, value=per_replica_value, axis=None)

    with strategy.scope():
        assert float(fn_eager()) == 1.0 * strategy.num_replicas_in_sync
    assert float(fn_eager()) == 1.0 * strategy.num_replicas_in_sync


@tf_source("strategy_common_test.py::ReduceTest::testAxis")
@ALL_AND_2X1
def test_reduce_axis(make_strategy):
    """MEAN and SUM along axis 0 of ``[1., 2.]`` from every replica."""
    strategy = make_strategy()
    x = strategy.run(lambda: np.array([1., 2.], np.float32))
    assert float(strategy.reduce(ms.ReduceOp.MEAN, x, axis=0)) == 1.5
    assert float(strategy.reduce(ms.ReduceOp.SUM, x, axis=0)) == 3 * strategy.num_replicas_in_sync


# -- ReplicaCtxUpdateTest -----------------------------------------------------------------------------------
def replica_ctx_update(var: Any, fn: Any, *args: Any) -> Any:
    """TF's ``ReplicaContext._update`` (its default ``_replica_ctx_update``: merge_call, then extended.update)."""
    return ms.get_replica_context().merge_call(
        lambda strategy, *merged: strategy.extended.update(var, fn, merged), args=args)


@tf_source("strategy_common_test.py::ReplicaCtxUpdateTest::testDenseUpdate")
@pytest.mark.parametrize("update_fn", ["assign", "assign_add", "assign_sub"])
@pytest.mark.parametrize("make_strategy", [pytest.param(default_strategy, id="default"),
                                           pytest.param(mirrored_two_cpus, id="mirrored_two_cpus"),
                                           MWMS_2X1, MWMS_2X2])
def test_dense_update(make_strategy, update_fn):
    """An update from the replica context applies each replica's (equal) value once to every copy."""
    strategy = make_strategy()
    with strategy.scope():
        distributed_variable1 = ms.Variable(5.0)
    fn_sets = {
        "assign": lambda var, value: var.assign(value),
        "assign_add": lambda var, value: var.assign_add(value),
        "assign_sub": lambda var, value: var.assign_sub(value),
    }

    def replica_fn():
        value = np.float32(2.)
        python_literal = 1.
        replica_ctx_update(distributed_variable1, fn_sets[update_fn], value)
        replica_ctx_update(distributed_variable1, fn_sets[update_fn], python_literal)

    strategy.run(replica_fn)
    expected_result = {"assign": 1., "assign_add": 8., "assign_sub": 2.}
    got = [float(np.asarray(c.numpy() if hasattr(c, "numpy") else c))
           for c in strategy.experimental_local_results(distributed_variable1)]
    assert got == [expected_result[update_fn]] * num_local_replicas(strategy)


# -- ReplicaCtxAllReduceTest / AllReduceTest (dense values) ----------------------------------------------------
@tf_source("strategy_common_test.py::ReplicaCtxAllReduceTest::testSyncOnReadVariableInput")
@pytest.mark.parametrize("make_strategy", [pytest.param(mirrored_two_cpus, id="mirrored_two_cpus"),
                                           MWMS_2X1, MWMS_2X2])
def test_sync_on_read_variable_input(make_strategy):
    """``all_reduce(SUM, var)`` of an ON_READ variable sums every replica's own copy."""
    strategy = make_strategy()
    with strategy.scope():
        var = ms.Variable(0.0, synchronization=ms.VariableSynchronization.ON_READ,
                          aggregation=ms.VariableAggregation.ONLY_FIRST_REPLICA)

    def replica_fn():
        replica_context = ms.get_replica_context()
        var.assign(np.float32(replica_context.replica_id_in_sync_group) * 3.0)
        return replica_context.all_reduce(ms.ReduceOp.SUM, var)

    expected_sum = sum(range(strategy.num_replicas_in_sync)) * 3.0
    result = local(strategy, strategy.run(replica_fn))
    assert len(result) == num_local_replicas(strategy)
    for value in result:
        assert float(np.asarray(value)) == expected_sum


@tf_source("strategy_common_test.py::AllReduceTest::testDense")
@pytest.mark.parametrize("make_strategy", SINGLE_WORKER + [MWMS_2X1, MWMS_2X2])
def test_all_reduce_dense(make_strategy):
    """``ReplicaContext.all_reduce(SUM, 1.0)`` gives the number of replicas."""
    strategy = make_strategy()

    def replica_fn():
        return ms.get_replica_context().all_reduce(ms.ReduceOp.SUM, np.float32(1.0))

    got = local(strategy, strategy.run(replica_fn))[0]
    assert float(np.asarray(got)) == 1.0 * strategy.num_replicas_in_sync


# -- DistributedCollectiveAllReduceStrategyTest (MWMS 2x1) ------------------------------------------------------


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testDatasetFromFunction")
@MPI
def test_dataset_from_function():
    """Each worker's ``dataset_fn`` shards by ``input_pipeline_id``: the chief's first batch is 0..4."""
    strategy = two_workers_one_cpu()

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(10)
        d = Dataset.range(100).repeat().batch(batch_size)
        return d.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    expected_sum_on_workers = {"chief": 10, "worker": 35}
    input_iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    result = local(strategy, input_iterator.get_next())
    assert int(np.sum(result)) == expected_sum_on_workers[task_type()]


def next_two_steps(strategy: Any, input_iterator: Any) -> Any:
    strategy.run(lambda x: x, args=(next(input_iterator),))  # the complete batch goes
    return strategy.run(lambda x: x, args=(next(input_iterator),))  # the incomplete one


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::"
           "testSimpleInputFromDatasetLastPartialBatch")
@MPI
def test_simple_input_from_dataset_last_partial_batch():
    """A last global batch of 6 is split 3 and 3 over the two workers."""
    strategy = two_workers_one_cpu()
    dataset = Dataset.range(14).batch(8, drop_remainder=False)
    result = next_two_steps(strategy, iter(strategy.experimental_distribute_dataset(dataset)))
    expected_data_on_workers = {"chief": [8, 9, 10], "worker": [11, 12, 13]}
    np.testing.assert_array_equal(np.asarray(result), expected_data_on_workers[task_type()])


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testSimpleInputFromFnLastPartialBatch")
@MPI
def test_simple_input_from_fn_last_partial_batch():
    """Per-worker datasets of per-replica batches of 4, sharded: the second step is 8..11 and 12, 13."""
    strategy = two_workers_one_cpu()

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(8)
        dataset = Dataset.range(14).batch(batch_size, drop_remainder=False)
        return dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)

    result = next_two_steps(strategy, iter(strategy.distribute_datasets_from_function(dataset_fn)))
    expected_data_on_worker = {"chief": [8, 9, 10, 11], "worker": [12, 13]}
    np.testing.assert_array_equal(np.asarray(result), expected_data_on_worker[task_type()])


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testReduceHostTensor")
@MPI
def test_reduce_host_tensor():
    """A plain value on each worker's one replica is that replica's value: SUM over two workers is 2."""
    strategy = two_workers_one_cpu()
    reduced = strategy.reduce(ms.ReduceOp.SUM, np.float32(1.), axis=None)
    assert float(np.asarray(reduced)) == 2.


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testReduceToHostTensor")
@MPI
def test_reduce_to_host_tensor():
    strategy = two_workers_one_cpu()
    value = np.float32(1.)
    reduced = strategy.extended.reduce_to(ms.ReduceOp.SUM, value, value)
    assert float(np.asarray(reduced)) == 2.


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testBatchReduceToHostTensor")
@MPI
def test_batch_reduce_to_host_tensor():
    strategy = two_workers_one_cpu()
    value = np.float32(1.)
    reduced = strategy.extended.batch_reduce_to(ms.ReduceOp.SUM, [(value, value), (value, value)])
    np.testing.assert_array_equal([np.asarray(r) for r in reduced], [2., 2.])


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testReduceDeviceTensors")
@MPI
def test_reduce_device_tensors():
    strategy = two_workers_one_cpu()
    value = strategy.run(lambda: np.float32(1.))
    reduced = strategy.reduce(ms.ReduceOp.SUM, value, axis=None)
    assert float(np.asarray(reduced)) == 2.


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testReduceToDeviceTensors")
@MPI
def test_reduce_to_device_tensors():
    strategy = two_workers_one_cpu()
    value = strategy.run(lambda: np.float32(1.))
    reduced = strategy.extended.reduce_to(ms.ReduceOp.SUM, value, value)
    assert float(np.asarray(reduced)) == 2.


@tf_source("strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest::testBatchReduceToDeviceTensors")
@MPI
def test_batch_reduce_to_device_tensors():
    strategy = two_workers_one_cpu()
    value = strategy.run(lambda: np.float32(1.))
    reduced = strategy.extended.batch_reduce_to(ms.ReduceOp.SUM, [(value, value), (value, value)])
    np.testing.assert_array_equal([np.asarray(r) for r in reduced], [2., 2.])


# -- StrategyClusterResolverTest ----------------------------------------------------------------------------------
@tf_source("strategy_common_test.py::StrategyClusterResolverTest::testClusterResolverProperty")
@pytest.mark.parametrize("make_strategy", SINGLE_WORKER)
def test_cluster_resolver_property_single_worker(make_strategy):
    """Strategies that are neither multi-worker nor TPU have no cluster resolver."""
    assert make_strategy().cluster_resolver is None


@tf_source("strategy_common_test.py::StrategyClusterResolverTest::testClusterResolverProperty")
@MPI
def test_cluster_resolver_property_multi_worker():
    """A multi-worker strategy keeps its resolver, which describes the cluster and this task: the pair's ranks
    are tasks 0 and 1 of one job (TF's task ids: test_cluster_resolver_property_tf_task_id)."""
    strategy = two_workers_one_cpu()
    resolver = strategy.cluster_resolver
    assert resolver is not None
    with strategy.scope():
        assert strategy.cluster_resolver is resolver
    for name in ("cluster_spec", "master", "num_accelerators", "task_id", "task_type"):
        assert hasattr(resolver, name), name
    assert resolver.task_id == (1 if _odd_pair_rank() else 0)
    assert resolver.task_type in ("chief", "worker")


@tf_source("strategy_common_test.py::StrategyClusterResolverTest::testClusterResolverProperty")
@MPI
@pytest.mark.xfail(condition="_odd_pair_rank()", strict=True, raises=AssertionError, reason=TASK_IDS)
def test_cluster_resolver_property_tf_task_id():
    """TF: ``self.assertEqual(resolver.task_id, 0)`` on both workers of its 2x1 cluster."""
    assert two_workers_one_cpu().cluster_resolver.task_id == 0
