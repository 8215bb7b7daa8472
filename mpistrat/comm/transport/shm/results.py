"""Result blocks in node shared memory that a node's ranks share, so slice owners write each result once.

Without them, the shared-memory transport's reduce-scatter pushes every owner's reduced slice into
every rank's window segment, and each rank copies its result out. With them, every owner writes its
slice once into one block, and every rank's result is a read-only view of it (TensorFlow's results
are immutable tensors; an in-place write raises instead of reaching the other ranks' results).
"""

from __future__ import annotations

import sys
import warnings
import weakref

import numpy as np
from mpi4py import MPI

from mpistrat.comm.runtime.shm_window import PAGE_SIZE, SharedWindow, addresses
from mpistrat.comm.transport.base import ResultBlockSet, ResultBlockSource

__all__ = ["ALL_SLOTS", "MAX_BYTES", "SLOTS", "ResultBlocks", "SharedResults"]

SLOTS = 2  # result blocks per node and size: a step's result, and the previous one still held
ALL_SLOTS = (1 << SLOTS) - 1  # an offer of every slot (a bit per slot)
_CONTROL_BYTES = 64  # one cache line per rank: the slots it offers
_SIZES_MAX = 16  # sizes (count, dtype) given shared blocks, per transport
# Largest array given shared blocks: shared memory has 4 KiB pages (no transparent huge pages for
# shmem) while NumPy's large private arrays get huge pages. Measured when every rank had blocks of its
# own, each written in full (benchmarks/README.md, "shared result blocks"): above this, the page walks
# cost more than the saved copy. Not measured again since the node's ranks share one block.
MAX_BYTES = 16 << 20


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _references(blocks: list[np.ndarray]) -> list[int]:
    """Each block's reference count, counted the same way every time."""
    return [sys.getrefcount(block) for block in blocks]


class SharedResults(ResultBlockSet):
    """:data:`SLOTS` result blocks of ``count`` items of ``dtype`` that the ranks of a node share
    (collective over ``node_comm``: every rank passes the same ``count`` and ``dtype``).

    One per array size and dtype: a shared window whose first segment holds the node's blocks, and
    whose segment on each node rank holds a control line: the slots that rank offers for a call, a
    bit per slot, the blocks nobody on that rank holds (the result pool's :meth:`offer`, taken by
    the transport with :meth:`take_offer` and published before the call's first node
    synchronisation). After it, every rank reads every offer (:meth:`decide`): the lowest slot every
    rank offered is the call's result, which the owners write their slices into; where there is
    none, every result is private (the owners push into the window segments, and each rank copies
    its result out). Every rank reads the same offers, so every rank decides the same. ``chosen``
    says what this rank's last call decided (-1: private), for the pool to hand out.

    Lifetime: a block handed to a caller keeps its window's memory mapped
    (``SharedWindow.free`` keeps a window whose views are alive until exit), so
    results stay valid after the strategy is gone. Each block is a separate, read-only
    array over its own memory view, so views a caller makes of a result refer to
    that block: the pool sees which blocks this rank holds, and a block is written only when no
    rank of the node holds it.
    """

    def __init__(self, node_comm: MPI.Comm, count: int, dtype: np.dtype) -> None:
        self.count = count
        self.dtype = dtype = np.dtype(dtype)
        block_bytes = -(-count * dtype.itemsize // PAGE_SIZE) * PAGE_SIZE
        blocks_bytes = SLOTS * block_bytes if node_comm.Get_rank() == 0 else 0
        # Not prefaulted: a block's pages are backed when first written, so unused slots cost nothing.
        self.window = SharedWindow(node_comm, PAGE_SIZE + blocks_bytes, prefault=False)
        self.rank = self.window.rank
        size = self.window.size
        self._controls = [self.window.view(r, np.int64, 0, _CONTROL_BYTES // 8) for r in range(size)]
        self._control = self._controls[self.rank]
        self._control[0] = 0
        self.published = 0  # the slots this rank offered for its last call
        # The pool's offer and (weakly: a withdrawn-too-late offer must not pin the pool's entry) the private
        # result it came with.
        self._offer: tuple[int, object] = (0, None)
        self._decision = np.full(1, -1, np.int64)  # the last call's slot (-1: private), written by decide or a kernel
        offsets = [PAGE_SIZE + k * block_bytes for k in range(SLOTS)]
        # The node's blocks as this process maps them (where owners write) ...
        self._blocks = [self.window.view(0, dtype, o, count) for o in offsets]
        # ... and again, each read-only over its own memory view (what the result pool hands out).
        node = memoryview(self.window.segment(0))
        nbytes = count * dtype.itemsize
        self.blocks = [_read_only(np.frombuffer(node[o : o + nbytes], dtype=dtype)) for o in offsets]
        self._free_refs = _references(self.blocks)  # while nothing else refers to them
        self._retired: list[np.ndarray] = []  # blocks of failed calls, pinned for good
        self.window.sync()

    def free_slots(self, own_refs: int = 0) -> list[int]:
        """The slots of the node's blocks that nothing on this rank refers to (no result or view of one is
        alive) beyond ``own_refs`` references each (a fused bucket's result views, kept by its pool)."""
        return [k for k, (refs, free) in enumerate(zip(_references(self.blocks), self._free_refs))
                if refs <= free + own_refs]

    def slot_of(self, result: np.ndarray) -> int:
        """Which of the node's blocks ``result`` is (a view of it, as handed out), or -1."""
        base = result.base
        for k, block in enumerate(self.blocks):
            if base is block or result is block:
                return k
        return -1

    def offer(self, slots: int, private: object) -> None:
        """Offer ``slots`` (a bit per slot nobody on this rank holds) for the call whose private result
        would be ``private``; the call's transport takes the offer (:meth:`take_offer`)."""
        self._offer = (slots, weakref.ref(private))
        self._decision[0] = -1

    def take_offer(self, out: np.ndarray, usable: bool = True) -> int:
        """The slots offered with ``out`` (the private result, or a view of it; 0 for any other array, or
        where the call cannot take a shared result: not ``usable``), the offer withdrawn; what the transport
        publishes for the call."""
        slots, ref = self._offer
        self._offer = (0, None)
        self._decision[0] = -1
        private = ref() if ref is not None else None
        if not usable or private is None or not (out is private or out.base is private):
            slots = 0
        self.published = slots
        return slots

    def publish(self, slots: int) -> None:
        """Announce this rank's offer (before the call's first node synchronisation)."""
        self._control[0] = self.published = slots
        self.window.sync()

    def decide(self) -> np.ndarray | None:
        """The node's block every rank offered (the lowest such slot), as the owners write it, or None:
        private results. Read after the call's first synchronisation, the same on every rank."""
        self.window.sync()
        slot = self._common_slot(ALL_SLOTS)
        self._decision[0] = slot
        return self._blocks[slot] if slot >= 0 else None

    def _common_slot(self, slots: int) -> int:
        """The lowest of ``slots`` that every rank's published offer holds, or -1."""
        for control in self._controls:
            slots &= int(control[0])
        return (slots & -slots).bit_length() - 1

    @property
    def chosen(self) -> int:
        """The slot this rank's last call decided on (-1: a private result)."""
        return int(self._decision[0])

    def addresses(self) -> tuple[bytes, bytes, int]:
        """For a compiled kernel (``_lane.scatter``): every rank's control word, and the node's :data:`SLOTS`
        blocks, as native uint64 addresses in rank and slot order; the address of this rank's decision word."""
        return addresses(self._controls), addresses(self._blocks), self._decision.__array_interface__["data"][0]

    def retire(self) -> None:
        """Never offer again the block a failed call decided on, or would have (every rank's offer, where this
        rank failed before reading them): a late owner may still write into it."""
        slot = self.chosen
        if slot < 0:
            slot = self._common_slot(self.published)
        if slot >= 0:
            self._retired.append(self.blocks[slot])

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
    :data:`MAX_BYTES` get blocks, at most ``budget`` bytes in all (counted the same on every rank; the
    blocks lie in local rank 0's segment; address space: a block's pages are backed once written).
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
