"""CrossDeviceOps used directly: reduce, batch_reduce, broadcast on logical CPU devices."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.distribute.cross_device_ops import destination_devices, select_cross_device_ops

CPU = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]


@pytest.mark.parametrize("op, expect", [("sum", 10.0), ("mean", 2.5), ("min", 1.0), ("max", 4.0)])
def test_reduce_to_one_and_several_destinations(op, expect):
    ops = ms.ReductionToOneDevice()
    pr = ms.PerReplica([np.full(3, float(i + 1)) for i in range(4)])
    one = ops.reduce(op, pr, "/cpu:0")
    assert isinstance(one, np.ndarray) and one.tolist() == [expect] * 3
    several = ops.reduce(op, pr, ["/cpu:0", "/cpu:1"])
    assert isinstance(several, ms.Mirrored) and all(v.tolist() == [expect] * 3 for v in several.values)


def test_batch_reduce_keeps_order_and_dtypes():
    ops = ms.ReductionToOneDevice()
    a = ms.PerReplica([np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32)])
    b = ms.PerReplica([np.ones((2, 2), np.float32), np.ones((2, 2), np.float32) * 3])
    ra, rb = ops.batch_reduce("sum", [(a, "/cpu:0"), (b, "/cpu:1")])
    assert ra.dtype == np.int32 and ra.tolist() == [0, 2, 4]
    assert rb.dtype == np.float32 and rb.tolist() == [[4.0, 4.0], [4.0, 4.0]]
    assert ops.batch_reduce("sum", []) == []


def test_mean_of_integers_is_a_true_quotient():
    # As TF (cross_device_utils.divide_by_n_tensors_or_indexed_slices): float64, not truncated.
    ops = ms.ReductionToOneDevice()
    r = ops.reduce("mean", ms.PerReplica([np.array([1, 2]), np.array([2, 5])]), "/cpu:0")
    assert r.dtype == np.float64 and r.tolist() == [1.5, 3.5]


def test_accumulation_fn_and_reduce_device():
    ops = ms.ReductionToOneDevice(reduce_to_device="/cpu:3", accumulation_fn=lambda xs: sum(xs) * 10)
    assert ops.reduce("sum", ms.PerReplica([np.ones(1), np.ones(1)]), "/cpu:0").tolist() == [20.0]
    assert ops.reduce_to_device == CPU[3]


def test_broadcast():
    ops = ms.ReductionToOneDevice()
    m = ops.broadcast(np.arange(2), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert isinstance(m, ms.Mirrored) and len(m.values) == 3 and all(v.tolist() == [0, 1] for v in m.values)
    assert ops.broadcast(np.arange(2), "/cpu:0").tolist() == [0, 1]


def test_mismatched_replica_shapes_raise():
    with pytest.raises(ValueError, match="different shapes"):
        ms.ReductionToOneDevice().reduce("sum", ms.PerReplica([np.ones(2), np.ones(3)]), "/cpu:0")


def test_destinations():
    assert destination_devices("/cpu:1") == [CPU[1]]
    assert destination_devices(["/cpu:0", "cpu:2"]) == [CPU[0], CPU[2]]
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        v = ms.Variable(1.0)
    assert destination_devices(v) == CPU[:2]
    for bad in (None, [], 3):
        with pytest.raises(ValueError):
            destination_devices(bad)


def test_selection_and_nccl_validation():
    assert isinstance(select_cross_device_ops(CPU[:2]), ms.ReductionToOneDevice)
    with pytest.raises(ValueError, match="num_packs >= 0"):
        ms.NcclAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="every device to be a GPU"):
        ms.NcclAllReduce()._ids(CPU[:2])


def test_strategy_uses_given_cross_device_ops():
    ops = ms.ReductionToOneDevice(accumulation_fn=lambda xs: sum(xs) + 100)
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    out = s.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(1)))
    assert [v.tolist() for v in s.experimental_local_results(out)] == [[102.0], [102.0]]
