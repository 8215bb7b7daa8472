"""The plain MPI transport: ``MPI_Allreduce`` on host buffers, the fallback that takes every bucket."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

from mpistrat.comm.transport.base import AgreementHook, Transport, TransportContext
from mpistrat.comm.transport.buffers import GrowableBuffers
from mpistrat.ops import mpi_op

__all__ = ["MpiTransport", "mpi_datatype"]


def mpi_datatype(dtype: Any) -> MPI.Datatype:
    """The MPI datatype of a NumPy dtype (ValueError when MPI has none)."""
    return dtlib.from_numpy_dtype(np.dtype(dtype))


class MpiTransport(Transport):
    """``MPI_Allreduce`` on host buckets; one reusable buffer per dtype."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self._buffers = GrowableBuffers(lambda n, dt: np.empty(n, dtype=dt))

    @classmethod
    def create(cls, ctx: TransportContext) -> "MpiTransport":
        """The transport-table factory."""
        return cls(ctx.comm)

    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Always: plain MPI is the fallback for every size, dtype and op."""
        return True

    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """This dtype's reusable buffer, ``count`` items."""
        return self._buffers.get(count, dtype)

    def allreduce_packed(
        self, count: int, dtype: np.dtype, op: str, hook: AgreementHook, out: Any = None
    ) -> np.ndarray:
        """``Allreduce`` of the packed buffer into ``out``, or in place (then the buffer is returned)."""
        hook.staged()
        buf = self._buffers.get(count, dtype)
        if out is None:
            self.comm.Allreduce(MPI.IN_PLACE, buf, mpi_op(op))
            return buf
        self.comm.Allreduce(buf, out, mpi_op(op))
        return out

    def allreduce_array(self, src: Any, dst: np.ndarray, op: str, hook: AgreementHook) -> None:
        """``Allreduce`` of one contiguous array (MPI's send/receive form; nothing to stage)."""
        hook.staged()
        self.comm.Allreduce(src, dst, mpi_op(op))

    def close(self) -> None:
        """Drop the buffers."""
        self._buffers.clear()
