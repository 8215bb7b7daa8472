"""CentralStorageStrategy on logical CPU devices: one variable copy, replicated compute, TF's errors (issue 25).

Each test names the TensorFlow code whose behaviour it checks
(tensorflow/python/distribute/...). TF 2.21 builds the strategy on
``parameter_server_strategy.ParameterServerStrategyExtended`` and wraps
variables in ``ps_values.AggregatingVariable``.
"""

import copy

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.distribute.central_storage import AggregatingVariable

CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"
CPU1 = "/job:localhost/replica:0/task:0/device:CPU:1"


@pytest.fixture
def strategy():
    return ms.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])


def test_devices_default_parameter_device_is_cpu_with_several_compute_devices(strategy):
    # TF: parameter_server_strategy.py ParameterServerStrategyExtended._initialize_local: with several compute
    # devices the parameter device is "/device:CPU:0"; worker_devices are the compute devices, one replica each.
    assert strategy.num_replicas_in_sync == 2
    assert strategy.extended.worker_devices == (CPU0, CPU1)
    assert strategy.extended.parameter_devices == (CPU0,)
    assert strategy.extended.worker_devices_by_replica == [[CPU0], [CPU1]]


def test_one_compute_device_is_the_parameter_device():
    # TF: ParameterServerStrategyExtended._initialize_local: "If there is only one GPU, put everything on that GPU"
    # (parameter_device = compute_devices[0] when there is one compute device).
    s = ms.experimental.CentralStorageStrategy(["/cpu:1"])
    assert s.extended.parameter_devices == (CPU1,)
    with s.scope():
        v = ms.Variable(2.0)
    assert v.device == CPU1
    # TF: ParameterServerStrategyExtended._create_var_creator: with one replica in sync, the plain creator (no
    # AggregatingVariable); an update inside run applies as given.
    assert not isinstance(v, AggregatingVariable)
    s.run(lambda: v.assign_add(1.0))
    assert float(v) == 3.0


def test_explicit_parameter_device(strategy):
    # TF: central_storage_strategy.py CentralStorageStrategy.__init__(compute_devices, parameter_device).
    s = ms.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"], parameter_device="/cpu:1")
    with s.scope():
        v = ms.Variable(np.zeros(2, np.float32))
    assert s.extended.parameter_devices == (CPU1,) and v.device == CPU1


def test_variables_are_one_aggregating_variable_on_the_parameter_device(strategy):
    # TF: ParameterServerStrategyExtended._create_var_creator wraps the one variable in ps_values.AggregatingVariable
    # when num_replicas_in_sync > 1; it is a tf.Variable and its local results are itself.
    with strategy.scope():
        v = ms.Variable(np.arange(3, dtype=np.float32), name="w", aggregation=ms.VariableAggregation.SUM)
    assert isinstance(v, AggregatingVariable) and isinstance(v, ms.Variable)
    assert v.device == CPU0 and v.name == "w" and v.shape == (3,) and v.dtype == np.float32
    assert v.aggregation is ms.VariableAggregation.SUM
    assert strategy.experimental_local_results(v) == (v,)
    assert strategy.extended.value_container(v.get()) is v
    assert np.array_equal(np.asarray(v), [0, 1, 2])


def test_replica_updates_are_aggregated_and_applied_once(strategy):
    # TF: ps_values.AggregatingVariable._assign_func: in replica context merge_call, values_util.apply_aggregation
    # (reduce_to with the variable's aggregation), then one extended.update of the central variable.
    with strategy.scope():
        total = ms.Variable(np.zeros(2, np.float32), aggregation=ms.VariableAggregation.SUM)
        mean = ms.Variable(np.zeros(2, np.float32), aggregation=ms.VariableAggregation.MEAN)
        first = ms.Variable(np.zeros(2, np.float32), aggregation=ms.VariableAggregation.ONLY_FIRST_REPLICA)

    def step():
        r = ms.get_replica_context().replica_id_in_sync_group
        x = np.full(2, r + 1, np.float32)
        total.assign_add(x)
        mean.assign(x)
        first.assign_sub(x + 10)

    strategy.run(step)
    assert total.numpy().tolist() == [3.0, 3.0]      # 1 + 2, applied once
    assert mean.numpy().tolist() == [1.5, 1.5]
    assert first.numpy().tolist() == [-11.0, -11.0]  # replica 0's value only


def test_replica_update_with_aggregation_none_raises(strategy):
    # TF: ps_values.AggregatingVariable._assign_func raises ValueError(values_util.aggregation_error_msg) for an
    # update in replica context when aggregation is NONE.
    with strategy.scope():
        v = ms.Variable(1.0)
    with pytest.raises(ValueError, match="You must specify an aggregation method to update a AggregatingVariable"):
        strategy.run(lambda: v.assign_add(1.0))
    assert float(v) == 1.0


def test_update_with_per_replica_value_raises(strategy):
    # TF: parameter_server_strategy.py ParameterServerStrategyExtended._select_single_value (TF 2.0-2.3) raises
    # ValueError "You cannot update variable with a PerReplica object"; TF 2.4+ takes its first value (``_primary``)
    # instead, which would drop the other replicas' differing values: mpistrat raises where they differ.
    with strategy.scope():
        v = ms.Variable(np.zeros(2, np.float32))
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, ctx.replica_id_in_sync_group, np.float32))
    with pytest.raises(ValueError, match="You cannot update variable with a PerReplica object"):
        v.assign(per_replica)
    with pytest.raises(ValueError, match="You cannot update variable with a PerReplica object"):
        strategy.extended.update(v, lambda var, x: var.assign(x), args=(per_replica,))
    assert v.numpy().tolist() == [0.0, 0.0]


def test_update_with_mirrored_value_uses_its_value(strategy):
    # TF: ParameterServerStrategyExtended._select_single_value gives a Mirrored's primary value; _update runs fn
    # once on the unwrapped variable (AggregatingVariable.get()).
    with strategy.scope():
        v = ms.Variable(np.zeros(2, np.float32))
    mirrored = ms.Mirrored([np.ones(2, np.float32), np.ones(2, np.float32)])
    calls = []

    def fn(var, x):
        calls.append(var)
        var.assign_add(x)

    strategy.extended.update(v, fn, args=(mirrored,))
    assert v.numpy().tolist() == [1.0, 1.0]
    assert calls == [v.get()]


def test_update_with_per_replica_of_equal_values_uses_the_first(strategy):
    # TF 2.4+: ParameterServerStrategyExtended._select_single_value gives a PerReplica's ``_primary``; where every
    # replica holds the same value (gradients all-reduced in the replicas) that is every replica's value.
    with strategy.scope():
        v = ms.Variable(np.zeros(2, np.float32))
    same = ms.PerReplica([np.full(2, 2.0, np.float32), np.full(2, 2.0, np.float32)])
    strategy.extended.update(v, lambda var, x: var.assign(x), args=(same,))
    assert v.numpy().tolist() == [2.0, 2.0]


def test_update_of_a_non_variable_raises(strategy):
    # TF: ParameterServerStrategyExtended._update: "You can not update `var` %r. It must be a Variable."
    with pytest.raises(ValueError, match="It must be a Variable"):
        strategy.extended.update(np.zeros(2), lambda var: None)


def test_cross_replica_assign_and_read(strategy):
    # TF: AggregatingVariable._assign_func in cross-replica context wraps the update in extended.update; read_value
    # is the one variable's value.
    with strategy.scope():
        v = ms.Variable(np.ones(2, np.float32))
        v.assign_add(np.ones(2, np.float32))
    v.assign_sub(np.full(2, 0.5, np.float32))  # no strategy in scope: TF enters the variable's strategy
    assert v.read_value().tolist() == [1.5, 1.5]
    assert strategy.run(lambda: v.read_value()).tolist() == [1.5, 1.5]
    assert float(strategy.extended.read_var(v)[0]) == 1.5


def test_variable_created_in_replica_context_is_shared(strategy):
    # TF: mirrored_run.call_for_each_replica (ParameterServerStrategyExtended._call_for_each_replica) shares one
    # variable created in replica context among the replicas.
    made = []

    def step():
        made.append(ms.Variable(np.zeros(2, np.float32), aggregation=ms.VariableAggregation.SUM))

    strategy.run(step)
    assert len(made) == 2 and made[0] is made[1] and isinstance(made[0], AggregatingVariable)


def test_reduce_run_and_values_from_function(strategy):
    # TF: central_storage_strategy.py CentralStorageStrategy.reduce docstring (axis=None combines the replicas
    # element-wise, axis=0 also reduces along the batch, MEAN divides by the global count) and
    # ParameterServerStrategyExtended._experimental_distribute_values_from_function (one value per replica).
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.arange(2) + 2 * ctx.replica_id_in_sync_group)
    result = strategy.run(lambda x: x, args=(values,))
    assert [r.tolist() for r in strategy.experimental_local_results(result)] == [[0, 1], [2, 3]]
    assert strategy.reduce(ms.ReduceOp.SUM, result, axis=None).tolist() == [2, 4]
    assert int(strategy.reduce(ms.ReduceOp.SUM, result, axis=0)) == 6
    assert float(strategy.reduce(ms.ReduceOp.MEAN, result, axis=0)) == 1.5


def test_distribute_dataset_splits_batches_over_the_compute_devices(strategy):
    # TF: ParameterServerStrategyExtended._experimental_distribute_dataset over _input_workers_with_options (one
    # worker whose devices are the compute devices): each global batch is split over the replicas, as in
    # MirroredStrategy (central_storage_strategy.py experimental_distribute_dataset: PerReplica values).
    dist = strategy.experimental_distribute_dataset(ms.data.Dataset.range(8).batch(4))
    steps = [[x.tolist() for x in strategy.experimental_local_results(e)] for e in dist]
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_distribute_dataset_per_replica_mode_raises(strategy):
    # TF: central_storage_strategy.py CentralStorageStrategy.experimental_distribute_dataset raises
    # NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in
    # `experimental_distribute_datasets_from_function`.").
    options = ms.InputOptions(experimental_replication_mode=ms.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="PER_REPLICA is only supported in"):
        strategy.experimental_distribute_dataset(ms.data.Dataset.range(4).batch(2), options)


def test_datasets_from_function_one_worker_context_and_per_replica_raises(strategy):
    # TF: ParameterServerStrategyExtended._distribute_datasets_from_function: one InputContext
    # (num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync) for the machine; it has no per-replica
    # contexts, so PER_REPLICA raises as OneDeviceStrategy's (one_device_strategy.py) does.
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        return ms.data.Dataset.range(4).batch(1)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    assert contexts == [(1, 0, 2)]
    first = next(iter(dist))
    assert [x.tolist() for x in strategy.experimental_local_results(first)] == [[0], [1]]
    options = ms.InputOptions(experimental_replication_mode=ms.InputReplicationMode.PER_REPLICA)
    with pytest.raises(NotImplementedError, match="PER_REPLICA"):
        strategy.distribute_datasets_from_function(dataset_fn, options)


def test_chief_properties(strategy):
    # TF: ParameterServerStrategyExtended (local): _is_chief is True, so should_checkpoint, should_save_summary and
    # experimental_should_init are True; experimental_between_graph is True.
    ext = strategy.extended
    assert ext.should_checkpoint and ext.should_save_summary and ext.experimental_should_init
    assert ext.experimental_between_graph
    assert strategy.cluster_resolver is None


def test_sgd_training_step_updates_the_central_variable(strategy):
    # TF: an optimizer's apply_gradients in replica context all-reduces the gradients and updates each variable
    # once through extended.update (ParameterServerStrategyExtended._update on the unwrapped variable).
    with strategy.scope():
        w = ms.Variable(np.ones(2, np.float32))
        opt = ms.optimizers.SGD(learning_rate=0.5, momentum=0.5)

    def step():
        r = ms.get_replica_context().replica_id_in_sync_group
        grad = np.full(2, r + 1, np.float32)  # summed: 3
        opt.apply_gradients([(grad, w)])

    strategy.run(step)
    assert np.allclose(w.numpy(), 1 - 0.5 * 3)
    strategy.run(step)
    assert np.allclose(w.numpy(), 1 - 0.5 * 3 + (0.5 * -1.5 - 0.5 * 3))


def test_deepcopy_is_another_strategy(strategy):
    # TF: distribute_lib.Strategy.__deepcopy__: a copy with its own extended pointing back to it.
    copied = copy.deepcopy(strategy)
    assert copied is not strategy and copied.extended._container_strategy() is copied
    assert copied.extended.parameter_devices == strategy.extended.parameter_devices


def test_bad_compute_devices_raise():
    with pytest.raises(ValueError, match="list of device strings"):
        ms.experimental.CentralStorageStrategy("/cpu:0")
    with pytest.raises(ValueError, match="must not be empty"):
        ms.experimental.CentralStorageStrategy([])


def test_checkpoint_round_trip(strategy, tmp_path):
    # TF: ps_values.AggregatingVariable._gather_saveables_for_checkpoint saves the wrapped variable as a plain
    # variable's value: writing and restoring gives its value back.
    with strategy.scope():
        v = ms.Variable(np.arange(3, dtype=np.float32), aggregation=ms.VariableAggregation.SUM)
    ckpt = ms.Checkpoint(v=v)
    path = ckpt.write(str(tmp_path / "ck"))
    v.assign(np.zeros(3, np.float32))
    ckpt.restore(path)
    assert v.numpy().tolist() == [0.0, 1.0, 2.0]


@pytest.mark.gpu
def test_cpu_and_gpu_compute_devices_with_variables_on_the_cpu():
    # TF: central_storage_strategy.py CentralStorageStrategy.reduce docstring: compute_devices=['CPU:0', 'GPU:0'],
    # parameter_device='CPU:0'; the variable stays on the CPU, a GPU replica reads it on its own device, and the
    # replicas' SUM-aggregated update is applied once on the CPU.
    cupy = pytest.importorskip("cupy")
    s = ms.experimental.CentralStorageStrategy(["/cpu:0", "/gpu:0"], parameter_device="/cpu:0")
    with s.scope():
        v = ms.Variable(np.ones(4, np.float32), aggregation=ms.VariableAggregation.SUM)
    assert v.device == CPU0

    def step():
        ctx = ms.get_replica_context()
        read = v.read_value()
        on_gpu = isinstance(read, cupy.ndarray)
        v.assign_add(read * (ctx.replica_id_in_sync_group + 1))
        return on_gpu

    flags = s.experimental_local_results(s.run(step))
    assert list(flags) == [False, True]
    assert isinstance(v.value(), np.ndarray) and v.numpy().tolist() == [4.0] * 4  # 1 + 1*1 + 1*2
