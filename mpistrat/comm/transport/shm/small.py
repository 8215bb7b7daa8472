"""The small-bucket transport: host buckets of one node in one shared-memory handshake, the agreement check's."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from mpistrat import ops
from mpistrat.comm.options import CommunicationImplementation
from mpistrat.comm.runtime.shm_window import NodeSync, SharedWindow, addresses, make_sync
from mpistrat.comm.runtime.topology import Topology
from mpistrat.comm.transport.base import NO_AGREEMENT, AgreementHook, RepeatTransport, TransportContext
from mpistrat.comm.transport.shm.allreduce import (
    COMPLEX_DTYPES,
    SUPPORTED_DTYPES,
    one_sync_max_bytes,
)

__all__ = ["SmallShmTransport"]


class SmallShmTransport(RepeatTransport):
    """All-reduce of host buckets of at most ``max_bytes`` among the ranks of one node (collective to create).

    Each rank copies its bucket into its slot of a small shared window, the node
    synchronises once, and every rank sums every rank's slot into its result in
    local-rank order ``((s0 + s1) + s2) + ...``, the window transport's order. The
    agreement check folds into that synchronisation (``folds_agreement``), so in
    the steady state a call costs the cache-line handshake of the check, one copy
    in and the sums: no second synchronisation, no growth, no planning.

    Two slots per rank alternate from call to call: a rank copies the next call's
    bucket in after one synchronisation, which every rank passes only once it has
    read the slots of the call before, and a rank still summing this call's slots
    reads the other ones (:class:`~mpistrat.comm.transport.shm.allreduce.ShmTransport`'s
    one-synchronisation path keeps the same rule).

    The transport table offers it (``"shm-small"``) under ``AUTO`` when the window
    transport's threshold is its rule (``MPISTRAT_SHM_MIN_BYTES=auto`` on every
    rank) and every rank of the communicator shares one node. It takes the buckets
    the window transport would reduce with one synchronisation (up to
    :func:`~mpistrat.comm.transport.shm.allreduce.one_sync_max_bytes`), and
    those below that transport's threshold that MPI took before. Both limits are
    rules, never measurements (they decide the order in which values are summed),
    and the order is the window's: the same bits on either side of the limit.
    """

    name = "shm-small"
    folds_agreement = True

    def __init__(self, topology: Topology, max_bytes: int | None = None, timeout_seconds: float | None = None) -> None:
        layout = topology.layout
        if layout.num_nodes != 1 or layout.local_size < 2:
            raise ValueError("SmallShmTransport: every rank of the communicator must share one node, two or more")
        if max_bytes is None:
            max_bytes = one_sync_max_bytes(topology)
        self.max_bytes = max_bytes
        self._node = layout.node_comm
        self._rank = layout.local_rank
        self._window: SharedWindow | None = SharedWindow(self._node, 2 * max_bytes)
        self._win_sync = self._window.win.Sync
        names = self._node.allgather(layout.comm.Get_rank())
        self._sync: NodeSync | None = make_sync(self._window, "counter", timeout=timeout_seconds, rank_names=names,
                                                waiter=topology.waiter)
        self._bytes = [self._window.segment(r) for r in range(self._window.size)]
        # Per (count, dtype) seen: for both slots, this rank's view and every rank's (a call slices nothing),
        # and whether the dtype is complex; per (shape, dtype) seen, the same views in that shape.
        self._views: dict[tuple[int, Any], tuple] = {}
        self._shaped: dict[tuple[tuple[int, ...], np.dtype], tuple] = {}
        self.slot = 0  # the parity of the next call's slots (flipped by every call that sums them)
        self._pending: tuple | None = None  # the entry of _views pack_buffer was last asked for
        # No exit hook of its own: its windows are freed at exit with every other window, in creation order
        # (shm_window.free_all), the one order every rank shares.

    @classmethod
    def create(cls, ctx: TransportContext) -> "SmallShmTransport | None":
        """The transport-table factory (collective): None unless every rank leaves the window's threshold to
        its rule and the communicator spans one node of two or more ranks. Buckets up to the window's
        one-synchronisation size, and never above ``MPISTRAT_SHM_MAX_BYTES`` (the smallest over the ranks)."""
        layout = ctx.topology.layout
        if layout.num_nodes != 1 or layout.local_size < 2:
            return None  # the same on every rank: one split
        wanted = (isinstance(ctx.settings.shm_min_bytes, str) and ctx.settings.shm_min_bytes.strip().lower() == "auto"
                  and ctx.options.implementation == CommunicationImplementation.AUTO)
        agreed = ctx.comm.allgather((wanted, ctx.settings.shm_max_bytes))
        if not all(w for w, _ in agreed):
            return None
        return cls(ctx.topology, min(one_sync_max_bytes(ctx.topology), min(m for _, m in agreed)), ctx.timeout)

    def describe(self) -> dict[str, Any]:
        """The name and the largest bucket."""
        return {"name": self.name, "max_bytes": self.max_bytes, "sync": "folded into the agreement check"}

    # -- the transport contract ------------------------------------------------
    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Buckets of at most ``max_bytes`` of a dtype and op the window transport takes."""
        if self._window is None or nbytes > self.max_bytes:
            return False
        wire = ops.WIRE_OPS.get(op)
        dtype = np.dtype(dtype)
        return wire is not None and (dtype in SUPPORTED_DTYPES or (wire.complex_ok and dtype in COMPLEX_DTYPES))

    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """This rank's slot for the next call, ``count`` items (1-D)."""
        views = self._views.get((count, dtype))
        if views is None:
            views = self._make_views(count, dtype)
        self._pending = views
        return views[self.slot][0]

    def allreduce_packed(self, count: int, dtype: np.dtype, op: str, hook: AgreementHook = NO_AGREEMENT,
                         out: Any = None) -> np.ndarray:
        """Sum (min, max) every rank's packed slot into ``out`` (a new array when None)."""
        if out is None:
            out = np.empty(count, dtype)
        self._reduce(self._views.get((count, dtype)), op, hook, out)
        return out

    def allreduce_array(self, src: Any, dst: np.ndarray, op: str, hook: AgreementHook = NO_AGREEMENT) -> None:
        """Reduce one C-contiguous array into ``dst`` (``src`` may be ``MPI.IN_PLACE``): what
        :meth:`allreduce_prepared` does with this call's :meth:`prepare_array`."""
        self.allreduce_prepared(self.prepare_array(dst.shape, dst.dtype, op), dst if src is MPI.IN_PLACE else src,
                                dst, hook.staged)

    def prepare_array(self, shape: tuple[int, ...], dtype: np.dtype, op: str) -> tuple:
        """Both slots' views in ``shape`` and the op's ufunc (ValueError for an op the dtype does not take)."""
        views = self._shaped.get((shape, dtype)) or self._shape_views(shape, dtype)
        return views, _ufunc(views, op, dtype)

    def allreduce_prepared(self, prepared: tuple, src: Any, dst: np.ndarray, staged: Callable[[], bool]) -> None:
        """:meth:`allreduce_array` with the views and ufunc of :meth:`prepare_array`: copy in (``src`` None:
        already in this rank's slot, as ``allreduce_packed`` packs it), the one synchronisation (the
        check's), the sums in local-rank order."""
        views = prepared[0]
        if src is not None:
            np.copyto(views[self.slot][0], src)
        self._win_sync()  # this rank's stores before the check's announcement
        self.finish_prepared(prepared, dst, staged())

    def finish_prepared(self, prepared: tuple, dst: np.ndarray, synced: bool) -> None:
        """The rest of :meth:`allreduce_prepared` once the check passed (``synced``: whether it was every
        rank's synchronisation, :meth:`AgreementHook.staged`): the sums of every rank's slot into ``dst``,
        in local-rank order. Also the end of a call whose copy and check ran elsewhere (the compiled lane,
        ``comm/agreement/lane.py``) but whose sums did not."""
        views, ufunc = prepared
        if views[3]:  # no items: the same count on every rank, so no rank synchronises
            return
        if synced:
            self._win_sync()  # the peers' stores before our loads
        else:
            assert self._sync is not None
            self._sync.wait()
        slots = views[self.slot][1]
        ufunc(slots[0], slots[1], out=dst)
        if len(slots) > 2:
            for slot in slots[2:]:
                ufunc(dst, slot, out=dst)
        self.slot ^= 1

    def slot_addresses(self, prepared: tuple) -> tuple[tuple[int, bytes], tuple[int, bytes]]:
        """For each slot parity of ``prepared`` (:meth:`prepare_array`'s): the address of this rank's slot and
        every rank's, in local-rank order, as native uint64 bytes (what the compiled lane reads)."""
        views = prepared[0]
        return tuple(
            (mine.__array_interface__["data"][0], addresses(every))
            for mine, every in views[:2])  # type: ignore[return-value]

    def close(self) -> None:
        """Free the window and its synchronisation (collective over the node; idempotent)."""
        if self._window is None:
            return
        self._views.clear()
        self._shaped.clear()
        self._bytes = []
        self._pending = None
        assert self._sync is not None
        self._sync.free()
        self._window.free()
        self._window = self._sync = None

    # -- internals ----------------------------------------------------------
    def _reduce(self, views: tuple | None, op: str, hook: AgreementHook, out: np.ndarray) -> None:
        """The one synchronisation (the check's, when it folded) and the sums of the slots ``views`` (an
        entry of ``_views``, packed into by the caller), in local-rank order: ``allreduce_packed``'s."""
        if views is None or views is not self._pending:
            raise RuntimeError(f"SmallShmTransport: reduce {out.size} x {out.dtype} without pack_buffer of that size "
                               "first")
        self._pending = None
        self.allreduce_prepared((views, _ufunc(views, op, out.dtype)), None, out, hook.staged)

    def _make_views(self, count: int, dtype: Any) -> tuple:
        dt = np.dtype(dtype)
        if self._window is None:
            raise RuntimeError("SmallShmTransport is closed: its shared window is freed")
        if count < 0 or count * dt.itemsize > self.max_bytes:
            raise ValueError(f"SmallShmTransport.pack_buffer: {count} x {dt} is outside [0, {self.max_bytes}] bytes")
        views = []
        for slot in (0, 1):
            start = slot * self.max_bytes
            every = [b[start : start + count * dt.itemsize].view(dt) for b in self._bytes]
            views.append((every[self._rank], every))
        entry = self._views[(count, dtype)] = (views[0], views[1], dt in COMPLEX_DTYPES, count == 0)
        return entry

    def _shape_views(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple:
        count = 1
        for n in shape:
            count *= n
        flat = self._views.get((count, dtype)) or self._make_views(count, dtype)
        slots = tuple((mine.reshape(shape), [v.reshape(shape) for v in every]) for mine, every in flat[:2])
        entry = self._shaped[(shape, dtype)] = slots + flat[2:]
        return entry


def _ufunc(views: tuple, op: str, dtype: Any) -> Any:
    """The ufunc of wire op ``op`` for the slots ``views`` (ValueError for an op their dtype does not take)."""
    wire = ops.WIRE_OPS.get(op)
    if wire is None or (views[2] and not wire.complex_ok):
        raise ValueError(f"SmallShmTransport: op {op!r} does not apply to {dtype}")
    return wire.ufunc
