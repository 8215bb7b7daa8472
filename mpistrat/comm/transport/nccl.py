"""The NCCL transport: device buckets reduced by NCCL across ranks, one GPU per rank.

NCCL refuses two ranks on one GPU, so NCCL runs only where every rank of the communicator has a GPU of
its own. The ranks decide together at their first device bucket, once the agreement check has passed:
each tells the others its host and the PCI bus id of the GPU the bucket lives on
(:func:`nccl_feasible`); where GPUs are shared every bucket goes through the device MPI transport
instead. Else rank 0 broadcasts an NCCL unique id over MPI and every rank makes the NCCL communicator
on its GPU. Reductions run on a stream of their own, ordered after the producer's stream by an event and
before its next work by another, so the host never waits for them.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, NamedTuple, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.comm.options import CommunicationImplementation
from mpistrat.comm.transport.base import NO_AGREEMENT, AgreementHook, Transport, TransportContext
from mpistrat.comm.transport.cuda import DeviceBufferTransport, DeviceMpiTransport
from mpistrat.ops import WIRE_OPS, nccl_dtype

__all__ = ["NcclTransport", "GpuSeat", "nccl_feasible", "local_seat"]

_NO_DEVICE = -1  # local_seat without asking for a device: only whether NCCL is there
CLOSE_WAIT_SECONDS = 10.0  # how long close() waits for NCCL's last reduction before aborting the communicator


class GpuSeat(NamedTuple):
    """What one rank tells the others before they decide on NCCL."""

    host: str  # MPI.Get_processor_name(): the machine (pretend nodes share one)
    nccl: str  # "" when NCCL can run here, else why not
    gpu: str  # the PCI bus id of the rank's CUDA device ("" without one)


def local_seat(host: str, device: int | None = None) -> GpuSeat:
    """This rank's :class:`GpuSeat`: whether CuPy's NCCL is there, and the bus id of ``device`` (default:
    the current CUDA device)."""
    try:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415
    except Exception as exc:  # ImportError, CUDA libraries missing
        return GpuSeat(host, f"CuPy is not available ({type(exc).__name__}: {exc})", "")
    if not getattr(nccl, "available", False):
        return GpuSeat(host, "CuPy was built without NCCL", "")
    if device == _NO_DEVICE:
        return GpuSeat(host, "", "")
    try:
        return GpuSeat(host, "", str(cupy.cuda.Device(device).pci_bus_id))
    except Exception as exc:  # no CUDA device, driver errors
        return GpuSeat(host, f"no CUDA device ({type(exc).__name__}: {exc})", "")


def nccl_feasible(seats: Sequence[GpuSeat]) -> tuple[bool, str]:
    """Whether NCCL can reduce across these ranks (one seat per rank, in rank order), and why not.

    Every rank needs NCCL and a GPU of its own: two ranks on one node with the same GPU rule it out
    (NCCL refuses to run two ranks of one communicator on one device).
    """
    missing = [f"rank {r}: {s.nccl}" for r, s in enumerate(seats) if s.nccl]
    if missing:
        return False, "NCCL is not usable on every rank (" + "; ".join(missing) + ")"
    owners: dict[tuple[str, str], list[int]] = {}
    for r, s in enumerate(seats):
        owners.setdefault((s.host, s.gpu), []).append(r)
    shared = [f"ranks {', '.join(map(str, ranks))} share GPU {gpu} on {host}"
              for (host, gpu), ranks in owners.items() if len(ranks) > 1]
    if shared:
        return False, "NCCL needs a GPU per rank: " + "; ".join(shared)
    return True, ""


class NcclTransport(DeviceBufferTransport):
    """CuPy buckets (and other ``__cuda_array_interface__`` buffers) all-reduced with NCCL.

    Takes the dtypes NCCL has (:func:`mpistrat.ops.nccl_dtype`); other buckets fall to the device MPI
    transport. The agreement hook is called before NCCL is handed anything, so a mismatched call
    raises on every rank before any data is combined. Where the ranks share GPUs (decided at the first
    bucket) every bucket goes to ``fallback``, and under ``implementation=NCCL`` rank 0 warns why.
    """

    name = "nccl"

    def __init__(self, comm: MPI.Comm, fallback: Transport, warn: bool = False) -> None:
        super().__init__()
        self.comm = comm
        self.host = MPI.Get_processor_name()
        self.fallback = fallback
        self.warn = warn
        self.label = "nccl (not decided yet)"
        self.why_not: str | None = None  # None: not decided; "": NCCL runs; else why it does not
        self._nccl: Any = None  # cupy.cuda.nccl.NcclCommunicator
        self._device: int | None = None
        self._stream: Any = None

    @classmethod
    def create(cls, ctx: TransportContext) -> "NcclTransport | None":
        """The transport-table factory (collective): None on every rank unless NCCL is there on all."""
        if not all(ctx.comm.allgather(not local_seat("", _NO_DEVICE).nccl)):
            return None
        return cls(ctx.comm, DeviceMpiTransport.create(ctx),
                   warn=ctx.options.implementation is CommunicationImplementation.NCCL)

    # -- the decision, at the first bucket ------------------------------------------------------
    def _decide(self, device: int) -> None:
        """Whether NCCL runs (collective; after the first bucket's agreement), and if so its communicator."""
        seats = [GpuSeat(*s) for s in self.comm.allgather(tuple(local_seat(self.host, device)))]
        ok, why = nccl_feasible(seats)
        self.why_not = why
        if not ok:
            self.label = f"nccl unused: {self.fallback.name} ({why})"
            if self.warn and self.comm.Get_rank() == 0:
                warnings.warn(f"implementation=NCCL: device buckets go through MPI instead, because {why}",
                              RuntimeWarning, stacklevel=4)
            return
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        uid, error = None, None
        if self.comm.Get_rank() == 0:
            try:
                uid = nccl.get_unique_id()
            except Exception as exc:  # noqa: BLE001 - told to every rank below, so none waits in the init
                error = f"{type(exc).__name__}: {exc}"
        uid, error = self.comm.bcast((uid, error), root=0)
        if error is not None:
            raise RuntimeError(f"NCCL across ranks: rank 0 could not make the NCCL unique id ({error})")
        # ncclCommInitRank is collective and blocking: a rank whose init fails (out of memory, a broken
        # driver) leaves the others in theirs; NCCL has no timeout of its own here.
        with cupy.cuda.Device(device):
            self._nccl = nccl.NcclCommunicator(self.comm.Get_size(), uid, self.comm.Get_rank())
            self._stream = cupy.cuda.Stream(non_blocking=True)
        self._device = device
        self.label = f"nccl on GPU {device}"

    # -- the contract --------------------------------------------------------------------------
    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Buckets of a dtype NCCL has, with an op NCCL has."""
        return nccl_dtype(dtype) is not None and op in WIRE_OPS

    def allreduce_array(self, src: Any, dst: Any, op: str, hook: AgreementHook) -> None:
        """Reduce a contiguous device array (``src`` may be ``MPI.IN_PLACE``) into ``dst``, on NCCL's stream."""
        import cupy  # noqa: PLC0415

        out = _as_cupy(dst)
        hook.staged()  # every rank agreed (or raised) before anything below
        if self.why_not is None:
            self._decide(int(out.device.id))
        if self._nccl is None:
            self.fallback.allreduce_array(src, dst, op, NO_AGREEMENT)
            return
        send = out if src is MPI.IN_PLACE else _as_cupy(src)
        if int(out.device.id) != self._device:
            # A bucket on another GPU than the communicator's: every rank still calls NCCL (a rank that
            # refused here would leave its peers in ncclAllReduce), through a copy on the bound GPU.
            with cupy.cuda.Device(self._device):
                staged = cupy.array(send, copy=True)
            self._reduce(staged, staged, op)
            self._stream.synchronize()  # a rare path: the copy back runs on another device's stream
            with cupy.cuda.Device(int(out.device.id)):
                out[...] = staged
            return
        self._reduce(send, out, op)

    def _reduce(self, send: Any, out: Any, op: str) -> None:
        """ncclAllReduce of ``send`` into ``out`` (both on the bound GPU) on NCCL's stream, ordered by events
        after the work of the calling thread's current stream and before its next work."""
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        with cupy.cuda.Device(self._device):
            producer = cupy.cuda.get_current_stream()
            self._stream.wait_event(producer.record())
            self._nccl.allReduce(send.data.ptr, out.data.ptr, out.size, getattr(nccl, nccl_dtype(out.dtype)),
                                 getattr(nccl, WIRE_OPS[op].nccl), self._stream.ptr)
            producer.wait_event(self._stream.record())

    def close(self) -> None:
        """Destroy the NCCL communicator, close the fallback, drop the buffers."""
        if self._nccl is not None:
            deadline = time.monotonic() + CLOSE_WAIT_SECONDS
            while not self._stream.done and time.monotonic() < deadline:
                time.sleep(0.001)
            if self._stream.done:
                self._nccl.destroy()
            else:  # a reduction that never finishes (a peer is gone): abort, never wait forever
                self._nccl.abort()
            self._nccl = None
        self.fallback.close()
        self._buffers.clear()

    def describe(self) -> dict[str, Any]:
        """The name, and whether NCCL runs (with the GPU) or why not."""
        return {"name": self.name, "label": self.label}


def _as_cupy(x: Any) -> Any:
    """A CuPy view of a device buffer (CuPy arrays as they are; other ``__cuda_array_interface__`` buffers wrapped)."""
    import cupy  # noqa: PLC0415

    return x if isinstance(x, cupy.ndarray) else cupy.asarray(x)
