"""The device transport: CuPy buckets through MPI, CUDA-aware when the library is, else via pinned host memory.

Without CUDA support (:func:`mpi_cuda_support`) a bucket goes through reusable page-locked host buffers
(:class:`PinnedStaging`), never allocated per call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat import config
from mpistrat.comm.transport.base import AgreementHook, Transport, TransportContext
from mpistrat.comm.transport.buffers import GrowableBuffers
from mpistrat.devices import synchronize_producer
from mpistrat.ops import mpi_op

__all__ = ["DeviceBufferTransport", "DeviceMpiTransport", "PinnedStaging", "loaded_mpi_library", "mpi_cuda_support"]


def loaded_mpi_library() -> str | None:
    """Path of the MPI shared library mapped into this process (the ``libmpi`` that mpi4py loaded,
    found in ``/proc/self/maps``), or None."""
    from mpi4py import MPI  # noqa: F401, PLC0415 - make sure libmpi is loaded

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = [line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6]
    except OSError:
        return None
    candidates = [p for p in paths if "/libmpi" in p and ".so" in p]
    # Prefer the C library (libmpi.so*, libmpich.so*) over Fortran/C++ bindings.
    for path in candidates:
        base = os.path.basename(path)
        if base.startswith(("libmpi.so", "libmpich.so")):
            return path
    return candidates[0] if candidates else None


@functools.lru_cache(maxsize=1)
def _query_library() -> bool | None:
    path = loaded_mpi_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def mpi_cuda_support(settings: config.Settings | None = None) -> bool | None:
    """Whether the MPI library accepts CUDA device pointers.

    ``MPISTRAT_CUDA_AWARE=1`` or ``0`` (from ``settings``, default the environment's) forces True
    or False; otherwise the library's ``MPIX_Query_cuda_support()`` (exported by MPICH and Open
    MPI), asked through ctypes once, answers, and None means unknown (the query is not exported).
    """
    forced = config.get("cuda_aware") if settings is None else settings.cuda_aware
    return _query_library() if forced is None else forced


class DeviceBufferTransport(Transport):
    """A device transport whose buckets are packed into its own reusable CuPy buffers and reduced as one
    array each (:meth:`allreduce_array`, which subclasses implement)."""

    def __init__(self) -> None:
        self._buffers = GrowableBuffers(self._device_empty)

    @staticmethod
    def _device_empty(count: int, dtype: np.dtype) -> Any:
        import cupy  # noqa: PLC0415

        return cupy.empty(count, dtype=dtype)

    def pack_buffer(self, count: int, dtype: np.dtype) -> Any:
        """This dtype's reusable device buffer, ``count`` items, on the current device."""
        return self._buffers.get(count, dtype)

    def allreduce_packed(self, count: int, dtype: np.dtype, op: str, hook: AgreementHook, out: Any = None) -> Any:
        """Reduce the packed device buffer into ``out``, or in place (then the buffer is returned)."""
        buf = self._buffers.get(count, dtype)
        if out is None:
            self.allreduce_array(MPI.IN_PLACE, buf, op, hook)
            return buf
        self.allreduce_array(buf, out, op, hook)
        return out


class DeviceMpiTransport(DeviceBufferTransport):
    """CuPy buckets over MPI: CUDA-aware when ``cuda_aware``, else host-staged.

    Host staging copies the bucket into a reusable pinned buffer, reduces it
    there with ``Allreduce(IN_PLACE)`` and copies it back.
    """

    name = "device-mpi"

    def __init__(self, comm: MPI.Comm, cuda_aware: bool) -> None:
        super().__init__()
        self.comm = comm
        self.cuda_aware = bool(cuda_aware)
        self.label = "cuda-aware-mpi" if self.cuda_aware else "host-staged-mpi"
        self._staging = PinnedStaging()

    @classmethod
    def create(cls, ctx: TransportContext) -> "DeviceMpiTransport":
        """The transport-table factory."""
        return cls(ctx.comm, bool(mpi_cuda_support(ctx.settings)))

    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Always (the device fallback)."""
        return True

    def allreduce_array(self, src: Any, dst: Any, op: str, hook: AgreementHook) -> None:
        """Reduce a contiguous device array (``src`` may be ``MPI.IN_PLACE``) into ``dst``."""
        source = dst if src is MPI.IN_PLACE else src
        if self.cuda_aware:
            synchronize_producer(source)
            hook.staged()
            self.comm.Allreduce(src, dst, mpi_op(op))
            return
        host = self._staging.get(dst.size, dst.dtype)
        source.reshape(-1).get(out=host)  # synchronous device-to-host copy
        hook.staged()
        self.comm.Allreduce(MPI.IN_PLACE, host, mpi_op(op))
        dst.reshape(-1).set(host)

    def close(self) -> None:
        """Drop the device and pinned buffers."""
        self._buffers.clear()
        self._staging.close()


class PinnedStaging:
    """Page-locked host buffers, one per slot, grown on demand and reused."""

    def __init__(self) -> None:
        self._memory: dict[Any, Any] = {}
        self._nbytes: dict[Any, int] = {}

    def get(self, count: int, dtype: np.dtype, slot: Any = 0) -> np.ndarray:
        """A 1-D NumPy view of ``count`` items over pinned memory for ``slot``."""
        dtype = np.dtype(dtype)
        nbytes = max(count * dtype.itemsize, 1)
        if self._nbytes.get(slot, 0) < nbytes:
            import cupy  # noqa: PLC0415

            size = max(nbytes, 2 * self._nbytes.get(slot, 0))
            self._memory[slot] = cupy.cuda.alloc_pinned_memory(size)
            self._nbytes[slot] = size
        return np.frombuffer(self._memory[slot], dtype=dtype, count=count)

    def close(self) -> None:
        """Drop the buffers (freed when no view refers to them)."""
        self._memory.clear()
        self._nbytes.clear()
