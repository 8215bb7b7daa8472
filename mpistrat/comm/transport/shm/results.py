"""Result arrays in node shared memory, so that slice owners write the result straight into them.

Without them, the shared-memory transport's reduce-scatter leaves every rank's result in its own
window segment, and the rank copies it out: one more read and write of the whole array per call.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
from mpi4py import MPI

from mpistrat.comm.runtime.shm_window import PAGE_SIZE, SharedWindow, addresses
from mpistrat.comm.transport.base import ResultBlockSet, ResultBlockSource

__all__ = ["MAX_BYTES", "PRIVATE", "SLOTS", "ResultBlocks", "SharedResults"]

SLOTS = 2  # result blocks per rank and size: a step's result, and the previous one still held
PRIVATE = -1  # published when this call's result is a private array (copied out of the segment)
_CONTROL_BYTES = 64  # one cache line per rank: the published slot
_SIZES_MAX = 16  # sizes (count, dtype) given shared blocks, per transport
# Largest array given shared blocks: shared memory has 4 KiB pages (no transparent huge pages for
# shmem) while NumPy's large private arrays get huge pages, so above this, writing into every rank's
# block costs more page walks than the saved copy (benchmarks/README.md, "shared result blocks").
MAX_BYTES = 16 << 20


def _references(blocks: list[np.ndarray]) -> list[int]:
    """Each block's reference count, counted the same way every time."""
    return [sys.getrefcount(block) for block in blocks]


class SharedResults(ResultBlockSet):
    """:data:`SLOTS` shared result blocks of ``count`` items of ``dtype`` per node rank (collective
    over ``node_comm``: every rank passes the same ``count`` and ``dtype``).

    One per array size and dtype: a shared window whose segment on each node rank holds a control
    line and the rank's :data:`SLOTS` result blocks. Each rank picks one of its blocks per call (the
    communicator's result pool hands out a block nobody holds, or a private array when the caller
    holds all of them) and publishes its choice in its control line before the call's first node
    synchronisation; owners read every rank's choice after it and write their reduced slice into
    that block, or into the rank's window segment when it published :data:`PRIVATE` (that rank
    then copies its result out of its segment). When the result array is one of these blocks,
    nothing is copied out.

    Lifetime: a block handed to a caller keeps its window's memory mapped
    (``SharedWindow.free`` keeps a window whose views are alive until exit), so
    results stay valid after the strategy is gone. Each block is a separate
    array over its own memory view, so views a caller makes of a result refer to
    that block: the pool sees which blocks are held.
    """

    def __init__(self, node_comm: MPI.Comm, count: int, dtype: np.dtype) -> None:
        self.count = count
        self.dtype = dtype = np.dtype(dtype)
        block_bytes = -(-count * dtype.itemsize // PAGE_SIZE) * PAGE_SIZE
        # Not prefaulted: a block's pages are backed when first written, so unused slots cost nothing.
        self.window = SharedWindow(node_comm, PAGE_SIZE + SLOTS * block_bytes, prefault=False)
        self.rank = self.window.rank
        size = self.window.size
        self._controls = [self.window.view(r, np.int64, 0, _CONTROL_BYTES // 8) for r in range(size)]
        self._control = self._controls[self.rank]
        self._control[0] = PRIVATE
        self.published = PRIVATE  # this rank's last published slot
        offsets = [PAGE_SIZE + k * block_bytes for k in range(SLOTS)]
        # Every rank's blocks as this process maps them (where owners write) ...
        self._blocks = [[self.window.view(r, dtype, o, count) for o in offsets] for r in range(size)]
        # ... and this rank's own, each over its own memory view (what the result pool hands out).
        own = memoryview(self.window.segment(self.rank))
        nbytes = count * dtype.itemsize
        self.blocks = [np.frombuffer(own[o : o + nbytes], dtype=dtype) for o in offsets]
        self._free_refs = _references(self.blocks)  # while nothing else refers to them
        self._retired: list[np.ndarray] = []  # blocks of failed calls, pinned for good
        self.window.sync()

    def free_slots(self, own_refs: int = 0) -> list[int]:
        """The slots of this rank's blocks that nothing outside refers to (no result or view of one is
        alive) beyond ``own_refs`` references each (a fused bucket's result views, kept by its pool)."""
        return [k for k, (refs, free) in enumerate(zip(_references(self.blocks), self._free_refs))
                if refs <= free + own_refs]

    def slot_of(self, out: np.ndarray) -> int:
        """Which of this rank's blocks ``out`` is (a view of it, as handed out), or :data:`PRIVATE`."""
        base = out.base
        for k, block in enumerate(self.blocks):
            if base is block or out is block:
                return k
        return PRIVATE

    def publish(self, slot: int) -> None:
        """Announce this call's result block (before the call's first node synchronisation)."""
        self._control[0] = self.published = slot
        self.window.sync()

    def announce(self, out: np.ndarray) -> int:
        """:meth:`publish` of ``out``'s slot (:meth:`slot_of`) by a compiled kernel (``_lane.scatter``), which
        stores it into this rank's control word (:meth:`addresses`) before the call's first synchronisation;
        the slot."""
        self.published = slot = self.slot_of(out)
        return slot

    def addresses(self) -> tuple[bytes, bytes]:
        """For a compiled kernel: every rank's control word and every rank's :data:`SLOTS` blocks, as native
        uint64 addresses in rank order (blocks rank by rank)."""
        return addresses(self._controls), addresses(b for row in self._blocks for b in row)

    def retire(self) -> None:
        """Never hand out the published block again (its call failed: owners may still write)."""
        if 0 <= self.published < SLOTS:
            self._retired.append(self.blocks[self.published])

    def targets(self) -> list[np.ndarray | None]:
        """Every rank's published result block (None: :data:`PRIVATE`), read after the first
        synchronisation of the call."""
        self.window.sync()
        out: list[np.ndarray | None] = []
        for control, blocks in zip(self._controls, self._blocks):
            slot = int(control[0])
            out.append(blocks[slot] if 0 <= slot < SLOTS else None)
        return out

    def free(self) -> None:
        """Free the window (collective); memory still held by results stays mapped until exit."""
        self._controls = self._blocks = []
        self._control = None
        self.blocks = []
        self._free_refs = []
        self._retired = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # held results are expected, not a leak
            self.window.free()


class ResultBlocks(ResultBlockSource):
    """A transport's :class:`SharedResults`, one per array size, made at the first all-reduce of that
    size (collective: every rank reduces the same sizes in the same order, agreed before).

    ``enabled``: the transport pushes results (one node, two ranks or more); only arrays of more
    than ``above`` bytes (below, every rank writes its own result anyway) and at most
    :data:`MAX_BYTES` get blocks, at most ``budget`` bytes per rank in all (address space: a
    block's pages are backed once written).
    """

    def __init__(self, node_comm: MPI.Comm, enabled: bool, above: int, budget: int) -> None:
        self._comm = node_comm
        self._enabled = enabled
        self._above = above
        self._budget = budget
        self._sizes: dict[tuple[int, np.dtype], SharedResults | None] = {}  # None: refused

    def shared_results(self, count: int, dtype: np.dtype) -> SharedResults | None:
        """The blocks of ``count`` x ``dtype``, once made."""
        return self._sizes.get((count, np.dtype(dtype)))

    def may_share(self, count: int, dtype: np.dtype) -> bool:
        """Whether blocks of that size are still to be made (False: made, refused, or never)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        return self._enabled and self._above < nbytes <= MAX_BYTES and (count, dtype) not in self._sizes

    def make(self, count: int, dtype: np.dtype) -> SharedResults | None:
        """The blocks of ``count`` x ``dtype``, made now if due (collective then), or None."""
        key = (count, np.dtype(dtype))
        if key in self._sizes:
            return self._sizes[key]
        if not self.may_share(count, dtype):
            return None
        shared = None
        nbytes = SLOTS * count * key[1].itemsize
        if nbytes <= self._budget and len(self._sizes) < _SIZES_MAX:
            shared = SharedResults(self._comm, count, key[1])
            self._budget -= nbytes
        self._sizes[key] = shared
        return shared

    def free(self) -> None:
        """Free every size's window (collective: the same sizes in the same order on every rank)."""
        self._enabled = False
        for shared in self._sizes.values():
            if shared is not None:
                shared.free()
        self._sizes.clear()
