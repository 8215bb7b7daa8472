"""All-reduce through a node-wide shared-memory window, hierarchical across nodes.

``ShmAllreduceBackend`` implements the ``AllreduceBackend`` protocol of
``docs/internals.md``. The caller packs its data straight into this rank's
segment of one shared window per node (``pack_buffer``), then
``allreduce_packed``:

1. synchronise the node (everyone has packed);
2. reduce-scatter: node rank i sums slice i of the bucket across all the
   node's segments, in cache-sized blocks, always in local-rank order
   ``((s0 + s1) + s2) + ...`` (so every slice is summed the same way), and
   writes it into slice i of its own segment;
3. across nodes (hierarchical): node rank i all-reduces its slice with MPI
   over ``cross_comm`` (the ranks with the same local rank on every node),
   non-blocking, polled with the same spin-then-yield policy as the node
   synchronisation (MPICH's blocking wait busy-polls and starves the ranks it
   waits for when ranks outnumber cores: 2 ms per call at 4 ranks on 2 cores);
   then (on one node, block by block right after step 2) node rank i pushes
   its reduced slice into slice i of every other rank's segment;
4. synchronise the node again; every rank reads the whole result from its
   own segment: one piece ``(0, view)``.

Why push, not let every rank read the owners' slices: a cache line that
another core has only read must be invalidated there before this core
writes it again, and on this project's VM that cost 0.42 ms per MiB in some
runs (against 0.04 ms for a line the other core last wrote). Pushed, every
line of a segment is last written by the core that reads it next or read by
the core that writes it next: the owner reads slice i of segment j (written
by rank j), then writes it; rank j reads it from its own segment, then packs
into it. 2 ranks, 1 MiB: 85 against 104 us; 4 ranks, 1 MiB: 371 against 477
us (one synchronisation and a sum of every segment by every rank).

Why two synchronisations suffice, with one bucket: a rank packs its segment
for the next call only after this call's second synchronisation, which every
rank reaches only after it has finished reading the segments (in step 2 only
the owner of slice i reads slice i of any segment, and it pushes into a block
only after summing it); it reads its own result from its segment before it
packs again, and owners push into it only after the next call's first
synchronisation. Pieces are therefore valid until the next ``pack_buffer``.
Two buckets alternate only after a one-synchronisation reduce (below), where
a fast rank may pack again while a slow one still reads every segment.
Staying on one bucket otherwise keeps the memory a run of calls touches at
one bucket, not two.
Nodes of different sizes work too: slices are owned by the first P local
ranks of each node, P the smallest node's size.

Results wanted in private memory (what the communicator hands out) skip the
pieces: ``allreduce_packed_to(count, dtype, op, out)``, and
``allreduce_array(src, dst, op)`` for one contiguous array (no caller-side
packing). On one node, buckets up to ``direct_max_bytes`` need one
synchronisation, not two: every rank sums all segments straight into its
output, in the reduce-scatter's order (the same bits on every rank and on both
paths). Otherwise the reduce-scatter above runs and the pieces are copied out,
except into ``allreduce_array``'s result blocks in shared memory
(``result_blocks``, shm_results): owners push into those directly.

Buckets bigger than the window: the window grows (a collective reallocation,
to the next power of two, at most ``max_bytes`` per bucket) inside
``pack_buffer``, which every rank calls with the same count. Buckets above
``max_bytes`` are not enabled (``enabled`` is False, ``pack_buffer`` raises):
the caller splits them (``bytes_per_pack``) or uses plain MPI.

Path choice: ``enabled(nbytes, ...)`` is True for ``min_bytes <= nbytes <=
max_bytes``. ``min_bytes`` is measured at start-up (``shm_calibration``: raw
``Allreduce`` against this path at 16 KiB..4 MiB; the smallest size from which
this path wins at every larger measured size, decided on rank 0 and
broadcast), unless given.

Environment knobs (constructor arguments override them):

* ``MPISTRAT_SHM_MIN_BYTES``: smallest bucket to take this path (bytes, K/M/G
  suffixes allowed; ``0`` takes it for every size), ``off`` (never), or
  ``auto`` (default: measured at start-up, once per process and rank set).
* ``MPISTRAT_SHM_MAX_BYTES``: largest bucket, per rank (default 64M). The
  window takes ``2 x`` this per rank at most (two buckets; one across nodes,
  where no reduce takes one synchronisation).
* ``MPISTRAT_SHM_BLOCK_BYTES``: reduction block per segment (default 256K).
* ``MPISTRAT_SHM_CHUNK_BYTES``: ``allreduce_array`` reduces longer arrays
  chunk by chunk, two synchronisations per chunk, so each chunk stays in
  cache; ``0`` never; default 1 MiB (shm_settings.DEFAULT_CHUNK_BYTES); ``auto``: at the first array of at least
  4 MiB, 1 MiB chunks are measured against one pass on that array (at most
  16 MiB of it; once per process and rank set),
  and chunks are cut only where they won (on an idle 2-core VM, 2 ranks:
  16 MiB 1.3-1.4x faster; where every synchronisation costs a scheduler slice,
  chunks lose and are not used).
* ``MPISTRAT_SHM_SYNC``: ``barrier``, ``counter`` or ``auto`` (default, which
  is ``counter``: measured as fast or faster than ``Barrier`` at every size,
  at 2 and 4 ranks; only ``counter`` honours ``timeout_seconds``).
* ``MPISTRAT_PRETEND_NODES``: cut the ranks into K pretend nodes (tests).
* For the plain MPI path above 32 MiB (outside this backend): ``MALLOC_MMAP_MAX_=0
  MALLOC_TRIM_THRESHOLD_=4294967296`` (2-3x faster at 64 MiB: no mmap per call).
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from mpistrat.comm.transport.shm import calibration as shm_calibration
from mpistrat.comm.errors import allgather_checked
from mpistrat.comm.runtime.waiter import default_spin, default_yields, pause, ranks_outnumber_cores, reads_clock
from mpistrat.comm.transport.shm.calibration import AUTO_CHUNK_BYTES
from mpistrat.comm.transport.shm.plan import ReducePlan, make_plan
from mpistrat.comm.transport.shm.results import PRIVATE, SLOTS, ResultBlocks, SharedResults
from mpistrat.comm.transport.shm.settings import agree_settings, parse_bytes, read_settings
from mpistrat.comm.transport.shm.window import PAGE_SIZE, NodeSync, SharedWindow, exiting_cleanly, make_sync
from mpistrat.comm.runtime.topology import NodeLayout, node_layout, resolve_pretend_nodes

__all__ = [
    "ShmAllreduceBackend",
    "DIRECT_MAX_BYTES",
    "DIRECT_MAX_BYTES_OVERSUBSCRIBED",
    "AUTO_CHUNK_BYTES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_OPS",
    "parse_bytes",
]

SUPPORTED_OPS = ("sum", "min", "max")
_UFUNCS = {"sum": np.add, "min": np.minimum, "max": np.maximum}
_MPI_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
SUPPORTED_DTYPES = frozenset(
    np.dtype(t)
    for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64")
)
_COMPLEX = frozenset(np.dtype(t) for t in ("complex64", "complex128"))  # sum only

_INITIAL = 1 << 20
# allreduce_packed_to on one node: up to this size every rank sums all segments after one
# synchronisation; above it the reduce-scatter (two synchronisations, 1/n of the additions each).
# Measured at 2 ranks: one synchronisation wins at 16 KiB (8.2 against 9.4 us) and 4 MiB, the
# reduce-scatter at 256 KiB-2 MiB (1 MiB: 108 against 138 us; bound to one core each, 512 KiB:
# 1.27-1.29x raw against 1.05x).
DIRECT_MAX_BYTES = 64 << 10
# With the pushed reduce-scatter, 4 ranks on 2 cores, in the VM's quick mode: one synchronisation
# wins at 64 KiB (54-57 against 75-82 us), is about even at 256 and 512 KiB (117-123 against 125-129,
# 189-200 against 192-198 us) and loses from 1 MiB (387-454 against 352-417 us). In its slow mode,
# where writing lines other cores read costs 0.4 ms per MiB, every rank reading every segment loses
# more: so the reduce-scatter from above 256 KiB.
DIRECT_MAX_BYTES_OVERSUBSCRIBED = 256 << 10
_ALIGN = 64  # slice boundaries on cache lines
_PLAN_CACHE = 64  # reduce plans kept (one per bucket, dtype and count seen)


def _close_at_exit(ref: "weakref.ref[ShmAllreduceBackend]") -> None:
    backend = ref()
    if backend is not None and exiting_cleanly():
        backend.close()


def _sum_segments(ufunc: np.ufunc, views: list[np.ndarray], start: int, end: int, out: np.ndarray) -> None:
    """``out = ((s0 + s1) + s2) + ...`` over ``[start, end)`` of every segment.

    Local-rank order, the reduce-scatter's order: every path gives the same bits.
    """
    ufunc(views[0][start:end], views[1][start:end], out=out)
    for view in views[2:]:
        ufunc(out, view[start:end], out=out)


class ShmAllreduceBackend:
    """All-reduce of packed buckets through a node shared-memory window.

    Collective over ``comm`` (default ``COMM_WORLD``). ``pretend_nodes`` cuts
    the ranks into pretend nodes (default from ``MPISTRAT_PRETEND_NODES``,
    capped at the communicator's size).
    ``min_bytes=0`` enables it for every size (what forcing it means).
    ``timeout_seconds`` bounds the node synchronisation (``counter`` sync).
    ``pack_buffer``, ``allreduce_packed`` and ``close`` are collective and
    every rank must pass the same count, dtype and op.
    """

    name = "shm"
    stages_locally = True  # backends.stages_locally: no collective before ready for a size seen before
    # allreduce_steps.folds_sync: when ``ready`` returns True, every rank has staged (ready was the
    # agreement check, posted after staging): the first node synchronisation is skipped.
    folds_sync = True

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        pretend_nodes: int | None = None,
        min_bytes: int | None = None,
        max_bytes: int | None = None,
        block_bytes: int | None = None,
        chunk_bytes: int | str | None = None,
        sync: str | None = None,
        timeout_seconds: float | None = None,
    ) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        error = None
        mine = None
        try:  # every per-rank check before the first collective, so a bad value on one rank cannot hang the rest
            pretend_nodes = resolve_pretend_nodes(comm.Get_size(), pretend_nodes)
            mine = read_settings(max_bytes, block_bytes, chunk_bytes, min_bytes, sync)
        except (ValueError, TypeError) as exc:
            error = exc
        # What every rank uses: ranks whose settings differ would take different paths and never meet.
        agreed = agree_settings(allgather_checked(comm, mine, error, "ShmAllreduceBackend"))
        self.max_bytes, self.block_bytes, self.sync_kind = agreed.max_bytes, agreed.block_bytes, agreed.sync
        self.layout: NodeLayout | None = node_layout(comm, pretend_nodes)
        lay = self.layout
        # Slice owners: local ranks [0, P) of every node, P the smallest node.
        self.owners = lay.comm.allreduce(lay.local_size, op=MPI.MIN)
        # Ranks sharing this machine's cores (pretend nodes share them too).
        machine = lay.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.spin = default_spin(machine.Get_size())
        oversubscribed = ranks_outnumber_cores(machine)
        self.yields = default_yields(oversubscribed)  # then sleep per poll (polling: yields may not switch)
        machine.Free()
        # One node: buckets up to this size take one synchronisation (allreduce_packed_to).
        direct = DIRECT_MAX_BYTES_OVERSUBSCRIBED if oversubscribed else DIRECT_MAX_BYTES
        pushes = lay.num_nodes == 1 and lay.local_size > 1  # owners push results into every segment
        self.direct_max_bytes = direct if pushes else -1
        # allreduce_array's results in shared memory, written by the owners (shm_results).
        self.result_blocks = ResultBlocks(lay.node_comm, pushes, self.direct_max_bytes, SLOTS * self.max_bytes)
        # allreduce_array of a long array, chunk by chunk, so each chunk's copy in, sum and copy out stay
        # in cache (2 ranks, 16 MiB in 2 MiB chunks: 2.2-2.9 instead of 3.6-4.5 ms in most runs; 2x slower
        # than raw MPI where every synchronisation cost a scheduler slice). Default a fixed 1 MiB
        # (shm_settings.DEFAULT_CHUNK_BYTES), which won in both modes; ``auto`` measures (_chunk_items).
        self.chunk_bytes: int | None = agreed.chunk_bytes
        self.chunk_calibration: list[tuple[int, float, float]] = []  # (bytes, one pass s, chunked s)
        self.timeout_seconds = timeout_seconds
        self._window: SharedWindow | None = None
        self._sync: NodeSync | None = None
        self._capacity = 0  # bytes per bucket per rank
        self._views: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        self._tmp: dict[np.dtype, np.ndarray] = {}
        self._plans: dict[tuple[int, np.dtype, int], ReducePlan] = {}
        self._bucket = 0
        self._pending: tuple[int, np.dtype] | None = None
        self._closed = False
        self.calibration: list[tuple[int, float, float]] = []
        if agreed.min_bytes is not None:
            self.min_bytes = agreed.min_bytes
        elif self.owners < 2:
            self.min_bytes = self.max_bytes + 1  # one rank per node: nothing to share, plain MPI
        else:
            self.min_bytes = shm_calibration.measure_threshold(self)
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- protocol -----------------------------------------------------------
    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Whether this backend takes a bucket of ``nbytes`` of ``dtype`` and ``op``."""
        if self._closed or not (self.min_bytes <= nbytes <= self.max_bytes):
            return False
        dtype = np.dtype(dtype)
        return op in _UFUNCS and (dtype in SUPPORTED_DTYPES or (op == "sum" and dtype in _COMPLEX))

    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A 1-D view of ``count`` items in this rank's segment, to pack into."""
        dtype = self._check_dtype(dtype, "sum")
        count = int(count)
        nbytes = count * dtype.itemsize
        if count < 0 or nbytes > self.max_bytes:
            raise ValueError(
                f"ShmAllreduceBackend.pack_buffer: {count} x {dtype} = {nbytes} bytes is outside "
                f"[0, max_bytes={self.max_bytes}]; split the bucket or use plain MPI"
            )
        self._ensure_capacity(nbytes)
        self._pending = (count, dtype)
        return self._typed(self._bucket, dtype)[self._local_rank()][:count]

    def allreduce_packed(
        self, count: int, dtype: np.dtype, op: str, synced: bool = False
    ) -> list[tuple[int, np.ndarray]]:
        """Reduce what every rank packed; pieces ``(start, view)`` covering ``[0, count)``.

        ``synced``: every rank of the node is known to have packed (a ``ready`` that returned True):
        the first synchronisation is skipped. Every rank must pass the same value.
        """
        ufunc, dtype = self._take_pending(count, dtype, op, "allreduce_packed")
        return self._reduce_scatter(count, dtype, ufunc, op, synced=synced)

    def _reduce_scatter(
        self, count: int, dtype: np.dtype, ufunc: np.ufunc, op: str, own: np.ndarray | None = None,
        synced: bool = False, shared: SharedResults | None = None, offset: int = 0,
    ) -> list[tuple[int, np.ndarray]]:
        """Steps 1-4 above. ``own``: this rank's data in private memory, read
        for its own slice instead of its segment (which then need not hold it).
        ``synced``: step 1's synchronisation already happened (see allreduce_packed).
        ``shared`` (with ``own``, on one node): the ranks' published result blocks, written from item
        ``offset`` instead of the window segments of the ranks that published one."""
        if count == 0:
            return []
        key = (self._bucket, dtype, count)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(key)
        sync = self._sync
        assert sync is not None
        if not synced:
            sync.wait()
        lr = self._local_rank()
        copyto = np.copyto
        results = shared.targets() if shared is not None else None
        if results is not None:
            mine = results.pop(lr)
        for srcs, dst, back, targets, start, end in plan.blocks:
            if own is not None:
                srcs = srcs[:lr] + (own[start:end],) + srcs[lr + 1 :]
            if results is not None:  # own is not mine (published PRIVATE in place): none read and written
                s, e = offset + start, offset + end
                if mine is not None:
                    dst, back = mine[s:e], None
                targets = tuple(t if r is None else r[s:e] for r, t in zip(results, targets))
            ufunc(srcs[0], srcs[1], out=dst)
            for src in srcs[2:]:
                ufunc(dst, src, out=dst)
            if back is not None:
                back[...] = dst
            for target in targets:  # step 3 on one node: while the block is in cache
                copyto(target, dst)
        if plan.cross is not None:
            assert self.layout is not None
            self._wait(self.layout.cross_comm.Iallreduce(MPI.IN_PLACE, plan.cross, op=_MPI_OPS[op]))
            for target in plan.cross_targets:
                copyto(target, plan.cross)
        sync.wait()  # the same bucket next time: every rank has read the segments (module docstring)
        return list(plan.pieces)

    def allreduce_packed_to(self, count: int, dtype: np.dtype, op: str, out: np.ndarray, synced: bool = False) -> None:
        """Reduce what every rank packed straight into ``out`` (1-D, ``count`` items, private memory).

        Up to ``direct_max_bytes``: one synchronisation, then each rank sums
        all segments into ``out`` (no copy out of the window). Otherwise the
        reduce-scatter of :meth:`allreduce_packed`, then the pieces are copied
        into ``out``. ``synced``: as in :meth:`allreduce_packed` (then no synchronisation at all
        up to ``direct_max_bytes``).
        """
        if count * np.dtype(dtype).itemsize > self.direct_max_bytes:
            for start, piece in self.allreduce_packed(count, dtype, op, synced):
                out[start : start + piece.shape[0]] = piece
            return
        ufunc, dtype = self._take_pending(count, dtype, op, "allreduce_packed_to")
        if count == 0:
            return
        views = self._typed(self._bucket, dtype)
        assert self._sync is not None
        if not synced:
            self._sync.wait()
        _sum_segments(ufunc, views, 0, count, out)
        # No second synchronisation: a rank packs this bucket again at the earliest two calls
        # later, with at least one synchronisation between, which every rank reaches only once
        # it has finished reading here (two-synchronisation calls stay on the other bucket).
        self._bucket ^= 1

    def allreduce_array(
        self, src: np.ndarray | MPI.BottomType, dst: np.ndarray, op: str, ready: Callable[[], Any] | None = None
    ) -> None:
        """Reduce one C-contiguous array into ``dst`` (``src`` may be ``MPI.IN_PLACE``; collective).

        Up to ``direct_max_bytes``: copied into this rank's segment, then
        :meth:`allreduce_packed_to`. Above: the reduce-scatter, with only the
        slices the other ranks sum copied into the segment (this rank's own
        slice is read from ``src``: at 2 ranks, 1 MiB in 78 instead of 108 us),
        then the pieces copied into ``dst`` (unless ``dst`` is a shared result block: see
        ``result_blocks``). With ``chunk_bytes`` set, longer
        arrays go chunk by chunk, so each chunk stays in cache between its
        passes, at two synchronisations per chunk (see ``__init__``).
        ``ready`` is called once this rank's (first chunk's) data is in its
        segment, before the first synchronisation, and before anything
        collective: the window never grows or measures after it is called.
        """
        source = (dst if src is MPI.IN_PLACE else src).reshape(-1)
        out = dst.reshape(-1)
        count, dtype = out.shape[0], out.dtype
        if ready is not None and not self._staged_without_collectives(count, dtype):
            ready(False)  # before staging (the window grows, or chunks are measured): not staged first
            ready = None
        shared = self.result_blocks.make(count, dtype)
        if shared is not None:  # in place, dst may be a held block: PRIVATE (sums would clobber the source)
            shared.publish(shared.slot_of(dst) if src is not MPI.IN_PLACE else PRIVATE)
        try:
            self.reduce_in_chunks(source, out, op, self._chunk_items(count, dtype), ready, shared)
        except BaseException:
            if shared is not None:
                shared.retire()  # a late owner may still write into it: never hand it out again
            raise

    def _staged_without_collectives(self, count: int, dtype: np.dtype) -> bool:
        """Whether ``allreduce_array`` of ``count`` items stages its data before any collective call
        (neither growing the window nor measuring chunks first)."""
        nbytes = count * dtype.itemsize
        measuring = self.chunk_bytes is None and nbytes >= shm_calibration.CHUNK_MEASURE_MIN
        if self.chunk_bytes:  # staged chunk by chunk: the window needs to hold one chunk
            nbytes = min(nbytes, self.chunk_bytes // dtype.itemsize * dtype.itemsize)
        return (self._window is not None and nbytes <= self._capacity and not measuring
                and not self.result_blocks.may_share(count, dtype))

    def reduce_in_chunks(
        self, source: np.ndarray, out: np.ndarray, op: str, chunk: int, ready: Callable[[], Any] | None = None,
        shared: SharedResults | None = None,
    ) -> None:
        """``out = reduce(source)`` of 1-D arrays, ``chunk`` items at a time (0: in one pass; collective).
        ``ready``: called before the first synchronisation. ``shared``: the result blocks every rank
        published for this call (``out`` is this rank's, or private if it published PRIVATE)."""
        if 0 < chunk < out.shape[0]:  # the same count and dtype on every rank: the same chunks
            for start in range(0, out.shape[0], chunk):
                end = start + chunk
                self._allreduce_contiguous(source[start:end], out[start:end], op, ready, shared, start)
                ready = None
            return
        self._allreduce_contiguous(source, out, op, ready, shared)

    def _chunk_items(self, count: int, dtype: np.dtype) -> int:
        """Items per chunk for an array of ``count`` (0: one pass). When ``chunk_bytes`` was left to
        measurement, the first array of at least ``CHUNK_MEASURE_MIN`` bytes decides it (collective:
        every rank reduces the same array; the communicator sends every rank's single arrays here,
        whatever their memory layout)."""
        if self.chunk_bytes is None:
            if self._closed or count * dtype.itemsize < shm_calibration.CHUNK_MEASURE_MIN:
                return 0
            self.chunk_bytes = shm_calibration.measure_chunks(self, count, dtype)
        return self.chunk_bytes // dtype.itemsize

    def _allreduce_contiguous(
        self, source: np.ndarray, out: np.ndarray, op: str, ready: Callable[[], Any] | None = None,
        shared: SharedResults | None = None, offset: int = 0,
    ) -> None:
        """:meth:`allreduce_array` of one 1-D array or chunk (``source`` may be ``out``), items
        ``offset`` on of the call's ``shared`` result blocks (see reduce_in_chunks)."""
        count, dtype = out.shape[0], out.dtype
        buf = self.pack_buffer(count, dtype)
        if count * dtype.itemsize <= self.direct_max_bytes:
            np.copyto(buf, source)
            self.allreduce_packed_to(count, dtype, op, out, self._staged(ready))
            return
        lo, hi = self._own_slice(count, dtype.itemsize)
        np.copyto(buf[:lo], source[:lo])
        np.copyto(buf[hi:], source[hi:])
        synced = self._staged(ready)
        ufunc, dtype = self._take_pending(count, dtype, op, "allreduce_array")
        pieces = self._reduce_scatter(count, dtype, ufunc, op, source, synced, shared, offset)
        if shared is not None and shared.published != PRIVATE:
            return  # the owners wrote the result into out
        for start, piece in pieces:
            out[start : start + piece.shape[0]] = piece

    def _staged(self, ready: Callable[[], Any] | None) -> bool:
        """Call ``ready`` (this rank's data is in its segment); whether it synchronised the node
        (it returned True: every rank had staged), so the next synchronisation is skipped."""
        if ready is None:
            return False
        assert self._window is not None
        self._window.sync()  # our stores to the segment before ready's (shared-memory) announcement
        if ready():
            self._window.sync()  # and the peers' stores before our loads
            return True
        return False

    def _own_slice(self, count: int, itemsize: int) -> tuple[int, int]:
        """The items ``[lo, hi)`` this rank sums in the reduce-scatter (empty when it owns
        none, or is alone on its node: then its segment is the slice, summed with nothing)."""
        lr = self._local_rank()
        assert self.layout is not None
        if lr >= self.owners or self.layout.local_size < 2:
            return 0, 0
        bounds = self._bounds(count, itemsize)
        return bounds[lr], bounds[lr + 1]

    def _take_pending(self, count: int, dtype: np.dtype, op: str, what: str) -> tuple[np.ufunc, np.dtype]:
        """Check that ``pack_buffer(count, dtype)`` came first and ``op`` fits; the ufunc and dtype."""
        pending = self._pending
        if pending is None or pending[0] != count or pending[1] != dtype:
            raise RuntimeError(
                f"ShmAllreduceBackend.{what}({count}, {dtype}) must follow pack_buffer with the same "
                f"count and dtype (pending: {pending})"
            )
        ufunc = _UFUNCS.get(op)
        if ufunc is None:
            raise ValueError(f"ShmAllreduceBackend: op must be one of {SUPPORTED_OPS}, got {op!r}")
        dtype = pending[1]
        if ufunc is not np.add and dtype in _COMPLEX:
            raise TypeError(f"ShmAllreduceBackend: dtype {dtype} is not supported for op {op!r}")
        self._pending = None
        return ufunc, dtype

    def close(self) -> None:
        """Free the window and communicators (collective over ``comm``; idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        self._plans.clear()
        self._tmp.clear()
        self._pending = None
        self.result_blocks.free()
        if self._sync is not None:
            self._sync.free()
            self._sync = None
        if self._window is not None:
            self._window.free()
            self._window = None
        if self.layout is not None:
            self.layout.free()
            self.layout = None

    # -- internals ----------------------------------------------------------
    def _local_rank(self) -> int:
        if self.layout is None:
            raise RuntimeError("ShmAllreduceBackend is closed")
        return self.layout.local_rank

    def _check_dtype(self, dtype: np.dtype, op: str) -> np.dtype:
        if self._closed:
            raise RuntimeError("ShmAllreduceBackend is closed: its shared window is freed")
        dtype = np.dtype(dtype)
        if op not in _UFUNCS:
            raise ValueError(f"ShmAllreduceBackend: op must be one of {SUPPORTED_OPS}, got {op!r}")
        if not (dtype in SUPPORTED_DTYPES or (op == "sum" and dtype in _COMPLEX)):
            raise TypeError(f"ShmAllreduceBackend: dtype {dtype} is not supported for op {op!r}")
        return dtype

    def _ensure_capacity(self, nbytes: int) -> None:
        if nbytes <= self._capacity and self._window is not None:
            return
        assert self.layout is not None
        cap = max(_INITIAL, self._capacity)
        while cap < nbytes:
            cap *= 2
        cap = min(cap, max(self.max_bytes, PAGE_SIZE))
        cap = (max(cap, nbytes) + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        self._views.clear()
        self._plans.clear()
        if self._sync is not None:
            self._sync.free()
            self._sync = None
        if self._window is not None:
            self._window.free()
            self._window = None
        buckets = 2 if self.direct_max_bytes >= 0 else 1  # without one-synchronisation reduces, one bucket
        self._window = SharedWindow(self.layout.node_comm, buckets * cap)
        names = self.layout.node_comm.allgather(self.layout.comm.Get_rank())
        kw = {"timeout": self.timeout_seconds, "rank_names": names, "spin": self.spin, "yields": self.yields}
        kw = kw if self.sync_kind == "counter" else {}
        self._sync = make_sync(self._window, self.sync_kind, **kw)
        self._capacity = cap
        self._bucket = 0

    def _wait(self, req: MPI.Request) -> None:
        """Complete the cross-node request, spinning, yielding, then sleeping (polling.pause; MPI's own wait
        never yields)."""
        polls = 0
        deadline = None
        while not req.Test():
            polls += 1
            if polls > self.spin:
                pause(polls, self.spin, self.yields)
                if self.timeout_seconds is not None and reads_clock(polls, self.spin, self.yields):
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_seconds
                    if now > deadline:
                        raise TimeoutError(
                            f"cross-node all-reduce of the node slice waited more than {self.timeout_seconds} s"
                        )

    def _typed(self, bucket: int, dtype: np.dtype) -> list[np.ndarray]:
        key = (bucket, dtype)
        views = self._views.get(key)
        if views is None:
            assert self._window is not None
            n = self._capacity // dtype.itemsize
            views = [self._window.view(r, dtype, bucket * self._capacity, n) for r in range(self._window.size)]
            self._views[key] = views
        return views

    def _bounds(self, count: int, itemsize: int) -> list[int]:
        q = max(1, _ALIGN // itemsize)
        units = -(-count // q)
        p = self.owners
        return [min(count, (units * i // p) * q) for i in range(p + 1)]

    def _make_plan(self, key: tuple[int, np.dtype, int]) -> ReducePlan:
        """The slices one reduce of ``count`` items of ``dtype`` in ``bucket`` touches (cached)."""
        assert self.layout is not None
        bucket, dtype, count = key
        lr = self.layout.local_rank
        tmp = None
        if lr >= 2 and self.layout.local_size > 2 and lr < self.owners:
            # Its own segment is read later in the summing order: accumulate aside.
            step = max(1, self.block_bytes // dtype.itemsize)
            tmp = self._tmp.get(dtype)
            if tmp is None or tmp.size < step:
                tmp = self._tmp[dtype] = np.empty(step, dtype)
        plan = make_plan(self._typed(bucket, dtype), self._bounds(count, dtype.itemsize), lr, self.owners,
                         self.layout.num_nodes == 1, self.block_bytes // dtype.itemsize, tmp)
        if len(self._plans) >= _PLAN_CACHE:
            self._plans.clear()
        self._plans[key] = plan
        return plan
