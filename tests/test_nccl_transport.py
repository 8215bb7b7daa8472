"""The NCCL transport across ranks: when the ranks choose it, and what it computes on a GPU.

On CPU machines the choice is tested (every rank must decide alike, before any NCCL call); the
reductions themselves are marked ``gpu``. NCCL refuses two ranks on one GPU, so on a one-GPU node
NCCL runs on a one-rank communicator, and two ranks sharing the GPU are tested to fall back to MPI.
"""

import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpistrat.comm import CommunicationOptions, RankCommunicator
from mpistrat.comm.transport import nccl as nccl_transport
from mpistrat.comm.transport.base import NO_AGREEMENT, AgreementHook
from mpistrat.comm.transport.cuda import DeviceMpiTransport
from mpistrat.comm.transport.nccl import GpuSeat, NcclTransport, nccl_feasible
from mpistrat.ops import nccl_dtype


def test_nccl_needs_a_gpu_per_rank_and_nccl_on_every_rank():
    a, b = "0000:1B:00.0", "0000:3D:00.0"
    assert nccl_feasible([GpuSeat("n1", "", a), GpuSeat("n1", "", b)]) == (True, "")
    assert nccl_feasible([GpuSeat("n1", "", a), GpuSeat("n2", "", a)]) == (True, "")  # same bus id, other host
    assert nccl_feasible([GpuSeat("n1", "", a)]) == (True, "")
    ok, why = nccl_feasible([GpuSeat("n1", "", a), GpuSeat("n1", "", b), GpuSeat("n1", "", a)])
    assert not ok and why == f"NCCL needs a GPU per rank: ranks 0, 2 share GPU {a} on n1"
    ok, why = nccl_feasible([GpuSeat("n1", "", a), GpuSeat("n2", "CuPy was built without NCCL", "")])
    assert not ok and "rank 1: CuPy was built without NCCL" in why


def test_nccl_types_are_the_ones_nccl_has():
    assert nccl_dtype(np.float32) == "NCCL_FLOAT32" and nccl_dtype(np.uint64) == "NCCL_UINT64"
    for dtype in (np.bool_, np.complex64, np.dtype(">f4"), np.float128 if hasattr(np, "float128") else np.object_):
        assert nccl_dtype(dtype) is None, dtype


@pytest.mark.mpi(min_size=2)
def test_every_rank_declines_nccl_when_one_rank_lacks_it(comm, monkeypatch):
    # One rank claims NCCL, the others have no CuPy: the factory answers None on every rank (a rank
    # that chose NCCL alone would wait in ncclAllReduce forever), and device buckets take MPI.
    real = nccl_transport.local_seat
    if comm.Get_rank() == 0:
        monkeypatch.setattr(nccl_transport, "local_seat", lambda host, device=None: GpuSeat(host, "", ""))
    with RankCommunicator(comm, CommunicationOptions(implementation="NCCL")) as rc:
        ctx = rc._context
        assert NcclTransport.create(ctx) is None
    monkeypatch.setattr(nccl_transport, "local_seat", real)


@pytest.mark.mpi(min_size=2)
def test_nccl_row_without_cupy_falls_back_to_device_mpi(comm):
    from mpistrat.comm.transport import table

    assert table.PREFERENCES[(table.DEVICE, CommunicationOptions().implementation)][0] == "nccl"
    if nccl_transport.local_seat("", -1).nccl == "":
        pytest.skip("NCCL is available here: the GPU tests below cover the choice")
    with RankCommunicator(comm, CommunicationOptions(implementation="NCCL")) as rc:
        chosen = table.select(rc._context, table.DEVICE)
        assert [t.name for t in chosen] == ["device-mpi"]
        for t in chosen:
            t.close()


# ----------------------------------------------------------------------------- real GPUs


class _Recording(AgreementHook):
    def __init__(self):
        self.calls = 0

    def staged(self, first: bool = True) -> bool:
        self.calls += 1
        return False


@pytest.mark.gpu
def test_nccl_on_a_one_rank_communicator_reduces_on_its_stream():
    import cupy

    transport = NcclTransport(MPI.COMM_SELF, DeviceMpiTransport(MPI.COMM_SELF, False), warn=True)
    try:
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        x *= 3  # queued on the current stream: NCCL's stream must wait for it
        out = cupy.empty_like(x)
        hook = _Recording()
        transport.allreduce_array(x, out, "sum", hook)
        assert hook.calls == 1 and transport.why_not == "" and transport.label == "nccl on GPU 0"
        cupy.testing.assert_array_equal(out, cupy.arange(1 << 20, dtype=cupy.float32) * 3)
        buf = transport.pack_buffer(5, np.dtype(np.int64))
        buf[...] = cupy.arange(5)
        res = transport.allreduce_packed(5, np.dtype(np.int64), "max", NO_AGREEMENT)
        assert res.data.ptr == buf.data.ptr and cupy.asnumpy(res).tolist() == [0, 1, 2, 3, 4]  # in place
        assert not transport.enabled(8, np.dtype(np.complex64), "sum") and not transport.enabled(1, np.dtype(bool), "sum")
    finally:
        transport.close()


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_fall_back_to_mpi_with_a_warning(comm):
    import cupy

    from mpistrat.devices import num_gpus

    if num_gpus() >= comm.Get_size():
        pytest.skip("a GPU per rank here: NCCL runs (the one-GPU node tests the fallback)")
    with warnings.catch_warnings(record=True) as caught, \
            RankCommunicator(comm, CommunicationOptions(implementation="NCCL")) as rc:
        warnings.simplefilter("always")
        x = cupy.full(1000, rc.rank + 1, cupy.float32)
        (out,) = rc.allreduce([x], "sum")
        n = rc.size
        cupy.testing.assert_array_equal(out, cupy.full(1000, n * (n + 1) / 2, cupy.float32))
        first = rc.device_transports[0]
        assert first.name == "nccl" and "share GPU" in first.why_not
    told = [str(w.message) for w in caught if "implementation=NCCL" in str(w.message)]
    assert len(told) == (1 if comm.Get_rank() == 0 else 0) and "share GPU" in (told or ["share GPU"])[0]


@pytest.mark.gpu
def test_mirrored_strategy_in_rank_nccl_on_one_gpu():
    import cupy

    import mpistrat as ms

    strategy = ms.MirroredStrategy(["/gpu:0"], cross_device_ops=ms.NcclAllReduce())
    value = strategy.run(lambda: cupy.arange(6, dtype=cupy.float32).reshape(2, 3))
    total = strategy.reduce(ms.ReduceOp.SUM, value, axis=None)
    # TF's Strategy.reduce reduces to the current device, else "/device:CPU:0": a host value here.
    assert isinstance(total, np.ndarray) and total.tolist() == [[0, 1, 2], [3, 4, 5]]
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("mean", cupy.ones(4, cupy.float64) * 5))
    assert isinstance(out, cupy.ndarray) and out.device.id == 0
    cupy.testing.assert_array_equal(out, cupy.full(4, 5.0))
