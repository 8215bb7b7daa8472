"""MirroredStrategy on real GPUs (CuPy, NCCL). Skipped where CuPy sees fewer than 2 devices."""

import numpy as np
import pytest

import mpistrat as ms

pytestmark = pytest.mark.gpu(min_gpus=2)


@pytest.fixture
def strategy():
    return ms.MirroredStrategy(["/gpu:0", "/gpu:1"])


def test_default_devices_are_all_gpus():
    s = ms.MirroredStrategy()
    assert s.num_replicas_in_sync == ms.devices.num_gpus() if hasattr(ms, "devices") else True
    assert all("GPU" in d for d in s.extended.worker_devices)


def test_nccl_is_the_default_cross_device_ops(strategy):
    assert isinstance(strategy.extended._cross_device_ops, ms.NcclAllReduce)


def test_replicas_run_on_their_device(strategy):
    import cupy

    ids = strategy.experimental_local_results(strategy.run(lambda: cupy.cuda.Device().id))
    assert ids == (0, 1)


@pytest.mark.parametrize("op, expect", [("sum", 3.0), ("mean", 1.5), ("max", 2.0), ("min", 1.0)])
def test_all_reduce_with_nccl(strategy, op, expect):
    import cupy

    def fn():
        r = ms.get_replica_context().replica_id_in_sync_group
        x = cupy.full((1000,), float(r + 1), dtype=cupy.float32)
        out = ms.get_replica_context().all_reduce(op, {"x": x})
        return out["x"], cupy.cuda.Device().id, out["x"].device.id

    vals, dev_ids, out_ids = (strategy.experimental_local_results(v) for v in strategy.run(fn))
    assert out_ids == dev_ids == (0, 1)
    for v in vals:
        assert np.allclose(cupy.asnumpy(v), expect)


def test_mirrored_variable_on_gpus(strategy):
    import cupy

    with strategy.scope():
        v = ms.Variable(np.ones(3, np.float32), aggregation=ms.VariableAggregation.SUM)
    assert [c.value().device.id for c in v.values] == [0, 1]
    strategy.run(lambda: v.assign_add(cupy.ones(3, cupy.float32)))
    assert all(np.allclose(c.numpy(), 3.0) for c in v.values)


def test_reduce_to_host(strategy):
    import cupy

    pr = strategy.experimental_distribute_values_from_function(
        lambda ctx: cupy.full((2, 2), ctx.replica_id_in_sync_group + 1.0))
    total = strategy.reduce("sum", pr, axis=None)
    assert isinstance(total, np.ndarray) and np.allclose(total, 3.0)
    assert np.allclose(strategy.reduce("mean", pr, axis=0), [1.5, 1.5])
