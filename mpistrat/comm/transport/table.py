"""All-reduce backends for packed buckets, and how one is chosen.

A backend owns the buffer a bucket is packed into (``pack_buffer``) and
reduces it across ranks (``allreduce_packed``), see
:class:`AllreduceBackend`. Two optional methods let the communicator skip
copies where a backend can: ``allreduce_packed_to(count, dtype, op, out)``
(reduce the packed bucket straight into ``out``) and
``allreduce_array(src, dst, op)`` (reduce one contiguous array without
packing; ``src`` may be ``MPI.IN_PLACE``).

* :class:`MpiAllreduceBackend`: ``MPI_Allreduce`` on host (NumPy) buckets.
* :class:`DeviceMpiAllreduceBackend`: CuPy buckets, either handed to a
  CUDA-aware MPI (after synchronising the stream) or staged through
  reusable pinned host buffers.

:func:`select_backends` turns ``CommunicationOptions.implementation`` into
an ordered list of host backends; the communicator takes, per bucket, the
first one whose ``enabled(nbytes, dtype, op)`` is True. The choice is a
small table (:data:`PREFERENCES`, :data:`FACTORIES`); :func:`register_backend`
adds one.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from mpistrat.comm.transport.cuda import PinnedStaging, synchronize_producer
from mpistrat.comm.options import CommunicationImplementation, CommunicationOptions

__all__ = [
    "AllreduceBackend",
    "MpiAllreduceBackend",
    "DeviceMpiAllreduceBackend",
    "MPI_OPS",
    "PREFERENCES",
    "FACTORIES",
    "register_backend",
    "select_backends",
    "mpi_datatype",
    "GrowableBuffers",
    "stages_locally",
]

MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


@runtime_checkable
class AllreduceBackend(Protocol):
    """What the communicator needs from an all-reduce backend (docs/internals.md)."""

    name: str

    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Whether this backend takes a bucket of ``nbytes`` of ``dtype`` with ``op``."""

    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A 1-D buffer of ``count`` items where the caller packs the bucket."""

    def allreduce_packed(self, count: int, dtype: np.dtype, op: str) -> list[tuple[int, np.ndarray]]:
        """Reduce what was packed: pieces ``(start, 1-D array)`` covering ``[0, count)``."""

    def close(self) -> None:
        """Release the backend's resources."""


_STAGES_LOCALLY: dict[type, bool] = {}


def stages_locally(backend: Any) -> bool:
    """Whether ``backend`` lets the communicator overlap its agreement check with staging.

    It must say so (a class attribute ``stages_locally = True``) and its
    ``allreduce_array`` must take ``ready``: such a backend promises that, for
    a bucket size it has reduced before, ``pack_buffer`` and the staging part
    of ``allreduce_array`` do nothing collective, and that ``allreduce_array``
    calls ``ready`` before its first step that needs the other ranks. A
    subclass that overrides ``allreduce_array`` without ``ready`` does not
    qualify. Cached per class.
    """
    kind = type(backend)
    known = _STAGES_LOCALLY.get(kind)
    if known is None:
        method = getattr(kind, "allreduce_array", None)
        takes_ready = method is not None and "ready" in inspect.signature(method).parameters
        known = _STAGES_LOCALLY[kind] = bool(getattr(kind, "stages_locally", False)) and takes_ready
    return known


def mpi_datatype(dtype: Any) -> MPI.Datatype:
    """The MPI datatype of a NumPy dtype (ValueError when MPI has none)."""
    return dtlib.from_numpy_dtype(np.dtype(dtype))


class GrowableBuffers:
    """One flat buffer per dtype, grown (doubling) on demand; ``get`` returns views of ``count`` items."""

    def __init__(self, empty: Callable[[int, np.dtype], Any]) -> None:
        self._empty = empty
        self._buffers: dict[np.dtype, Any] = {}

    def get(self, count: int, dtype: np.dtype) -> Any:
        """A view of ``count`` items of this dtype's buffer."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.shape[0] < count:
            size = count if buf is None else max(count, 2 * buf.shape[0])
            buf = self._buffers[dtype] = self._empty(size, dtype)
        return buf[:count]

    def clear(self) -> None:
        """Drop the buffers."""
        self._buffers.clear()


class MpiAllreduceBackend:
    """``MPI_Allreduce`` on host buckets; one reusable buffer per dtype."""

    name = "mpi"
    stages_locally = True  # see stages_locally()

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self._buffers = GrowableBuffers(lambda n, dt: np.empty(n, dtype=dt))

    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Always: plain MPI is the fallback for every size, dtype and op."""
        return True

    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """This dtype's reusable buffer, ``count`` items."""
        return self._buffers.get(count, dtype)

    def allreduce_packed(self, count: int, dtype: np.dtype, op: str) -> list[tuple[int, np.ndarray]]:
        """``Allreduce(IN_PLACE)`` on the packed buffer; one piece."""
        buf = self._buffers.get(count, dtype)
        self.comm.Allreduce(MPI.IN_PLACE, buf, MPI_OPS[op])
        return [(0, buf)]

    def allreduce_packed_to(self, count: int, dtype: np.dtype, op: str, out: np.ndarray) -> None:
        """Reduce the packed buffer straight into ``out`` (no unpack copy)."""
        self.comm.Allreduce(self._buffers.get(count, dtype), out, MPI_OPS[op])

    def allreduce_array(self, src: Any, dst: np.ndarray, op: str, ready: Callable[[], Any] | None = None) -> None:
        """Reduce one contiguous array (``src`` may be ``MPI.IN_PLACE``) into ``dst``.

        ``ready`` is called first (nothing to stage). (MPI's send/receive form;
        copying ``src`` to ``dst`` and reducing in place measured the same
        here: both pay one extra pass over memory.)
        """
        if ready is not None:
            ready()
        self.comm.Allreduce(src, dst, MPI_OPS[op])

    def close(self) -> None:
        """Drop the buffers."""
        self._buffers.clear()


class DeviceMpiAllreduceBackend:
    """CuPy buckets over MPI: CUDA-aware when ``cuda_aware``, else host-staged.

    Host staging copies the bucket into a reusable pinned buffer, reduces it
    there with ``Allreduce(IN_PLACE)`` and copies it back.
    """

    def __init__(self, comm: MPI.Comm, cuda_aware: bool) -> None:
        self.comm = comm
        self.cuda_aware = bool(cuda_aware)
        self.name = "cuda-aware-mpi" if self.cuda_aware else "host-staged-mpi"
        self._buffers = GrowableBuffers(self._device_empty)
        self._staging = PinnedStaging()

    @staticmethod
    def _device_empty(count: int, dtype: np.dtype) -> Any:
        import cupy  # noqa: PLC0415

        return cupy.empty(count, dtype=dtype)

    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Always (the device fallback)."""
        return True

    def pack_buffer(self, count: int, dtype: np.dtype) -> Any:
        """This dtype's reusable device buffer, ``count`` items."""
        return self._buffers.get(count, dtype)

    def allreduce_packed(self, count: int, dtype: np.dtype, op: str) -> list[tuple[int, Any]]:
        """Reduce the packed device buffer in place; one piece."""
        buf = self._buffers.get(count, dtype)
        self.allreduce_array(MPI.IN_PLACE, buf, op)
        return [(0, buf)]

    def allreduce_packed_to(self, count: int, dtype: np.dtype, op: str, out: Any) -> None:
        """Reduce the packed device buffer into the device array ``out``."""
        self.allreduce_array(self._buffers.get(count, dtype), out, op)

    def allreduce_array(self, src: Any, dst: Any, op: str) -> None:
        """Reduce a contiguous device array (``src`` may be ``MPI.IN_PLACE``) into ``dst``."""
        mpi_op = MPI_OPS[op]
        if self.cuda_aware:
            synchronize_producer(dst if src is MPI.IN_PLACE else src)
            self.comm.Allreduce(src, dst, mpi_op)
            return
        source = dst if src is MPI.IN_PLACE else src
        host = self._staging.get(dst.size, dst.dtype)
        source.reshape(-1).get(out=host)  # synchronous device-to-host copy
        self.comm.Allreduce(MPI.IN_PLACE, host, mpi_op)
        dst.reshape(-1).set(host)

    def close(self) -> None:
        """Drop the device and pinned buffers."""
        self._buffers.clear()
        self._staging.close()


# --------------------------------------------------------------------------- selection

# A factory gets (comm, options) and returns a backend, or None when it does
# not apply here (for example one rank per node). A string "module:attr"
# names a factory imported on first use; an ImportError skips it.
Factory = Callable[[MPI.Comm, CommunicationOptions], Any]


def _mpi_factory(comm: MPI.Comm, options: CommunicationOptions) -> MpiAllreduceBackend:
    return MpiAllreduceBackend(comm)


def _shm_factory(comm: MPI.Comm, options: CommunicationOptions) -> Any:
    from mpistrat.comm.transport.shm.allreduce import ShmAllreduceBackend  # noqa: PLC0415

    forced = options.implementation == CommunicationImplementation.SHM
    backend = ShmAllreduceBackend(comm, min_bytes=0 if forced else None, timeout_seconds=options.timeout())
    if not forced and backend.min_bytes > backend.max_bytes:
        backend.close()  # never enabled here (one rank per node)
        return None
    return backend


FACTORIES: dict[str, Factory | str] = {
    "shm": _shm_factory,
    "mpi": _mpi_factory,
}

# Backends tried in order for each implementation (host buffers). Plain MPI
# ends every list: it takes whatever the others do not.
PREFERENCES: dict[CommunicationImplementation, tuple[str, ...]] = {
    CommunicationImplementation.AUTO: ("shm", "mpi"),
    CommunicationImplementation.SHM: ("shm", "mpi"),
    CommunicationImplementation.MPI: ("mpi",),
    CommunicationImplementation.RING: ("mpi",),
    CommunicationImplementation.NCCL: ("mpi",),  # NCCL works within a rank; MPI across ranks
}


def register_backend(name: str, factory: Factory | str, implementations: tuple[str, ...] = ("AUTO",)) -> None:
    """Add a backend and put it first for the named implementations."""
    FACTORIES[name] = factory
    for impl in implementations:
        key = CommunicationImplementation(impl.upper())
        PREFERENCES[key] = (name,) + tuple(n for n in PREFERENCES.get(key, ("mpi",)) if n != name)


def _resolve(factory: Factory | str) -> Factory | None:
    if not isinstance(factory, str):
        return factory
    module, _, attr = factory.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def select_backends(comm: MPI.Comm, options: CommunicationOptions) -> list[Any]:
    """The host backends for ``options.implementation``, in the order to try them.

    Collective over ``comm`` (backends may allocate shared resources). Every
    list ends with the plain MPI backend (the communicator sends single
    arrays straight to it).
    """
    chosen: list[Any] = []
    for name in PREFERENCES.get(options.implementation, ("mpi",)):
        factory = _resolve(FACTORIES[name]) if name in FACTORIES else None
        if factory is None:
            continue
        backend = factory(comm, options)
        if backend is not None:
            chosen.append(backend)
    plain = [b for b in chosen if getattr(b, "name", "") == "mpi"] or [MpiAllreduceBackend(comm)]
    return [b for b in chosen if getattr(b, "name", "") != "mpi"] + plain[:1]
