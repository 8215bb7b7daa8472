"""The shared-memory transport: all-reduce through a node-wide window, hierarchical across nodes.

:class:`ShmTransport` reduces the host buckets every rank of a node packs into its segment of one
shared window; across nodes, the ranks with the same local rank all-reduce their slices with MPI.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat import config, ops
from mpistrat.config import Settings
from mpistrat.comm.errors import allgather_checked
from mpistrat.comm.options import CommunicationImplementation
from mpistrat.comm.runtime.lifetime import group_key
from mpistrat.comm.runtime.shm_window import (
    PAGE_SIZE,
    CounterSync,
    NodeSync,
    SharedWindow,
    addresses,
    exiting_cleanly,
    make_sync,
)
from mpistrat.comm.runtime.topology import NodeLayout, Topology, resolve_pretend_nodes, topology as make_topology
from mpistrat.comm.transport.base import NO_AGREEMENT, AgreementHook, Transport, TransportContext
from mpistrat.comm.transport.buffers import GrowableBuffers
from mpistrat.comm.transport.shm import calibration
from mpistrat.comm.transport.shm.plan import ReducePlan, ScatterLayout, make_plan, one_sync_tail, sums_aside
from mpistrat.comm.transport.shm.results import SLOTS, ResultBlocks, SharedResults
from mpistrat.comm.transport.shm.settings import agree_settings, read_settings

__all__ = [
    "ShmTransport",
    "COMPLEX_DTYPES",
    "DIRECT_MAX_BYTES",
    "DIRECT_MAX_BYTES_FEW",
    "MIN_BYTES",
    "SUPPORTED_DTYPES",
    "one_sync_max_bytes",
]

SUPPORTED_DTYPES = frozenset(
    np.dtype(t)
    for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64")
)
_COMPLEX = frozenset(np.dtype(t) for t in ("complex64", "complex128"))  # sum only
COMPLEX_DTYPES = _COMPLEX

# The smallest bucket this path takes by default (MPISTRAT_SHM_MIN_BYTES=auto): below it MPI's own
# shared-memory all-reduce is as fast (benchmarks/README.md). A fixed rule, not a measurement: the
# choice decides the order in which values are summed, so it must not change with the machine's load.
MIN_BYTES = 16 << 10

_INITIAL = 1 << 20
# On one node, buckets up to this size take one synchronisation (every rank sums every segment);
# above it the reduce-scatter (two synchronisations, 1/n of the additions each).
DIRECT_MAX_BYTES = 64 << 10
# Where a node has few ranks for its cores: more ranks than cores, or two (one_sync_max_bytes).
DIRECT_MAX_BYTES_FEW = 256 << 10
_ALIGN = 64  # slice boundaries on cache lines
_PLAN_CACHE = 64  # reduce plans kept (one per bucket, dtype and count seen)


def one_sync_max_bytes(topology: Topology) -> int:
    """The largest bucket a node reduces with one synchronisation, every rank summing every segment.

    A rule on counts, the same on every rank of the node. Where the ranks outnumber the cores, a
    synchronisation costs a scheduler hand-over, more than the additions the reduce-scatter saves.
    With two ranks on the node, reading the other rank's whole segment moves as many bytes between
    the cores as the reduce-scatter does (the peer's slice copied in and read there, this rank's
    result pushed out), so the reduce-scatter saves only half the additions, which up to 256 KiB cost
    less than its second synchronisation (measured: benchmarks/README.md, "Two ranks, one
    synchronisation"). Both paths sum in local-rank order: the limit changes no bits.
    """
    if topology.oversubscribed or topology.layout.local_size == 2:
        return DIRECT_MAX_BYTES_FEW
    return DIRECT_MAX_BYTES


def _close_at_exit(ref: "weakref.ref[ShmTransport]") -> None:
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


class ShmTransport(Transport):
    """All-reduce of host buckets through a node shared-memory window (collective to create).

    The caller packs its data straight into this rank's segment of one shared
    window per node (:meth:`pack_buffer`), then :meth:`allreduce_packed`:

    1. synchronise the node (everyone has packed);
    2. reduce-scatter: node rank i sums slice i of the bucket across all the
       node's segments, in cache-sized blocks, always in local-rank order
       ``((s0 + s1) + s2) + ...`` (so every slice, on every path, is summed the
       same way), and writes it into slice i of its own segment;
    3. across nodes (hierarchical): node rank i all-reduces its slice with MPI
       over ``cross_comm`` (the ranks with the same local rank on every node),
       non-blocking, polled by the topology's waiter (MPI's blocking wait never
       yields); then (on one node, block by block right after step 2) node rank i
       pushes its reduced slice into slice i of every other rank's segment;
    4. synchronise the node again; every rank reads the whole result from its
       own segment.

    Push, don't pull: a cache line another core has only read must be
    invalidated there before this core writes it again, so every line of a
    segment is last written by the core that reads it next or read by the core
    that writes it next.

    Two synchronisations suffice with one bucket: a rank packs its segment for
    the next call only after this call's second synchronisation, which every
    rank reaches only after it has finished reading the segments; owners push
    into a segment only after the next call's first synchronisation. Results are
    therefore valid until the next ``pack_buffer``. Two buckets alternate only
    after a one-synchronisation reduce (on one node, buckets up to
    ``direct_max_bytes``: every rank sums all segments straight into its
    output, in the same order), where a fast rank may pack again while a slow
    one still reads every segment. Nodes of different sizes work too: slices are
    owned by the first P local ranks of each node, P the smallest node's size.

    :meth:`allreduce_array` reduces one contiguous array without caller-side packing,
    chunk by chunk above ``chunk_bytes`` so each chunk stays in cache, and writes
    results straight into the node's shared result blocks (``result_blocks``,
    :mod:`~mpistrat.comm.transport.shm.results`) where every rank offered one. The window
    grows collectively (to the next power of two, at most ``max_bytes`` per bucket)
    inside ``pack_buffer``; larger buckets are not enabled.

    ``topology``: the communicator's split (made here, and freed by ``close``,
    when not given); ``pretend_nodes`` cuts the ranks into pretend nodes then.
    ``min_bytes`` (``MPISTRAT_SHM_MIN_BYTES``) defaults to a rule, :data:`MIN_BYTES`;
    ``min_bytes=0`` enables it for every size (what forcing it means).
    ``timeout_seconds`` bounds every wait. Keyword arguments override the
    ``MPISTRAT_SHM_*`` settings (``settings``, default ``config.settings()``); the ranks agree on
    the result.
    """

    name = "shm"
    folds_agreement = True

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        topology: Topology | None = None,
        pretend_nodes: int | None = None,
        min_bytes: int | str | None = None,
        max_bytes: int | None = None,
        block_bytes: int | None = None,
        chunk_bytes: int | str | None = None,
        sync: str | None = None,
        timeout_seconds: float | None = None,
        settings: Settings | None = None,
    ) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        error = None
        mine = None
        try:  # every per-rank check before the first collective, so a bad value on one rank cannot hang the rest
            if topology is None:
                pretend_nodes = resolve_pretend_nodes(comm.Get_size(), pretend_nodes)
            mine = read_settings(max_bytes, block_bytes, chunk_bytes, min_bytes, sync, settings)
        except (ValueError, TypeError) as exc:
            error = exc
        # What every rank uses: ranks whose settings differ would take different paths and never meet.
        agreed = agree_settings(allgather_checked(comm, mine, error, "ShmTransport"))
        self.max_bytes, self.block_bytes, self.sync_kind = agreed.max_bytes, agreed.block_bytes, agreed.sync
        self._owns_topology = topology is None
        self.topology: Topology | None = make_topology(comm, pretend_nodes) if topology is None else topology
        self.layout: NodeLayout | None = self.topology.layout
        lay = self.layout
        # Slice owners: local ranks [0, P) of every node, P the smallest node. The default chunk, sized to
        # the last-level cache that the machine's ranks share (pretend nodes included:
        # config.node_chunk_bytes); none where a machine's ranks outnumber its cores, since each chunk's two
        # synchronisations cost scheduler hand-overs there, more than the cache saves (4 ranks on 2 cores:
        # one pass 2x faster at 4-16 MiB, benchmarks/README.md). Rules on counts and sizes, the smallest
        # over the ranks (agreed with the owners in one reduction), never a timing; on one or two nodes
        # chunks never change the order of a sum (see _chunk_items). ``auto`` times the node's chunk
        # against one pass, where ranks outnumber cores too.
        node_chunk = config.node_chunk_bytes(self.topology.machine_size)
        proposed = np.array([lay.local_size, 0 if self.topology.oversubscribed else node_chunk, node_chunk],
                            np.int64)
        lay.comm.Allreduce(MPI.IN_PLACE, proposed, op=MPI.MIN)
        self.owners, self.default_chunk_bytes, self.auto_chunk_bytes = (int(v) for v in proposed)
        self.waiter = self.topology.waiter
        direct = one_sync_max_bytes(self.topology)
        pushes = lay.num_nodes == 1 and lay.local_size > 1  # owners push results into every segment
        self._pushes = pushes
        self.direct_max_bytes = direct if pushes else -1
        # allreduce_array's results in shared memory, written by the owners (results.py).
        self.result_blocks = ResultBlocks(lay.node_comm, pushes, self.direct_max_bytes, SLOTS * self.max_bytes)
        self.chunk_bytes: int | None = None  # None: measured at the first long array (_set_chunk_bytes)
        # (bytes reduced, chunk bytes, one pass s, chunked s)
        self.chunk_calibration: list[tuple[int, int, float, float]] = []
        self.timeout_seconds = timeout_seconds
        self._window: SharedWindow | None = None
        self._sync: NodeSync | None = None
        self._capacity = 0  # bytes per bucket per rank
        self._views: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        # Per (count, dtype) seen: this rank's staging view and every segment's, for both buckets (the
        # hot path slices nothing); cleared with the views when the window grows.
        self._staging: dict[tuple[int, Any], tuple[tuple[np.ndarray, np.dtype], ...]] = {}
        self._segments: dict[tuple[int, np.dtype], tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._slices: dict[tuple[int, int], tuple[int, int]] = {}  # _own_slice's answers
        self._tmp: dict[np.dtype, np.ndarray] = {}
        self._scratch = GrowableBuffers(lambda n, dt: np.empty(n, dtype=dt))
        self._plans: dict[tuple[int, np.dtype, int], ReducePlan] = {}
        self._layouts: dict[tuple[int, np.dtype], ScatterLayout] = {}  # scatter_layout's answers
        self._bucket = 0
        self._pending: tuple[int, np.dtype] | None = None
        self._win_sync: Any = None  # the window's Win.Sync, bound
        self._closed = False
        if agreed.min_bytes is not None:
            self.min_bytes = agreed.min_bytes
        elif self.owners < 2:
            self.min_bytes = self.max_bytes + 1  # one rank per node: nothing to share, plain MPI
        else:
            self.min_bytes = MIN_BYTES
        self._one_pass_max = self.direct_max_bytes  # see _set_chunk_bytes
        self._set_chunk_bytes(self.default_chunk_bytes if agreed.chunk_default else agreed.chunk_bytes)
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def create(cls, ctx: TransportContext) -> "ShmTransport | None":
        """The transport-table factory: None where no bucket could take this path (one rank per node)."""
        forced = ctx.options.implementation == CommunicationImplementation.SHM
        transport = cls(ctx.comm, topology=ctx.topology, min_bytes=0 if forced else None,
                        timeout_seconds=ctx.timeout, settings=ctx.settings)
        if not forced and transport.min_bytes > transport.max_bytes:
            transport.close()
            return None
        return transport

    def describe(self) -> dict[str, Any]:
        """The name, the sizes the ranks agreed on, and the synchronisation."""
        return {"name": self.name, "min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
                "direct_max_bytes": self.direct_max_bytes, "block_bytes": self.block_bytes,
                "chunk_bytes": "measured at the first long array" if self.chunk_bytes is None else self.chunk_bytes,
                "sync": self.sync_kind}

    # -- the transport contract ------------------------------------------------
    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Whether this transport takes a bucket of ``nbytes`` of ``dtype`` with wire op ``op``."""
        if self._closed or not (self.min_bytes <= nbytes <= self.max_bytes):
            return False
        dtype = np.dtype(dtype)
        wire = ops.WIRE_OPS.get(op)
        return wire is not None and (dtype in SUPPORTED_DTYPES or (wire.complex_ok and dtype in _COMPLEX))

    def pack_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A 1-D view of ``count`` items in this rank's segment, to pack into."""
        staged = self._staging.get((count, dtype))
        if staged is not None:  # seen before: checked, and the window holds it
            view, self._pending = staged[self._bucket]
            return view
        dtype = self._check_dtype(dtype, "sum")
        count = int(count)
        nbytes = count * dtype.itemsize
        if count < 0 or nbytes > self.max_bytes:
            raise ValueError(
                f"ShmTransport.pack_buffer: {count} x {dtype} = {nbytes} bytes is outside "
                f"[0, max_bytes={self.max_bytes}]; split the bucket or use plain MPI"
            )
        self._ensure_capacity(nbytes)
        lr = self._local_rank()
        buckets = (0, 1) if self.direct_max_bytes >= 0 else (0, 0)  # a window of one bucket: see _ensure_capacity
        staged = tuple((self._typed(b, dtype)[lr][:count], (count, dtype)) for b in buckets)
        if len(self._staging) >= _PLAN_CACHE:
            self._staging.clear()
        self._staging[(count, dtype)] = staged
        view, self._pending = staged[self._bucket]
        return view

    def allreduce_packed(
        self, count: int, dtype: np.dtype, op: str, hook: AgreementHook = NO_AGREEMENT, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Reduce what every rank packed into ``out`` (1-D, private memory), or, when None, into
        memory this transport owns (valid until the next ``pack_buffer``); returns it.

        Up to ``direct_max_bytes``: one synchronisation, then each rank sums every segment into
        the result. Otherwise the reduce-scatter (class docstring), whose result is this rank's own
        segment (copied into ``out`` when given), or, where every rank offered one with its ``out``, one
        of this size's shared result blocks (``result_blocks``: the owners write into it; its
        ``chosen`` says which, and ``out`` is left alone). The path (one synchronisation or the
        reduce-scatter) depends only on the size, which every rank agreed on, never on ``out`` or the
        offers, which ranks may choose differently.
        """
        ufunc, dtype = self._take_pending(count, dtype, op, "allreduce_packed")
        if count * dtype.itemsize <= self.direct_max_bytes:
            synced = self._staged(hook)
            result = self._scratch.get(count, dtype) if out is None else out
            self._sum_all(count, dtype, ufunc, result, synced)
            return result
        if self.result_blocks.may_share(count, dtype):  # made at this size's first call, after the check
            hook.staged(first=False)
            hook = NO_AGREEMENT
        shared = self.result_blocks.make(count, dtype)  # collective only where it makes them
        if shared is not None:  # before the first synchronisation: every rank's offer, every call
            shared.publish(0 if out is None else shared.take_offer(out))
        try:
            synced = self._staged(hook)
            reduced = self._reduce_scatter(count, dtype, ufunc, op, synced=synced, shared=shared,
                                           into=out if shared is None else None)
        except BaseException:
            if shared is not None:
                shared.retire()  # a late owner may still write into it: never hand it out again
            raise
        if out is None:
            return reduced
        if shared is None:
            self._copy_others(reduced, out, count, dtype.itemsize)
        elif shared.chosen < 0:
            np.copyto(out, reduced)
        return out  # else the owners wrote the result into the shared block chosen

    def _sum_all(self, count: int, dtype: np.dtype, ufunc: np.ufunc, out: np.ndarray, synced: bool) -> None:
        """The one-synchronisation reduce: every rank sums every segment into ``out``."""
        if count == 0:
            return
        segments = self._segments.get((count, dtype))
        if segments is None:
            segments = self._segments[(count, dtype)] = tuple(
                [v[:count] for v in self._typed(b, dtype)] for b in (0, 1))
        assert self._sync is not None
        if not synced:
            self._sync.wait()
        views = segments[self._bucket]
        ufunc(views[0], views[1], out=out)  # local-rank order, the reduce-scatter's: the same bits
        for view in views[2:]:
            ufunc(out, view, out=out)
        # No second synchronisation: a rank packs this bucket again at the earliest two calls
        # later, with at least one synchronisation between, which every rank reaches only once
        # it has finished reading here (two-synchronisation calls stay on the other bucket).
        self._bucket ^= 1

    def _reduce_scatter(
        self, count: int, dtype: np.dtype, ufunc: np.ufunc, op: str, own: np.ndarray | None = None,
        synced: bool = False, shared: SharedResults | None = None, offset: int = 0,
        into: np.ndarray | None = None,
    ) -> np.ndarray:
        """Steps 1-4 of the class docstring; a view of this rank's segment, the result unless the call took a
        shared block (``shared``). ``own``: this
        rank's data in private memory, read for its own slice instead of its segment (which then need
        not hold it). ``synced``: step 1's synchronisation already happened (the agreement check stood
        for it). ``shared`` (on one node): the node's result blocks; where every rank offered one
        (:meth:`SharedResults.decide`), the owners write their slices into it from item ``offset``, and
        push nothing. ``into`` (private
        memory, on one node, without ``shared``): this rank's slice of the result is summed straight into
        it instead of the segment (whose slice then holds nothing: :meth:`_copy_others` copies the rest),
        so the slice is written once instead of written, read and written again."""
        key = (self._bucket, dtype, count)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(key)
        if count == 0:
            return plan.result
        sync = self._sync
        assert sync is not None
        if not synced:
            sync.wait()
        lr = self._local_rank()
        copyto = np.copyto
        result = shared.decide() if shared is not None else None
        if result is not None or not self._pushes:  # one node: see _copy_others
            into = None
        for srcs, dst, back, targets, start, end in plan.blocks:
            if own is not None:
                srcs = srcs[:lr] + (own[start:end],) + srcs[lr + 1 :]
            if result is not None:  # the node's result: written once, pushed nowhere
                dst, back, targets = result[offset + start : offset + end], None, ()
            elif into is not None:
                if back is None:
                    dst = into[start:end]
                else:  # summed aside: own is read late in the order, and may be into (in place)
                    back = into[start:end]
            ufunc(srcs[0], srcs[1], out=dst)
            for src in srcs[2:]:
                ufunc(dst, src, out=dst)
            if back is not None:
                back[...] = dst
            for target in targets:  # step 3 on one node: while the block is in cache
                copyto(target, dst)
        if plan.cross is not None:
            assert self.layout is not None
            self._wait(self.layout.cross_comm.Iallreduce(MPI.IN_PLACE, plan.cross, op=ops.mpi_op(op)))
            for target in plan.cross_targets:
                copyto(target, plan.cross)
        sync.wait()  # the same bucket next time: every rank has read the segments (class docstring)
        return plan.result

    def allreduce_array(
        self, src: np.ndarray | MPI.BottomType, dst: np.ndarray, op: str, hook: AgreementHook = NO_AGREEMENT
    ) -> None:
        """Reduce one C-contiguous array into ``dst`` (``src`` may be ``MPI.IN_PLACE``; collective).

        Up to ``direct_max_bytes``: copied into this rank's segment, then every rank sums every
        segment. Above: the reduce-scatter, with only the slices the other ranks sum copied into
        the segment (this rank's own slice is read from ``src``), then the result copied into
        ``dst``, or written by the owners into the node's result block every rank offered with its ``dst``
        (``result_blocks``; ``dst`` is then left alone). With
        ``chunk_bytes`` set, longer arrays go chunk by chunk, so each chunk stays in cache between
        its passes, at two synchronisations per chunk. The hook is told once this rank's (first
        chunk's) data is in its segment, or before staging when the window must grow or chunks be
        measured first (both collective).
        """
        out = dst.reshape(-1)
        source = out if src is MPI.IN_PLACE else src.reshape(-1)
        count, dtype = out.shape[0], out.dtype
        if count * dtype.itemsize <= self._one_pass_max and (count, dtype) in self._segments:
            # Reduced before at this size: one pass, one synchronisation, no shared result blocks.
            if hook is not NO_AGREEMENT and not self._staged_without_collectives(count, dtype):
                hook.staged(first=False)
                hook = NO_AGREEMENT
            self._allreduce_contiguous(source, out, op, hook)
            return
        if hook is not NO_AGREEMENT and not self._staged_without_collectives(count, dtype):
            hook.staged(first=False)
            hook = NO_AGREEMENT
        shared = self.result_blocks.make(count, dtype)
        chunk = self._chunk_items(count, dtype)
        if shared is not None:  # in place: dst is the source, never a shared result
            usable = src is not MPI.IN_PLACE and not one_sync_tail(count, dtype.itemsize, chunk,
                                                                   self.direct_max_bytes)
            shared.publish(shared.take_offer(dst, usable))
        try:
            self.reduce_in_chunks(source, out, op, chunk, hook, shared)
        except BaseException:
            if shared is not None:
                shared.retire()  # a late owner may still write into it: never hand it out again
            raise

    def scatter_layout(self, count: int, dtype: np.dtype) -> ScatterLayout | None:
        """What the compiled reduce-scatter (``_lane.scatter``, agreement/lane.py) of a repeated
        :meth:`allreduce_array` of ``count`` items of ``dtype`` reads, or None where that call takes
        another path: not the reduce-scatter of one node, a collective before staging (the window to
        grow, chunks to measure, result blocks to make), or the barrier synchronisation."""
        key = (count, dtype)
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        if (not self._pushes or not isinstance(self._sync, CounterSync)
                or count * dtype.itemsize <= self.direct_max_bytes or not self._staged_without_collectives(count, dtype)):
            return None
        chunk = self.chunk_bytes // dtype.itemsize if self.chunk_bytes else 0  # reduce_in_chunks's chunks
        if 0 < chunk < count and chunk * dtype.itemsize <= self.direct_max_bytes:
            return None  # every chunk in one synchronisation: the Python path
        segments = (addresses(self._typed(0, dtype)), addresses(self._typed(1, dtype)))
        layout = ScatterLayout(segments, self._local_rank(), count, dtype.itemsize, chunk, self.direct_max_bytes,
                               self.result_blocks.shared_results(count, dtype), self._sync)
        if len(self._layouts) >= _PLAN_CACHE:
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def finish_scatter(self, layout: ScatterLayout, src: np.ndarray, dst: np.ndarray, op: str, chunk: int,
                       pushed: bool, synced: bool = True) -> None:
        """The rest of a reduce-scatter that ``_lane.scatter`` ran up to a synchronisation of chunk ``chunk``
        (an index), every rank having passed it: its first (the check's for chunk 0; ``synced``: every
        rank's first synchronisation), whose sums and pushes come next, or its second (``pushed``), after
        which only a private result's copy out is left. Then the later chunks, as :meth:`allreduce_array`."""
        out, source = dst.reshape(-1), src.reshape(-1)
        count, dtype = out.shape[0], out.dtype
        step = layout.chunk_items
        shared = layout.shared
        start, end = chunk * step, min(chunk * step + step, count)
        if pushed:
            if shared is None or shared.chosen < 0:  # this rank's slice is in out already
                segment = self._typed(self._bucket, dtype)[self._local_rank()]
                self._copy_others(segment[: end - start], out[start:end], end - start, dtype.itemsize)
        else:
            if synced:
                self._win_sync()  # the peers' stores before our loads
            ufunc = ops.WIRE_OPS[op].ufunc
            if (end - start) * dtype.itemsize <= self.direct_max_bytes:  # a short last chunk: one synchronisation
                self._sum_all(end - start, dtype, ufunc, out[start:end], synced)
            else:
                self._reduce_chunk(source[start:end], out[start:end], ufunc, op, synced, shared, start)
        for start in range(end, count, step):
            self._allreduce_contiguous(source[start : start + step], out[start : start + step], op, NO_AGREEMENT,
                                       shared, start)

    def _staged_without_collectives(self, count: int, dtype: np.dtype) -> bool:
        """Whether ``allreduce_array`` of ``count`` items stages its data before any collective call
        (neither growing the window nor measuring chunks first)."""
        nbytes = count * dtype.itemsize
        if nbytes <= self._one_pass_max and (count, dtype) in self._segments:
            return True  # reduced before in one pass: the window holds it
        measuring = self.chunk_bytes is None and nbytes >= calibration.CHUNK_MEASURE_MIN
        if self.chunk_bytes:  # staged chunk by chunk: the window needs to hold one chunk
            nbytes = min(nbytes, self.chunk_bytes // dtype.itemsize * dtype.itemsize)
        return (self._window is not None and nbytes <= self._capacity and not measuring
                and not self.result_blocks.may_share(count, dtype))

    def reduce_in_chunks(
        self, source: np.ndarray, out: np.ndarray, op: str, chunk: int, hook: AgreementHook = NO_AGREEMENT,
        shared: SharedResults | None = None,
    ) -> None:
        """``out = reduce(source)`` of 1-D arrays, ``chunk`` items at a time (0: in one pass; collective).
        ``hook``: told once the first chunk is staged. ``shared``: the node's result blocks, offered for this
        call (``out`` then stays as it was where the call decides on one of them)."""
        if 0 < chunk < out.shape[0]:  # the same count and dtype on every rank: the same chunks
            for start in range(0, out.shape[0], chunk):
                end = start + chunk
                self._allreduce_contiguous(source[start:end], out[start:end], op, hook, shared, start)
                hook = NO_AGREEMENT
            return
        self._allreduce_contiguous(source, out, op, hook, shared)

    def _chunk_items(self, count: int, dtype: np.dtype) -> int:
        """Items per chunk for an array of ``count`` (0: one pass). When ``chunk_bytes`` was left to
        measurement, the first array of at least ``CHUNK_MEASURE_MIN`` bytes decides it, the node's
        chunk or none (collective: every rank reduces the same array; the communicator sends every
        rank's single arrays here, whatever their memory layout). On one node, or two, chunks never
        change the order in which values are summed; across three nodes or more they cut the slices
        MPI reduces across nodes, and MPI may choose its algorithm, so the order, by message size:
        there ``auto`` takes the default chunk, never a measurement, so a program gives the same bits
        on an idle machine and a loaded one."""
        if self.chunk_bytes is None:
            if self._closed or count * dtype.itemsize < calibration.CHUNK_MEASURE_MIN:
                return 0
            assert self.layout is not None
            lay = self.layout
            if lay.num_nodes >= 3:
                self._set_chunk_bytes(self.default_chunk_bytes)
                return self.chunk_bytes // dtype.itemsize
            key = (group_key(lay.comm), lay.num_nodes, lay.local_size, self.owners, self.sync_kind,
                   self.max_bytes, self.auto_chunk_bytes)
            chunk_bytes, self.chunk_calibration = calibration.measure_chunks(
                lay.comm, key, lambda src, dst, chunk: self.reduce_in_chunks(src, dst, "sum", chunk), count, dtype,
                self.auto_chunk_bytes, self.max_bytes)
            self._set_chunk_bytes(chunk_bytes)
        return self.chunk_bytes // dtype.itemsize

    def _allreduce_contiguous(
        self, source: np.ndarray, out: np.ndarray, op: str, hook: AgreementHook = NO_AGREEMENT,
        shared: SharedResults | None = None, offset: int = 0,
    ) -> None:
        """:meth:`allreduce_array` of one 1-D array or chunk (``source`` may be ``out``), items
        ``offset`` on of the call's ``shared`` result blocks (see reduce_in_chunks)."""
        count, dtype = out.shape[0], out.dtype
        buf = self.pack_buffer(count, dtype)
        if count * dtype.itemsize <= self.direct_max_bytes:
            np.copyto(buf, source)
            ufunc, dtype = self._take_pending(count, dtype, op, "allreduce_array")
            self._sum_all(count, dtype, ufunc, out, self._staged(hook))
            return
        lo, hi = self._own_slice(count, dtype.itemsize)
        np.copyto(buf[:lo], source[:lo])
        np.copyto(buf[hi:], source[hi:])
        synced = self._staged(hook)
        ufunc, dtype = self._take_pending(count, dtype, op, "allreduce_array")
        self._reduce_chunk(source, out, ufunc, op, synced, shared, offset)

    def _reduce_chunk(self, source: np.ndarray, out: np.ndarray, ufunc: np.ufunc, op: str, synced: bool,
                      shared: SharedResults | None, offset: int) -> None:
        """The rest of :meth:`_allreduce_contiguous` once the chunk is staged (``synced``: the check stood
        for the first synchronisation): the reduce-scatter and, for a private result, the copy out."""
        count, dtype = out.shape[0], out.dtype
        reduced = self._reduce_scatter(count, dtype, ufunc, op, source, synced, shared, offset,
                                       into=out if shared is None else None)
        if shared is None:
            self._copy_others(reduced, out, count, dtype.itemsize)
        elif shared.chosen < 0:
            np.copyto(out, reduced)
        # else the owners wrote the result into the node's block

    def _staged(self, hook: AgreementHook) -> bool:
        """Tell ``hook`` this rank's data is in its segment; whether the agreement check synchronised
        the node (every rank had staged), so the next synchronisation is skipped."""
        if hook is NO_AGREEMENT:
            return False
        sync = self._win_sync
        sync()  # our stores to the segment before the check's (shared-memory) announcement
        if hook.staged():
            sync()  # and the peers' stores before our loads
            return True
        return False

    def _copy_others(self, reduced: np.ndarray, out: np.ndarray, count: int, itemsize: int) -> None:
        """Copy the reduce-scatter's result from this rank's segment (``reduced``) into ``out``, but for
        this rank's own slice where the reduce-scatter summed it into ``out`` already (``into``: one node)."""
        lo, hi = self._own_slice(count, itemsize) if self._pushes else (0, 0)
        if lo < hi:
            np.copyto(out[:lo], reduced[:lo])
            np.copyto(out[hi:], reduced[hi:])
        else:
            np.copyto(out, reduced)

    def _set_chunk_bytes(self, chunk_bytes: int | None) -> None:
        """Set ``chunk_bytes``, and the largest array reduced in one pass with one synchronisation."""
        self.chunk_bytes = chunk_bytes
        self._layouts.clear()  # they cut the chunks as reduce_in_chunks did
        one_pass = self.direct_max_bytes
        self._one_pass_max = min(one_pass, chunk_bytes) if chunk_bytes else one_pass

    def _own_slice(self, count: int, itemsize: int) -> tuple[int, int]:
        """The items ``[lo, hi)`` this rank sums in the reduce-scatter (empty when it owns
        none, or is alone on its node: then its segment is the slice, summed with nothing)."""
        got = self._slices.get((count, itemsize))
        if got is not None:
            return got
        lr = self._local_rank()
        assert self.layout is not None
        if lr >= self.owners or self.layout.local_size < 2:
            got = (0, 0)
        else:
            bounds = self._bounds(count, itemsize)
            got = (bounds[lr], bounds[lr + 1])
        if len(self._slices) >= _PLAN_CACHE:
            self._slices.clear()
        self._slices[(count, itemsize)] = got
        return got

    def _take_pending(self, count: int, dtype: np.dtype, op: str, what: str) -> tuple[np.ufunc, np.dtype]:
        """Check that ``pack_buffer(count, dtype)`` came first and ``op`` fits; the ufunc and dtype."""
        pending = self._pending
        if pending is None or pending[0] != count or pending[1] != dtype:
            raise RuntimeError(
                f"ShmTransport.{what}({count}, {dtype}) must follow pack_buffer with the same "
                f"count and dtype (pending: {pending})"
            )
        wire = ops.WIRE_OPS.get(op)
        if wire is None:
            raise ValueError(f"ShmTransport: op must be one of {tuple(ops.WIRE_OPS)}, got {op!r}")
        ufunc = wire.ufunc
        dtype = pending[1]
        if not wire.complex_ok and dtype in _COMPLEX:
            raise TypeError(f"ShmTransport: dtype {dtype} is not supported for op {op!r}")
        self._pending = None
        return ufunc, dtype

    def close(self) -> None:
        """Free the window and communicators (collective over ``comm``; idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        self._staging.clear()
        self._segments.clear()
        self._plans.clear()
        self._layouts.clear()
        self._tmp.clear()
        self._pending = None
        self.result_blocks.free()
        self._free_window()
        if self.topology is not None and self._owns_topology:
            self.topology.free()
        self.topology = self.layout = None

    # -- internals ----------------------------------------------------------
    def _local_rank(self) -> int:
        if self.layout is None:
            raise RuntimeError("ShmTransport is closed")
        return self.layout.local_rank

    def _check_dtype(self, dtype: np.dtype, op: str) -> np.dtype:
        if self._closed:
            raise RuntimeError("ShmTransport is closed: its shared window is freed")
        dtype = np.dtype(dtype)
        if op not in ops.WIRE_OPS:
            raise ValueError(f"ShmTransport: op must be one of {tuple(ops.WIRE_OPS)}, got {op!r}")
        if not (dtype in SUPPORTED_DTYPES or (ops.WIRE_OPS[op].complex_ok and dtype in _COMPLEX)):
            raise TypeError(f"ShmTransport: dtype {dtype} is not supported for op {op!r}")
        return dtype

    def _free_window(self) -> None:
        """Free the node synchronisation and the window (collective over the node)."""
        if self._sync is not None:
            self._sync.free()
            self._sync = None
        if self._window is not None:
            self._window.free()
            self._window = self._win_sync = None

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
        self._staging.clear()
        self._segments.clear()
        self._plans.clear()
        self._layouts.clear()
        self._free_window()
        buckets = 2 if self.direct_max_bytes >= 0 else 1  # without one-synchronisation reduces, one bucket
        self._window = SharedWindow(self.layout.node_comm, buckets * cap)
        self._win_sync = self._window.win.Sync
        names = self.layout.node_comm.allgather(self.layout.comm.Get_rank())
        kw = {"timeout": self.timeout_seconds, "rank_names": names, "waiter": self.waiter}
        kw = kw if self.sync_kind == "counter" else {}
        self._sync = make_sync(self._window, self.sync_kind, **kw)
        self._capacity = cap
        self._bucket = 0

    def _wait(self, req: MPI.Request) -> None:
        """Complete the cross-node request with the topology's waiter (MPI's own wait never yields)."""
        if not self.waiter.until(req.Test, self.timeout_seconds):
            raise TimeoutError(f"cross-node all-reduce of the node slice waited more than {self.timeout_seconds} s")

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
        if sums_aside(self.layout.local_size, lr, self.owners):
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
