"""Node-wide MPI-3 shared-memory windows and their cheap synchronisation.

:class:`SharedWindow` hands out NumPy views of every node rank's segment; a :class:`NodeSync`
(``"barrier"`` or ``"counter"``, :func:`make_sync`) synchronises the node with the memory barriers around it.
"""

from __future__ import annotations

import atexit
import gc
import mmap
import sys
import warnings
import weakref
from typing import Iterable, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.comm.runtime.waiter import Waiter, default_spin

__all__ = [
    "PAGE_SIZE",
    "SharedWindow",
    "NodeSync",
    "BarrierSync",
    "CounterSync",
    "make_sync",
    "free_all",
    "exiting_cleanly",
]

PAGE_SIZE = mmap.PAGESIZE
_CACHE_LINE = 64
_LINE_ITEMS = _CACHE_LINE // 8  # int64 per cache line

# Open windows in creation order (strong references: a window is freed only
# collectively, never by the garbage collector at a rank-dependent time).
_OPEN: list["SharedWindow"] = []
# Windows whose views were still alive at free(): kept mapped until exit.
_KEPT: list["SharedWindow"] = []


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class SharedWindow:
    """A shared-memory window with one segment of ``nbytes`` per node rank.

    Collective over ``node_comm`` (every rank passes the same ``nbytes``; the
    communicator must be able to share memory, such as one from
    ``Split_type(COMM_TYPE_SHARED)`` or a subset of it). It allocates one
    page-aligned segment per rank (``MPI.Win.Allocate_shared`` with
    ``alloc_shared_noncontig``), pre-faults it (each rank writes its own segment
    and reads one byte per page of its peers', so the first reduction does not
    pay for the first touch of fresh shared pages), opens a passive-target epoch
    with ``Lock_all(MODE_NOCHECK)`` for its whole life, and hands out NumPy views
    of every rank's segment (``Shared_query``).

    Lifetime: NumPy views must never outlive ``Win.Free()``. Every view handed
    out derives from one root array per segment, tracked by weak reference.
    :meth:`free` (collective over the node) drops the window's own references and
    frees the window only when no rank of the node still holds a view; otherwise
    it warns (``ResourceWarning``) and keeps the memory mapped until exit, so a
    stale view reads stale data instead of crashing. Windows still open at
    interpreter exit are freed by an ``atexit`` hook (run before mpi4py finalises
    MPI), in creation order on every rank, unless the interpreter exits on an
    uncaught exception (then the peers may never arrive, and MPI's own teardown
    or abort reclaims the memory).
    """

    def __init__(self, node_comm: MPI.Comm, nbytes: int, *, prefault: bool = True, free_at_exit: bool = True) -> None:
        if nbytes < 0:
            raise ValueError(f"SharedWindow: nbytes must be >= 0, got {nbytes}")
        self.comm = node_comm
        self.rank = node_comm.Get_rank()
        self.size = node_comm.Get_size()
        self.nbytes = _round_up(max(int(nbytes), 1), PAGE_SIZE)
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self.win = MPI.Win.Allocate_shared(self.nbytes, 1, info, node_comm)
        finally:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)
        roots = []
        for r in range(self.size):
            buf, _ = self.win.Shared_query(r)
            # Each segment as big as its rank allocated: ranks may pass different sizes (one
            # holding a table, the others nothing), so never assume a peer's is as big as ours.
            roots.append(np.frombuffer(buf, dtype=np.uint8))
        self._roots: list[np.ndarray] | None = roots
        self._refs = [weakref.ref(a) for a in roots]
        if prefault:
            roots[self.rank].fill(0)  # first touch: back the pages now, not in the first reduce
        self.win.Sync()
        node_comm.Barrier()
        self.win.Sync()
        if prefault:
            for r, root in enumerate(roots):  # and map the peers' pages into this process
                if r != self.rank:
                    int(root[::PAGE_SIZE].max())
        if free_at_exit:
            _OPEN.append(self)

    @property
    def closed(self) -> bool:
        """Whether ``free()`` has run (views may no longer be taken)."""
        return self._roots is None

    def segment(self, rank: int) -> np.ndarray:
        """The whole segment of node rank ``rank`` as a uint8 array."""
        if self._roots is None:
            raise RuntimeError("SharedWindow is closed: its memory may be freed, no views can be taken")
        return self._roots[rank]

    def view(self, rank: int, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of ``rank``'s segment."""
        dtype = np.dtype(dtype)
        end = offset + count * dtype.itemsize
        segment = self.segment(rank)
        if offset < 0 or end > segment.nbytes or offset % dtype.itemsize:
            raise ValueError(
                f"SharedWindow.view: [{offset}, {end}) of {dtype} does not fit rank {rank}'s "
                f"{segment.nbytes}-byte segment aligned"
            )
        return segment[offset:end].view(dtype)

    def sync(self) -> None:
        """Memory barrier for this window (``MPI_Win_sync``)."""
        self.win.Sync()

    def free(self) -> None:
        """Free the window (collective over the node communicator; idempotent).

        If any rank of the node still holds a view into the window, the memory
        is kept mapped until exit instead, with a ``ResourceWarning``.
        """
        if self.win == MPI.WIN_NULL or self in _KEPT:
            return
        self._roots = None
        alive = sum(1 for r in self._refs if r() is not None)
        if alive:
            gc.collect()
            alive = sum(1 for r in self._refs if r() is not None)
        any_alive = self.comm.allreduce(alive, op=MPI.SUM)
        if self in _OPEN:
            _OPEN.remove(self)
        if any_alive:
            warnings.warn(
                f"SharedWindow.free: {any_alive} view(s) into the shared window are still alive on this node "
                f"({alive} on this rank); keeping the memory mapped until exit instead of freeing it",
                ResourceWarning,
                stacklevel=2,
            )
            _KEPT.append(self)
            return
        self.win.Unlock_all()
        self.win.Free()


class NodeSync:
    """A process synchronisation of a node with the memory barriers around it.

    Memory ordering follows the MPI unified memory model: a writer stores, calls
    ``Win.Sync`` (a memory barrier), then takes part in a process synchronisation;
    a reader does the synchronisation, then ``Win.Sync``, then loads. ``Fence`` is
    never used (it cannot be mixed with ``Lock_all``). Two synchronisations are
    offered behind this one interface: :class:`BarrierSync` and :class:`CounterSync`.
    """

    name = "abstract"

    def wait(self) -> None:
        """Return once every rank of the node has called ``wait`` as often."""
        raise NotImplementedError

    def free(self) -> None:
        """Release what this synchronisation allocated (collective)."""


class BarrierSync(NodeSync):
    """``Win.Sync``; ``Barrier``; ``Win.Sync`` on the data window."""

    name = "barrier"

    def __init__(self, window: SharedWindow) -> None:
        self._win = window.win
        self._comm = window.comm

    def wait(self) -> None:
        self._win.Sync()
        self._comm.Barrier()
        self._win.Sync()


class CounterSync(NodeSync):
    """Epoch counters in a small shared window, polled by a :class:`Waiter`, with a timeout.

    Every rank bumps its own epoch counter in a small second shared window (one
    cache line per rank) and waits until every peer's counter has reached the
    same epoch.
    ``waiter`` (default: spin ``default_spin`` of the node's size, never sleep) is how a rank
    polls its peers' counters. ``timeout`` (seconds, None for none) raises ``TimeoutError``
    naming the node ranks (and their ``rank_names``) that did not arrive.
    """

    name = "counter"

    def __init__(
        self,
        window: SharedWindow,
        *,
        waiter: Waiter | None = None,
        timeout: float | None = None,
        rank_names: Sequence[int] | None = None,
    ) -> None:
        comm = window.comm
        self._data_win = window.win
        n = comm.Get_size()
        self._counters = SharedWindow(comm, n * _CACHE_LINE if comm.Get_rank() == 0 else 0)
        # Item k * 8 is rank k's counter, one cache line each; a memoryview reads and writes one int64
        # several times faster than NumPy's scalar indexing, and the polls are what a waiting rank repeats.
        self._ctr: memoryview | None = memoryview(self._counters.segment(0)).cast("q")
        self._me = comm.Get_rank() * _LINE_ITEMS
        self._others = [r * _LINE_ITEMS for r in range(n) if r != comm.Get_rank()]
        self._epoch = 0
        self.waiter = Waiter(default_spin(n), None) if waiter is None else waiter
        self.timeout = timeout
        self._names = list(rank_names) if rank_names is not None else list(range(n))
        self._sync_counters = self._counters.win.Sync
        self._waiting = 0  # this epoch: index in _others of the first peer not seen yet
        self._poll = self._arrived  # bound once: a wait makes no objects

    def _arrived(self) -> bool:
        """Whether every peer's counter has reached this epoch, read after a memory barrier."""
        self._sync_counters()
        ctr, others, epoch, i = self._ctr, self._others, self._epoch, self._waiting
        while i < len(others) and ctr[others[i]] >= epoch:
            i += 1
        self._waiting = i
        return i == len(others)

    def wait(self) -> None:
        ctr = self._ctr
        if ctr is None:
            raise RuntimeError("CounterSync is freed")
        self._epoch += 1
        epoch = self._epoch
        self._data_win.Sync()  # this rank's data stores before its counter
        ctr[self._me] = epoch
        self._sync_counters()
        self._await(ctr, epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the last :meth:`wait` (or :meth:`advance`)."""
        return self._epoch

    def layout(self) -> tuple[int, bytes]:
        """Where the epochs live, for a compiled poster (``_lane.c``): the counters' address and every rank's
        counter as native int64 item indices, in rank order."""
        address = self._counters.segment(0).__array_interface__["data"][0]
        n = len(self._others) + 1
        return address, np.arange(0, n * _LINE_ITEMS, _LINE_ITEMS, dtype=np.int64).tobytes()

    def advance(self, waits: int) -> None:
        """Count ``waits`` waits whose epochs (:attr:`epoch` + 1 on) a compiled poster stored, each after its
        data stores, and saw every peer reach, but for the last, which it may leave to :meth:`wait_posted`."""
        self._epoch += waits

    def resync(self) -> None:
        """Set the count to the last epoch this rank posted (its counter): after a call that raised between a
        post and its count (a compiled poster's posts before :meth:`advance`, a signal handled as it returned;
        or :meth:`wait` interrupted before it posted). Only the count: nothing else the call changed."""
        if self._ctr is not None:
            self._epoch = self._ctr[self._me]

    def wait_posted(self) -> None:
        """The rest of a wait whose epoch this rank posted (:meth:`advance`): every peer reaching it."""
        ctr = self._ctr
        if ctr is None:
            raise RuntimeError("CounterSync is freed")
        self._sync_counters()
        self._await(ctr, self._epoch)

    def _await(self, ctr: memoryview, epoch: int) -> None:
        """Wait until every peer's counter reached ``epoch`` (this rank's is posted), then the barrier."""
        others = self._others
        i = 0
        while i < len(others) and ctr[others[i]] >= epoch:
            i += 1
        if i < len(others):
            self._waiting = i
            if not self.waiter.until(self._poll, self.timeout):
                self._raise_timeout(epoch)
        self._data_win.Sync()  # peers' data stores visible before our loads

    def _raise_timeout(self, epoch: int) -> None:
        assert self._ctr is not None
        missing = [self._names[r // _LINE_ITEMS] for r in self._others if self._ctr[r] < epoch]
        raise TimeoutError(
            f"node shared-memory synchronisation waited more than {self.timeout} s; "
            f"rank(s) {missing} never arrived (epoch {epoch})"
        )

    def free(self) -> None:
        if self._ctr is not None:
            self._ctr.release()  # no view left: the counters' window can be unmapped
        self._ctr = None
        self._counters.free()


def addresses(arrays: Iterable[np.ndarray]) -> bytes:
    """The arrays' data addresses, in order, as native uint64 bytes: what a compiled kernel (``_lane.c``) reads."""
    return np.array([a.__array_interface__["data"][0] for a in arrays], np.uint64).tobytes()


def make_sync(window: SharedWindow, kind: str, **kwargs) -> NodeSync:
    """A ``NodeSync`` of ``kind`` ``"barrier"`` or ``"counter"`` on ``window``."""
    if kind == "barrier":
        return BarrierSync(window)
    if kind == "counter":
        return CounterSync(window, **kwargs)
    raise ValueError(f"unknown node synchronisation {kind!r}: expected 'barrier' or 'counter'")


def free_all() -> None:
    """Free every open window, in creation order (collective; used at exit)."""
    for w in list(_OPEN):
        w.free()


def exiting_cleanly() -> bool:
    """False when the interpreter exits on an uncaught exception (``sys.last_value`` set).

    Collective frees are skipped then: the peers may never arrive, and a
    rank stuck in ``Win.Free`` at exit would keep the job from ending.
    """
    return MPI.Is_initialized() and not MPI.Is_finalized() and getattr(sys, "last_value", None) is None


@atexit.register
def _free_at_exit() -> None:
    if exiting_cleanly():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            free_all()
