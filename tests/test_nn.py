"""``ms.nn.compute_average_loss`` and ``ms.nn.scale_regularization_loss`` against tf.nn's (TF 2.21).

TF documents both in tensorflow/python/ops/nn_impl_distribute.py: the loss
sum divided by ``global_batch_size`` (default: the per-replica batch times
``num_replicas_in_sync`` of the replica context; zero for a zero batch), the
weights applied by losses/util.scale_losses_by_sample_weight, and a
RuntimeError in cross-replica context. Every expected value and message below
was produced by TF 2.21 side by side (2 logical CPUs). MPI cases run under
``mpiexec -n 2`` and ``-n 4`` (``--only-mpi``).
"""

import numpy as np
import pytest

import mpistrat as ms

from helpers import DLPackOnly, make, rid

cal = ms.nn.compute_average_loss
L = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


@pytest.mark.parametrize("kwargs, expected, dtype", [
    ({}, 2.5, np.float32),
    ({"global_batch_size": 8}, 1.25, np.float32),
    ({"global_batch_size": np.int64(8)}, 1.25, np.float32),
    ({"global_batch_size": 0}, 0.0, np.float32),  # div_no_nan
    ({"sample_weight": 2.0}, 5.0, np.float32),
    ({"sample_weight": np.array([1.0, 0.0, 1.0, 0.0])}, 1.0, np.float32),
    ({"sample_weight": np.array([[1.0], [0.0], [1.0], [0.0]])}, 1.0, np.float32),  # last dim squeezed
    ({"sample_weight": np.array([1, 0, 1, 0])}, 1.0, np.float32),
])
def test_compute_average_loss_outside_any_strategy(kwargs, expected, dtype):
    got = cal(L, **kwargs)
    assert np.ndim(got) == 0 and got.dtype == dtype and float(got) == expected


@pytest.mark.parametrize("loss, expected, dtype", [
    (L.astype(np.float64), 2.5, np.float64),
    (L.astype(np.float16), 2.5, np.float16),
    (np.array([1, 2, 3], np.int32), 2.0, np.float64),  # integer losses: true division
    ([1.0, 2.0], 1.5, np.float32),  # Python floats are float32, as tf.convert_to_tensor
    (np.ones((4, 3), np.float32), 3.0, np.float32),  # every element counts, divided by the batch
    (np.zeros((0,), np.float32), 0.0, np.float32),  # an empty batch: 0, not nan
])
def test_compute_average_loss_dtypes_and_shapes(loss, expected, dtype):
    got = cal(loss)
    assert got.dtype == dtype and float(got) == expected


def test_compute_average_loss_weights_are_expanded_to_the_losses_rank():
    losses = np.ones((4, 3), np.float32)
    assert float(cal(losses, sample_weight=np.array([1.0, 0.0, 1.0, 0.0]))) == 1.5  # (4,) -> (4, 1)
    assert float(cal(losses, sample_weight=np.full((4, 3), 2.0))) == 6.0
    with pytest.raises(ValueError, match=r"sample_weight of shape \(3,\) cannot be broadcast"):
        cal(L, sample_weight=np.ones(3))


def test_compute_average_loss_errors():
    with pytest.raises(ValueError, match="Expected a tensor with at least rank 1. Received per_example_loss=3.0 "
                                         "with rank 0"):
        cal(np.float32(3.0))
    with pytest.raises(ValueError, match="Expected a tensor with at least rank 1"):
        cal(np.float32(3.0), global_batch_size=2)
    with pytest.raises(TypeError, match="global_batch_size must be an integer"):
        cal(L, global_batch_size=8.0)
    with pytest.raises(TypeError, match="global_batch_size must be an integer"):
        cal(L, global_batch_size=True)
    with pytest.raises(ValueError, match="global_batch_size must be scalar"):
        cal(L, global_batch_size=[8])
    with pytest.raises(ValueError, match="global_batch_size must be non-negative"):  # TF: InvalidArgumentError
        cal(L, global_batch_size=-1)
    s = make(2)
    with s.scope():
        with pytest.raises(RuntimeError, match="You are calling `compute_average_loss` in cross replica context"):
            cal(L)
        assert float(cal(L, global_batch_size=8)) == 1.25  # with the batch given, any context
    with ms.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(RuntimeError, match="in cross replica context"):
            cal(L)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_compute_average_loss_in_replica_context_uses_the_global_batch(n):
    s = make(n)
    out = s.experimental_local_results(s.run(lambda: cal(L)))
    assert [float(x) for x in out] == [10.0 / (4 * n)] * n
    out = s.experimental_local_results(s.run(lambda: cal(L, global_batch_size=16)))
    assert [float(x) for x in out] == [0.625] * n
    # summed over the replicas, the per-replica results are the mean over the global batch
    total = s.reduce("sum", s.run(lambda: cal(L * (rid() + 1))), axis=None)
    assert float(total) == pytest.approx(10.0 * sum(range(1, n + 1)) / (4 * n))


@pytest.mark.mpi(min_size=2)
def test_compute_average_loss_across_workers():
    from mpi4py import MPI

    size = MPI.COMM_WORLD.size
    s = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    per_replica = s.run(lambda: cal(np.full(3, float(rid()), np.float32)))
    assert [float(x) for x in s.experimental_local_results(per_replica)] == [
        3.0 * r / (3 * 2 * size) for r in (2 * MPI.COMM_WORLD.rank, 2 * MPI.COMM_WORLD.rank + 1)]
    total = s.reduce("sum", per_replica, axis=None)
    n = 2 * size
    assert float(total) == pytest.approx(sum(range(n)) / n)  # the mean of every replica's losses


def test_scale_regularization_loss():
    srl = ms.nn.scale_regularization_loss
    s = make(2)
    assert [float(x) for x in s.experimental_local_results(s.run(lambda: srl(np.float32(3.0))))] == [1.5, 1.5]
    out = s.run(lambda: srl(np.array([1.0, 2.0], np.float32)))  # summed first
    assert [float(x) for x in s.experimental_local_results(out)] == [1.5, 1.5]
    got = srl(3.0)
    assert float(got) == 3.0 and got.dtype == np.float32  # default strategy: one replica
    assert srl(3).dtype == np.float64 and srl(np.float64(3.0)).dtype == np.float64
    assert float(srl([1.0, 2.0])) == 3.0
    with s.scope():
        with pytest.raises(RuntimeError, match="You are calling `scale_regularization_loss` in cross replica "
                                               "context, while it was expected to be called in replica context."):
            srl(3.0)


def test_losses_may_be_variables():
    s = make(2)
    with s.scope():
        reg = ms.Variable(np.array([2.0, 4.0], np.float32))
    out = s.run(lambda: ms.nn.scale_regularization_loss(reg))
    assert [float(x) for x in s.experimental_local_results(out)] == [3.0, 3.0]


def test_foreign_losses_pass_the_one_boundary_conversion():
    """A DLPack-only loss and a big-endian one are read like NumPy (tf.convert_to_tensor converts both)."""

    out = cal(DLPackOnly(L), global_batch_size=8)
    assert out.dtype == np.float32 and float(out) == pytest.approx(10.0 / 8)
    big = cal(L.astype(">f4"), global_batch_size=8)
    assert big.dtype.isnative and float(big) == pytest.approx(10.0 / 8)
    with pytest.raises(TypeError, match="per_example_loss"):
        cal(np.array(["a", "b"]), global_batch_size=2)
