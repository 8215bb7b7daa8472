"""CUDA-aware detection and device-buffer paths.

On CPU the CUDA-aware branch is exercised as mpi4py's own tests do: an object
exposing ``__cuda_array_interface__`` over host memory, with
``MPISTRAT_CUDA_AWARE=1`` (MPICH then just sees a host pointer). Real CuPy
tests are marked ``gpu``.
"""

import dataclasses

import numpy as np
import pytest

from mpistrat import config, devices
from mpistrat.comm import CommunicationOptions, RankCommunicator
from mpistrat.comm.transport import cuda

CUDA_AWARE_ENV = "MPISTRAT_CUDA_AWARE"


class HostCudaArray:
    """A host NumPy array dressed as device memory (``__cuda_array_interface__`` v3)."""

    def __init__(self, array):
        self.array = array

    @property
    def __cuda_array_interface__(self):
        return {
            "shape": self.array.shape,
            "typestr": self.array.dtype.str,
            "data": (self.array.ctypes.data, False),
            "strides": None if self.array.flags.c_contiguous else self.array.strides,
            "version": 3,
            "stream": None,
        }


def test_mpi_cuda_support_query_and_override(monkeypatch):
    monkeypatch.delenv(CUDA_AWARE_ENV, raising=False)
    lib = cuda.loaded_mpi_library()
    assert lib is not None and "libmpi" in lib
    assert cuda.mpi_cuda_support() in (True, False, None)
    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    assert cuda.mpi_cuda_support() is True
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")
    assert cuda.mpi_cuda_support() is False
    monkeypatch.setenv(CUDA_AWARE_ENV, "maybe")
    with pytest.raises(ValueError, match="MPISTRAT_CUDA_AWARE must be one of 1/true/yes/on or 0/false/no/off"):
        cuda.mpi_cuda_support()


def test_device_buffer_detection():
    h = HostCudaArray(np.zeros(3))
    assert devices.is_device_buffer(h) and not devices.is_cupy_array(h)
    assert not devices.is_device_buffer(np.zeros(3))
    devices.synchronize_producer(h)  # stream None: nothing to wait for


@pytest.mark.mpi(min_size=1)
def test_cuda_array_interface_allreduce_inplace(comm, monkeypatch):
    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    with RankCommunicator(comm) as rc:
        a = np.full((4, 5), rc.rank + 1.0, np.float32)
        b = np.arange(7, dtype=np.int64) * (rc.rank + 1)
        host = np.full(3, rc.rank, np.float64)
        bufs = [HostCudaArray(a), HostCudaArray(b), host]
        out = rc.allreduce(bufs, "sum", inplace=True)
        assert out[0] is bufs[0] and out[1] is bufs[1] and out[2] is host
        n = rc.size
        np.testing.assert_array_equal(a, np.full((4, 5), n * (n + 1) / 2))
        np.testing.assert_array_equal(b, np.arange(7) * n * (n + 1) // 2)
        np.testing.assert_array_equal(host, np.full(3, n * (n - 1) / 2))
        with pytest.raises(TypeError, match="inplace=True"):
            rc.allreduce([HostCudaArray(a)], "sum")


@pytest.mark.mpi(min_size=1)
def test_cuda_aware_path_synchronises_the_producer_before_mpi(comm, monkeypatch):
    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    seen = []
    real = cuda.synchronize_producer

    def recording(x):  # what the buffer held when its stream was synchronised
        seen.append(x.array.copy())
        real(x)

    monkeypatch.setattr(cuda, "synchronize_producer", recording)
    with RankCommunicator(comm) as rc:
        a = np.full(5, rc.rank + 1.0)
        rc.allreduce([HostCudaArray(a)], "sum", inplace=True)
        n = rc.size
        if n > 1:  # a one-rank communicator moves nothing
            assert len(seen) == 1 and (seen[0] == rc.rank + 1).all(), "synchronised before MPI touched it"
        np.testing.assert_array_equal(a, np.full(5, n * (n + 1) / 2))


@pytest.mark.mpi(min_size=2)
def test_cuda_array_interface_needs_cuda_aware_mpi(comm, monkeypatch):
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")
    with RankCommunicator(comm) as rc:
        with pytest.raises(RuntimeError, match="not CUDA-aware"):
            rc.allreduce([HostCudaArray(np.zeros(2))], "sum", inplace=True)


# ----------------------------------------------------------------------------- real GPUs


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aware", ["1", "0"])
def test_cupy_allreduce_fused_and_direct(comm, monkeypatch, aware):
    import cupy

    if aware == "1" and comm.Get_size() > 1 and not cuda.mpi_cuda_support(
            dataclasses.replace(config.settings(), cuda_aware=None)):
        # Device pointers handed to an MPI library that is not CUDA-aware crash it (seen: SIGSEGV).
        pytest.skip(f"the MPI library ({cuda.loaded_mpi_library()}) does not report CUDA support")
    monkeypatch.setenv(CUDA_AWARE_ENV, aware)
    with RankCommunicator(comm) as rc:
        assert rc.cuda_aware is (aware == "1")
        xs = [cupy.full((i + 1, 3), rc.rank + 1, cupy.float32) for i in range(5)] + [cupy.arange(4) * rc.rank]
        for opts in (None, CommunicationOptions(bytes_per_pack=16)):
            out = rc.allreduce(xs, "sum", opts)
            n = rc.size
            for i in range(5):
                assert isinstance(out[i], cupy.ndarray)
                cupy.testing.assert_array_equal(out[i], cupy.full((i + 1, 3), n * (n + 1) / 2, cupy.float32))
            cupy.testing.assert_array_equal(out[5], cupy.arange(4) * n * (n - 1) // 2)
        big = cupy.full(1 << 20, rc.rank, cupy.float32)
        (res,) = rc.allreduce([big], "max", inplace=True)
        assert res is big and int(big.min()) == rc.size - 1
        g = rc.allgather(cupy.full((rc.rank + 1, 2), rc.rank, cupy.int32))
        assert isinstance(g, cupy.ndarray) and g.shape == (rc.size * (rc.size + 1) // 2, 2)
        (b,) = rc.broadcast([cupy.full(3, rc.rank, cupy.float64)], root=0)
        cupy.testing.assert_array_equal(b, cupy.zeros(3))


@pytest.mark.gpu
def test_pinned_staging_reuses_buffers():
    staging = cuda.PinnedStaging()
    a = staging.get(100, np.float32)
    b = staging.get(50, np.float32)
    assert a.ctypes.data == b.ctypes.data  # same pinned memory, no new allocation
    staging.close()


@pytest.mark.mpi(min_size=2)
def test_host_on_one_rank_device_on_another_is_a_mismatch(comm, monkeypatch):
    # Buckets are planned per kind, so kinds must agree across ranks: a clear error, not garbage.
    from mpistrat.comm import CollectiveMismatchError

    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    with RankCommunicator(comm) as rc:
        a = np.ones(4, np.float32)
        item = HostCudaArray(a) if rc.rank == 0 else a
        with pytest.raises(CollectiveMismatchError, match=r"array kinds .*rank 0 sent \[\(4,\), float32, CUDA buffer\]"):
            rc.allreduce([item], "sum", inplace=True)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_host_staging_moves_a_fused_bucket_once_through_reused_pinned_memory(comm, monkeypatch):
    # No silent host round trip per array: ten CuPy arrays are packed on the device into one bucket,
    # which crosses to the host once, into the same page-locked buffer every call.
    import cupy

    monkeypatch.setenv(CUDA_AWARE_ENV, "0")
    with RankCommunicator(comm, CommunicationOptions(implementation="MPI")) as rc:
        xs = [cupy.full(100 * (i + 1), rc.rank + 1, cupy.float32) for i in range(10)]
        rc.allreduce(xs, "sum")
        (transport,) = rc.device_transports
        assert transport.label == "host-staged-mpi"
        staged = []
        real_get = transport._staging.get

        def spy(count, dtype, slot=0):
            host = real_get(count, dtype, slot)
            staged.append((count, host.ctypes.data))
            return host

        transport._staging.get = spy
        for _ in range(2):
            out = rc.allreduce(xs, "sum")
        n = rc.size
        assert [c for c, _ in staged] == [5500, 5500], staged  # one bucket (sum of 100..1000) per call
        assert staged[0][1] == staged[1][1]  # the same pinned buffer, reused
        for i, o in enumerate(out):
            assert isinstance(o, cupy.ndarray) and o.device.id == xs[i].device.id
            cupy.testing.assert_array_equal(o, cupy.full(100 * (i + 1), n * (n + 1) / 2, cupy.float32))


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_repeated_calls_alternating_numpy_and_cupy_of_one_shape_keep_their_kind(comm):
    # A repeated call of one array reuses its plan by (op, divisor, shape, dtype, array type): a NumPy
    # array and a CuPy array of the same shape and dtype have plans of their own.
    import cupy

    with RankCommunicator(comm) as rc:
        n = rc.size
        for i in range(6):
            xp = cupy if i % 2 else np
            (out,) = rc.allreduce([xp.full(1000, rc.rank + i, np.float32)], "sum")
            assert type(out) is type(xp.empty(0))
            assert float(out[0]) == n * (n - 1) / 2 + n * i and float(out[-1]) == float(out[0])
