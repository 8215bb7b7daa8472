"""OneDeviceStrategy: the seed's examples and the whole non-dataset API."""

import numpy as np
import pytest

import mpistrat as ms


@pytest.fixture
def strategy():
    return ms.OneDeviceStrategy("/cpu:0")


def test_seed_variable_device_and_run_loop(strategy):
    with strategy.scope():
        v = ms.Variable(1.0)
    assert v.device == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert v.dtype == np.float32 and float(v) == 1.0
    result = 0
    for i in range(10):
        result += strategy.run(lambda x: x * 2, args=(i,))
    assert result == 90


def test_seed_reduce_axis(strategy):
    t = np.arange(10)
    assert strategy.reduce(ms.ReduceOp.SUM, t, axis=None).tolist() == list(range(10))
    assert int(strategy.reduce(ms.ReduceOp.SUM, t, axis=0)) == 45
    assert float(strategy.reduce("mean", t, axis=0)) == 4.5
    assert int(strategy.reduce("max", t, axis=0)) == 9
    assert int(strategy.reduce("min", t, axis=0)) == 0


def test_num_replicas_extended_and_resolver(strategy):
    assert strategy.num_replicas_in_sync == 1
    assert strategy.cluster_resolver is None
    dev = "/job:localhost/replica:0/task:0/device:CPU:0"
    assert strategy.extended.worker_devices == (dev,)
    assert strategy.extended.parameter_devices == (dev,)


def test_run_args_must_be_list_or_tuple(strategy):
    with pytest.raises(ValueError, match="must be a list or tuple"):
        strategy.run(lambda x: x, args=1)
    with pytest.raises(ValueError, match="must be a dict"):
        strategy.run(lambda x: x, args=(1,), kwargs=[1])


def test_run_passes_nested_structures_and_kwargs(strategy):
    out = strategy.run(lambda d, scale=1: {"y": [d["x"][0] * scale, d["x"][1]]}, args=({"x": (2, 3)},),
                       kwargs={"scale": 5}, options=ms.RunOptions())
    assert out == {"y": [10, 3]}


def test_run_has_replica_context(strategy):
    ctx_id = strategy.run(lambda: ms.get_replica_context().replica_id_in_sync_group)
    assert ctx_id == 0
    assert strategy.run(lambda: ms.get_strategy()) is strategy


def test_local_results_and_values_from_function(strategy):
    assert strategy.experimental_local_results(3) == (3,)
    array_value = np.array([3.0, 2.0, 1.0])
    dv = strategy.experimental_distribute_values_from_function(lambda ctx: array_value[ctx.replica_id_in_sync_group])
    assert strategy.experimental_local_results(dv) == (3.0,)
    n = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert strategy.experimental_local_results(n) == (1,)


def test_gather(strategy):
    x = np.arange(6).reshape(3, 2)
    assert np.array_equal(strategy.gather(x, axis=0), x)


def test_extended_reduce_to_and_batch(strategy):
    ext = strategy.extended
    assert np.array_equal(ext.reduce_to("sum", np.ones(2), "/cpu:0"), np.ones(2))
    a, b = ext.batch_reduce_to("mean", [(np.ones(2), "/cpu:0"), (np.zeros(3), "/cpu:0")])
    assert a.tolist() == [1.0, 1.0] and b.tolist() == [0.0, 0.0, 0.0]


def test_extended_update_and_created_in_scope(strategy):
    with strategy.scope():
        v = ms.Variable([1.0, 2.0])
        out = strategy.extended.update(v, lambda var, d: var.assign_add(d), args=(np.ones(2),))
    assert out is v and v.numpy().tolist() == [2.0, 3.0]
    assert strategy.extended.variable_created_in_scope(v)
    w = ms.Variable(0.0)  # outside any scope: the default strategy's
    assert not strategy.extended.variable_created_in_scope(w)
    with strategy.scope():
        with strategy.extended.colocate_vars_with(v):
            c = ms.Variable(1.0)
    assert c.device == v.device
    with pytest.raises(RuntimeError, match="Need to be inside"):  # TF: only inside the strategy's scope
        with strategy.extended.colocate_vars_with(v):
            pass


def test_variable_api(strategy):
    with strategy.scope():
        v = ms.Variable(np.arange(3, dtype=np.float64), name="w")
    assert v.name == "w" and v.shape == (3,) and v.dtype == np.float64 and v.trainable
    snapshot = v.value()
    v.assign([5.0, 5.0, 5.0])
    assert snapshot.tolist() == [0.0, 1.0, 2.0]  # value() is a snapshot
    v.assign_add(1.0)
    v.assign_sub(np.array([1.0, 2.0, 3.0]))
    assert v.numpy().tolist() == [5.0, 4.0, 3.0]
    assert (v + 1).tolist() == [6.0, 5.0, 4.0] and (1 - v).tolist() == [-4.0, -3.0, -2.0]
    assert (v * v).tolist() == [25.0, 16.0, 9.0] and float(v @ np.ones(3)) == 12.0
    assert np.asarray(v).tolist() == [5.0, 4.0, 3.0] and v[0] == 5.0
    with pytest.raises(ValueError, match="shape"):
        v.assign([1.0, 2.0])
    with pytest.raises(ValueError, match="PerReplica"):
        v.assign(ms.PerReplica([1.0, 2.0]))
    with pytest.raises(ValueError, match="initial_value must be specified"):
        with strategy.scope():
            ms.Variable()
    i = ms.Variable(3)
    assert i.dtype == np.int32 and (i + 1) == 4
    lazy = ms.Variable(lambda: np.ones(2), dtype="float16")
    assert lazy.dtype == np.float16


@pytest.mark.gpu
def test_gpu_device_runs_on_cupy():
    import cupy

    s = ms.OneDeviceStrategy("/gpu:0")
    with s.scope():
        v = ms.Variable(1.0)
    assert v.device.endswith("GPU:0") and isinstance(v.value(), cupy.ndarray)
    out = s.run(lambda: cupy.cuda.Device().id)
    assert out == 0
