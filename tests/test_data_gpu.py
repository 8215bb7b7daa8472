"""Per-device prefetch onto GPUs (CuPy). Skipped without CUDA devices."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat.data as D
from mpistrat.data.distribute import DistributedDataset, DistributedDatasetsFromFunction
from mpistrat.distribute.input_options import InputOptions, InputReplicationMode, InputWorkerInfo


@pytest.mark.gpu
@pytest.mark.parametrize("buffer", [0, 1, 3])
def test_batches_arrive_on_the_gpu(buffer):
    import cupy

    ds = D.Dataset.from_tensor_slices((np.arange(40, dtype=np.float32).reshape(20, 2), np.arange(20))).batch(8)
    steps = list(DistributedDataset(ds, InputWorkerInfo.single(("/gpu:0",)), InputOptions(experimental_per_replica_buffer_size=buffer)))
    assert len(steps) == 3
    x, y = steps[0]
    assert isinstance(x, cupy.ndarray) and x.device.id == 0 and isinstance(y, cupy.ndarray)
    assert cupy.asnumpy(x).tolist() == np.arange(16, dtype=np.float32).reshape(8, 2).tolist()
    assert steps[2][0].shape == (4, 2)


@pytest.mark.gpu
def test_fetch_to_device_false_keeps_numpy():
    ds = D.Dataset.range(8).batch(4)
    steps = list(DistributedDataset(ds, InputWorkerInfo.single(("/gpu:0",)), InputOptions(experimental_fetch_to_device=False)))
    assert all(isinstance(s, np.ndarray) for s in steps)


@pytest.mark.gpu(min_gpus=2)
def test_two_gpus_each_replica_on_its_device_with_empty_batches():
    import cupy

    info = InputWorkerInfo.single(("/gpu:0", "/gpu:1"))
    steps = list(DistributedDataset(D.Dataset.range(5).batch(4), info, None))
    assert [v.device.id for v in steps[0].values] == [0, 1]
    last = steps[1].values
    assert cupy.asnumpy(last[0]).tolist() == [4]
    assert last[1].shape == (0,) and last[1].device.id == 1 and last[1].dtype == np.int64
    per_rep = DistributedDatasetsFromFunction(
        lambda ctx: D.Dataset.range(4).batch(2), info,
        InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA))
    assert [v.device.id for v in next(iter(per_rep)).values] == [0, 1]


@pytest.mark.gpu
def test_place_dataset_on_device_per_replica_puts_values_on_the_gpu():
    import cupy

    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
                           experimental_fetch_to_device=False, experimental_place_dataset_on_device=True)
    dist = DistributedDatasetsFromFunction(lambda ctx: D.Dataset.range(4).batch(2), InputWorkerInfo.single(("/gpu:0",)),
                                           options)
    steps = list(dist)
    assert all(isinstance(s, cupy.ndarray) and s.device.id == 0 for s in steps)
    assert [cupy.asnumpy(s).tolist() for s in steps] == [[0, 1], [2, 3]]


class _NoImplicitHostCopy:
    """A device array as CuPy presents it: shape and dtype, and a refusal of implicit NumPy conversion."""

    def __init__(self, array: np.ndarray):
        self.shape, self.dtype = array.shape, array.dtype

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed.")


def test_batch_template_reads_device_arrays_without_converting_them():
    # Seen on the GPU node: the template of a batch of CuPy arrays asked NumPy for the dtype, which
    # CuPy refuses, so every GPU input pipeline with prefetch failed at its first batch.
    from mpistrat.data.splitting import template_of

    spec = template_of((_NoImplicitHostCopy(np.zeros((8, 2), np.float32)), _NoImplicitHostCopy(np.zeros(8, np.int64))))
    assert [(s.shape, s.dtype) for s in spec] == [((2,), np.float32), ((), np.int64)]
    assert template_of(np.float64(1.5)).dtype == np.float64 and template_of(3).dtype == np.int64  # via NumPy


@pytest.mark.gpu
def test_prefetch_copies_overlap_the_step_on_the_gpu():
    # Checked with CUDA events on the GPU's own clock, not wall-clock guesses: while the step's kernels
    # run on the compute stream, the prefetch thread's copies of the next batches run on theirs.
    import cupy

    ref = cupy.cuda.Event()
    ref.record()
    ds = D.Dataset.from_tensor_slices(np.ones((8, 1 << 20), np.float32)).batch(1)  # 4 MiB per step
    it = iter(DistributedDataset(ds, InputWorkerInfo.single(("/gpu:0",)),
                                 InputOptions(experimental_per_replica_buffer_size=2)))
    a = cupy.ones((2048, 2048), cupy.float32)
    computes = []
    for x in it:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(40):  # about 10 ms of matrix products, queued without waiting
            a = (a @ a) * (1.0 / 2048)
        assert float(x.sum()) == 1 << 20  # the batch arrived whole (this waits for the stream)
        end.record()
        computes.append((start, end))
    end.synchronize()
    at = lambda e: cupy.cuda.get_elapsed_time(ref, e)  # noqa: E731  ms since ref, on the GPU's clock
    copies = [(at(s), at(e)) for _, s, e in it._placer.copy_events]
    steps = [(at(s), at(e)) for s, e in computes]
    assert len(copies) == 8 and all(e >= s for s, e in copies)
    overlapping = [c for c in copies if any(c[0] < e and c[1] > s for s, e in steps)]
    assert overlapping, f"no copy overlapped a step: copies {copies}, steps {steps}"
