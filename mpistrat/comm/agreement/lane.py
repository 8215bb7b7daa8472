"""The compiled lane: a one-array all-reduce on one node in one C call, with its agreement round or after it.

A repeated one-array all-reduce whose check folds into a shared-memory transport's synchronisation (the
communicator's ``allreduce_repeat``; a repeated list's first array in ``allreduce_repeat_list``) runs, in
Python, the copy into shared memory, the guard's shared-memory round, its verdict and the reduction: ten
Python calls or more, each paying the cold-cache price after the data of the call before went through the
caches. :class:`CompiledLane` makes ``shm-small``'s call one ``_lane.run`` (``_lane.c``),
:class:`CompiledScatter` the ``shm`` window's reduce-scatter one ``_lane.scatter``; both keep the memory
protocol of :class:`~mpistrat.comm.agreement.shm_allgather.ShmAllgather` and of the transport, so they meet ranks
on the Python path in the same rounds. They combine data only after every rank posted this rank's
fingerprint and ``aux`` with no deadline passed; every other outcome (a rank later than the spin and 1
ms of yields, a mismatch, a deadline) goes back to the guard, which waits, judges and raises as always,
before any data is combined, and the transport's Python path finishes the call. :class:`StepScatter` is
the same reduce-scatter for a step reached once its call's check is done (a list's later arrays, an array
whose check was a round of its own): no round, and the transport's epochs as the Python path posts them.
The extension is optional: without it (no compiler at install) or with ``MPISTRAT_COMPILED_LANE=0``
every call takes the Python path.
"""

from __future__ import annotations

import abc
import time
from typing import Any

import numpy as np

from mpistrat.comm.agreement.call import FoldedCheck
from mpistrat.comm.agreement.guard import AgreementGuard
from mpistrat.comm.agreement.shm_allgather import ShmAllgather
from mpistrat.comm.transport.base import Transport
from mpistrat.comm.transport.shm.allreduce import ShmTransport
from mpistrat.comm.transport.shm.plan import ScatterLayout
from mpistrat.comm.transport.shm.results import MAX_BYTES as SHARED_RESULTS_MAX_BYTES
from mpistrat.comm.transport.shm.small import SmallShmTransport

try:
    from mpistrat.comm.agreement import _lane
except ImportError:  # built without a C compiler: the Python path
    _lane = None

__all__ = ["CompiledLane", "CompiledScatter", "FoldedLane", "StepScatter", "compiled_lane", "compiled_step"]

# (wire op, dtype) -> the kernel's kind: the ops whose every element the C loop computes bit for bit as
# NumPy's ufunc does (float MIN and MAX are left to NumPy: its NaN and signed-zero rules).
_KINDS: dict[tuple[str, np.dtype], int] = {} if _lane is None else {
    ("sum", np.dtype(np.float32)): _lane.KIND_SUM_F32,
    ("sum", np.dtype(np.float64)): _lane.KIND_SUM_F64,
    ("sum", np.dtype(np.int32)): _lane.KIND_SUM_I32,
    ("sum", np.dtype(np.int64)): _lane.KIND_SUM_I64,
    ("min", np.dtype(np.int32)): _lane.KIND_MIN_I32,
    ("min", np.dtype(np.int64)): _lane.KIND_MIN_I64,
    ("max", np.dtype(np.int32)): _lane.KIND_MAX_I32,
    ("max", np.dtype(np.int64)): _lane.KIND_MAX_I64,
}


def compiled_lane(enabled: bool, check: FoldedCheck, guard: AgreementGuard | None, transport: Transport,
                  prepared: Any, nbytes: int, dtype: np.dtype, op: str) -> "FoldedLane | None":
    """The lane of one plan (local), or None where it does not apply: the extension absent or ``enabled``
    False (``MPISTRAT_COMPILED_LANE``), a guard that does not gather in shared memory, a transport other
    than ``shm-small`` (:class:`CompiledLane`) or ``shm`` (:class:`CompiledScatter`), an empty array, or an
    op and dtype the kernel leaves to NumPy."""
    kind = _kind(enabled, guard, nbytes, dtype, op)
    if kind is None or guard is None or guard.gather is None:
        return None
    if isinstance(transport, SmallShmTransport):
        return CompiledLane(check, guard, guard.gather, transport, prepared, kind)
    if isinstance(transport, ShmTransport) and nbytes > transport.direct_max_bytes >= 0:  # it reduce-scatters
        return CompiledScatter(check, guard, guard.gather, transport, kind, op)
    return None


def compiled_step(enabled: bool, guard: AgreementGuard | None, transport: Transport, nbytes: int, dtype: np.dtype,
                  op: str) -> "StepScatter | None":
    """The compiled reduce-scatter of one plan step, a single host array, for calls whose check is done by
    the time the step runs (:class:`StepScatter`), or None where it does not apply: as :func:`compiled_lane`
    for ``shm``, and arrays above ``SHARED_RESULTS_MAX_BYTES``."""
    kind = _kind(enabled, guard, nbytes, dtype, op)
    if kind is None or guard is None or nbytes > SHARED_RESULTS_MAX_BYTES:
        # Above it the result is copied out of the window, not written into a shared result block, and the
        # kernel, which holds the GIL while it copies and sums, took longer than NumPy's path at 4 ranks on 2
        # cores (64 MiB: benchmarks/README.md, "A step after the check").
        return None
    if isinstance(transport, ShmTransport) and nbytes > transport.direct_max_bytes >= 0:
        return StepScatter(transport, kind, op, guard._spins)
    return None


def _kind(enabled: bool, guard: AgreementGuard | None, nbytes: int, dtype: np.dtype, op: str) -> int | None:
    """The kernels' KIND_* of a call, or None where no kernel applies: the extension absent or ``enabled``
    False, no guard, an empty array, or an op and dtype the kernels leave to NumPy."""
    if not enabled or guard is None or nbytes == 0:
        return None
    return _KINDS.get((op, np.dtype(dtype)))


class FoldedLane(abc.ABC):
    """One plan's repeated call whose copy, check round and sums run in one call of ``_lane`` (see the
    module's docstring); the transport's own Python path finishes what the kernel left.

    :meth:`__call__` takes over the check's bookkeeping (the guard's sequence number and open round, the
    gather's round) exactly where ``check_aux`` and ``ShmAllgather.exchange`` keep it, so the guard's
    waiting, verdicts, timeouts and stall reports apply unchanged to a round the kernel posted.
    """

    __slots__ = ("_check", "_guard", "_gather", "_transport", "_kind", "_key", "_h", "_timeout",
                 "_timeout_ms", "_aux", "_aux_values", "_table", "_mine", "_lines", "_items")

    def __init__(self, check: FoldedCheck, guard: AgreementGuard, gather: ShmAllgather, transport: Transport,
                 kind: int) -> None:
        self._check, self._guard, self._gather, self._transport, self._kind = check, guard, gather, transport, kind
        self._key, self._h, self._timeout, self._aux = check.signature()
        self._timeout = guard.effective_timeout(self._timeout)
        self._timeout_ms = int(self._timeout * 1000)
        self._aux_values = [self._aux] * guard.size
        self._table, self._mine, self._lines = gather.layout()
        self._items = gather._items  # this rank's round word tells whether a call that raised had posted

    @abc.abstractmethod
    def _ready(self, src: np.ndarray, dst: np.ndarray) -> Any:
        """What :meth:`_post` needs for this call, or None where the kernel cannot take it (nothing done)."""

    @abc.abstractmethod
    def _post(self, ready: Any, round_: int, mine: int, deadline: int, src: np.ndarray, dst: np.ndarray) -> Any:
        """The kernel's call: True (done), None (a peer late at the round), False (not the common verdict),
        NotImplemented (nothing done) or what :meth:`_after` finishes."""

    def _after(self, ready: Any, out: Any, src: np.ndarray, dst: np.ndarray) -> None:
        """Finish a call the kernel returned ``out`` for, the round passed: True or a kernel's own value."""

    @abc.abstractmethod
    def _finish(self, ready: Any, src: np.ndarray, dst: np.ndarray, synced: bool) -> None:
        """The transport's Python path from the check on, once the guard passed it (``synced``: every rank
        staged first)."""

    def _failed(self, ready: Any) -> None:
        """The call raised (before or after the kernel's post): retire what :meth:`_ready` offered."""

    def _declined(self, ready: Any, dst: np.ndarray) -> None:
        """The kernel posted nothing (NotImplemented): give back what :meth:`_ready` took for the Python path."""

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> bool:
        """Reduce ``src`` (C-contiguous, the plan's shape and dtype) into ``dst``; False, having done
        nothing, where a check is open on this guard or the kernel cannot take the call (the caller then
        takes the Python path)."""
        guard = self._guard
        gather = self._gather
        if guard._open is not None or not gather._done:
            return False
        ready = self._ready(src, dst)
        if ready is None:
            return False
        current = gather._round + 1
        mine = self._mine[current & 1]
        try:
            # AgreementGuard._opening and ShmAllgather.exchange's bookkeeping, with the plan's fingerprint
            # and timeout; only the calls below can raise, so both counters have moved when they do.
            gather._round = current
            guard.seq += 1
            arrival = int(time.time() * 1000)
            deadline = arrival + self._timeout_ms
            out = self._post(ready, current, mine, deadline, src, dst)
            if out is NotImplemented:
                gather._round = current - 1
                guard.seq -= 1
                self._declined(ready, dst)
                return False
        except BaseException as exc:
            self._failed(ready)
            if self._items[mine] != current:  # before the post (the kernel's errors, a signal): undo
                gather._round = current - 1
                guard.seq -= 1
                raise  # pending: the caller tells the peers (FoldedCheck.fail)
            # After the post (a signal handled as the kernel returned): the round is out, and this rank
            # cannot know whether its peers read it; as for an interrupted check, the guard is broken.
            self._check.pending = False
            guard._interrupted(self._key, exc)
            raise
        self._check.pending = False
        if out is not None and out is not False:  # every rank posted this call, in time: summed
            guard.aux_values = self._aux_values
            try:
                self._after(ready, out, src, dst)
            except BaseException:
                self._failed(ready)
                raise
            return True
        opened = (gather, self._key, self._timeout, self._h, arrival, deadline)
        try:
            if out is None:  # posted; a peer is later than the spin: the guard waits, judges (or raises)
                gather._next = 0
                gather._done = False
                guard._open = opened
                values = guard._complete(True, 0)
            else:  # every rank posted, but not all the same call in time: the guard's verdict (or its error)
                now = int(time.time() * 1000)
                values = guard._judge(gather.values(), opened, False, now, now, True)
        except BaseException as exc:
            self._failed(ready)
            # A verdict's errors leave the guard consistent; an interrupt before the round was judged does not.
            if guard._open is opened or (out is False and not isinstance(exc, Exception)):
                guard._interrupted(self._key, exc)
            raise
        try:
            self._finish(ready, src, dst, self._check.verdict(values))
        except BaseException:
            self._failed(ready)
            raise
        return True


class CompiledLane(FoldedLane):
    """``shm-small``'s call (copy into this rank's slot, the round, the sums of every slot) in one
    ``_lane.run``."""

    __slots__ = ("_prepared", "_slots", "_capacity")

    def __init__(self, check: FoldedCheck, guard: AgreementGuard, gather: ShmAllgather, transport: SmallShmTransport,
                 prepared: Any, kind: int) -> None:
        super().__init__(check, guard, gather, transport, kind)
        self._prepared = prepared
        self._slots = transport.slot_addresses(prepared)
        self._capacity = transport.max_bytes

    def _ready(self, src: np.ndarray, dst: np.ndarray) -> Any:
        return self._slots[self._transport.slot]

    def _post(self, ready: Any, round_: int, mine: int, deadline: int, src: np.ndarray, dst: np.ndarray) -> Any:
        return _lane.run(self._table, mine, round_, self._lines[round_ & 1], self._h, self._aux, deadline,
                         self._guard._spins, src, ready[0], ready[1], dst, self._kind, self._capacity)

    def _after(self, ready: Any, out: Any, src: np.ndarray, dst: np.ndarray) -> None:
        self._transport.slot ^= 1  # whoever sums a call's slots flips their parity (SmallShmTransport.slot)

    def _finish(self, ready: Any, src: np.ndarray, dst: np.ndarray, synced: bool) -> None:
        self._transport.finish_prepared(self._prepared, dst, synced)


class CompiledScatter(FoldedLane):
    """``shm``'s reduce-scatter of one array, or of a list's first (copy of the peers' slices into this rank's
    segment, the result blocks offered, the round, the sums of this rank's slice into the node's result block or
    with pushes, the second synchronisation, the copy out of a private result; chunk by chunk) in one
    ``_lane.scatter``, where nothing collective comes first (:meth:`ShmTransport.scatter_layout`)."""

    __slots__ = ("_op",)

    def __init__(self, check: FoldedCheck, guard: AgreementGuard, gather: ShmAllgather, transport: ShmTransport,
                 kind: int, op: str) -> None:
        super().__init__(check, guard, gather, transport, kind)
        self._op = op

    def _ready(self, src: np.ndarray, dst: np.ndarray) -> Any:
        transport = self._transport
        layout = transport.scatter_layout(dst.size, dst.dtype)
        if layout is None:
            return None
        return layout, _offer(layout, dst)

    def _post(self, ready: Any, round_: int, mine: int, deadline: int, src: np.ndarray, dst: np.ndarray) -> Any:
        layout, offer = ready
        check = (self._table, mine, round_, self._lines[round_ & 1], self._h, self._aux, deadline)
        return _scatter(self._transport, layout, offer, check, self._guard._spins, src, dst, self._kind)

    def _after(self, ready: Any, out: Any, src: np.ndarray, dst: np.ndarray) -> None:
        _scattered(self._transport, ready[0], out, src, dst, self._op, 0)

    def _finish(self, ready: Any, src: np.ndarray, dst: np.ndarray, synced: bool) -> None:
        self._transport.finish_scatter(ready[0], src, dst, self._op, 0, False, synced)

    def _failed(self, ready: Any) -> None:
        _scatter_failed(ready[0])

    def _declined(self, ready: Any, dst: np.ndarray) -> None:
        _reoffer(ready[0], ready[1], dst)


def _offer(layout: ScatterLayout, dst: np.ndarray) -> int:
    """The node's result blocks this rank offers for a call into ``dst`` (the pool's offer; 0 without blocks, or
    where the array ends in a one-synchronisation chunk, as ``ShmTransport.allreduce_array`` decides)."""
    shared = layout.shared
    return 0 if shared is None else shared.take_offer(dst, not layout.tail_one_sync)


def _reoffer(layout: ScatterLayout, offer: int, dst: np.ndarray) -> None:
    """Offer again what :func:`_offer` took, for the Python path, where the kernel posted nothing (nothing was
    handed out since: the same blocks are free)."""
    if layout.shared is not None:
        layout.shared.offer(offer, dst)


def _scatter(transport: ShmTransport, layout: ScatterLayout, offer: int, check: tuple, spins: int, src: np.ndarray,
             dst: np.ndarray, kind: int) -> Any:
    """``_lane.scatter`` of ``layout`` with the check's round (``check``: its table, mine, round, lines, h, aux
    and deadline) or without (``_no_round``)."""
    return _lane.scatter(*check, spins, src, dst, kind, layout.segments[transport._bucket], layout.itemsize,
                         layout.chunk, layout.direct, layout.me, layout.controls, layout.blocks, offer, layout.counters,
                         layout.words, layout.sync.epoch, layout.decision)


def _no_round(layout: ScatterLayout) -> tuple:
    """``_scatter``'s check for a call without the round: table 0; the lines only name the ranks (their count)."""
    return 0, 0, 0, layout.words, 0, 0, 0


def _scattered(transport: ShmTransport, layout: ScatterLayout, out: Any, src: np.ndarray, dst: np.ndarray, op: str,
               first: int) -> None:
    """Finish a ``_lane.scatter`` that returned ``out``, True (done) or ``2 * chunk + phase`` (that synchronisation
    posted, a peer late at it: the Python path goes on from there). ``first``: 1 where the kernel posted the first
    chunk's first synchronisation as an epoch (no round), else 0."""
    sync = layout.sync
    if out is True:
        sync.advance(layout.epochs + first)  # the epochs the kernel posted
        if layout.tail_one_sync:
            transport._bucket ^= 1  # as _sum_all flips it
        return
    chunk, pushed = divmod(out, 2)
    sync.advance(2 * chunk + pushed + first)
    sync.wait_posted()
    transport.finish_scatter(layout, src, dst, op, chunk, bool(pushed))


def _scatter_failed(layout: ScatterLayout) -> None:
    """After a ``_lane.scatter`` call that raised (before or after the kernel, or between it and
    :func:`_scattered`: a signal handled as it returned)."""
    layout.sync.resync()  # the epochs this rank posted, whether or not they were counted
    if layout.shared is not None:
        layout.shared.retire()  # a late owner may still write into it: never hand it out again


class StepScatter:
    """``shm``'s reduce-scatter of one array in one ``_lane.scatter``, without the check's round.

    For a step of an all-reduce whose check was done before it: a list's arrays after its first, or an
    array whose check was a round of its own. Its first synchronisation is an epoch, as the Python path's
    (``allreduce_array`` without a hook); a peer later than the kernel's spin and yields hands the rest to
    that path, which waits with its timeouts.
    """

    __slots__ = ("_transport", "_kind", "_op", "_spins")

    def __init__(self, transport: ShmTransport, kind: int, op: str, spins: int) -> None:
        self._transport, self._kind, self._op, self._spins = transport, kind, op, spins

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> bool:
        """Reduce ``src`` (C-contiguous) into ``dst`` (a new array, the same shape and dtype); False, having
        done nothing, where the kernel cannot take the call (the caller then calls ``allreduce_array``)."""
        transport = self._transport
        layout = transport.scatter_layout(dst.size, dst.dtype)
        if layout is None:
            return False
        offer = _offer(layout, dst)
        try:
            out = _scatter(transport, layout, offer, _no_round(layout), self._spins, src, dst, self._kind)
            if out is NotImplemented:
                _reoffer(layout, offer, dst)
                return False
            _scattered(transport, layout, out, src, dst, self._op, 1)
        except BaseException:
            _scatter_failed(layout)
            raise
        return True
