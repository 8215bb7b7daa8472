"""The compiled lane: a repeated small all-reduce's copy, agreement round and sums in one C call.

A repeated one-array all-reduce whose check folds into ``shm-small``'s synchronisation (the
communicator's ``allreduce_repeat``) runs, in Python, the copy into this rank's slot, the guard's
shared-memory round, its verdict and the sums: about ten Python calls, each paying the cold-cache
price after the data of the call before went through the caches. :class:`CompiledLane` makes that
one call of ``_lane.run`` (``_lane.c``), which keeps the same memory protocol as
:class:`~mpistrat.comm.agreement.shm_allgather.ShmAllgather` and the transport, so it meets ranks on
the Python path in the same round. It sums only after every rank posted this rank's fingerprint and
``aux`` with no deadline passed; every other outcome (a rank later than the spin and 1 ms of yields, a mismatch, a
deadline) goes back to the guard, which waits, judges and raises as always, before any data is
combined. The extension is optional: without it (no compiler at install) or with
``MPISTRAT_COMPILED_LANE=0`` every call takes the Python path.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from mpistrat.comm.agreement.call import FoldedCheck
from mpistrat.comm.agreement.guard import AgreementGuard
from mpistrat.comm.agreement.shm_allgather import ShmAllgather
from mpistrat.comm.transport.base import Transport
from mpistrat.comm.transport.shm.small import SmallShmTransport

try:
    from mpistrat.comm.agreement import _lane
except ImportError:  # built without a C compiler: the Python path
    _lane = None

__all__ = ["CompiledLane", "compiled_lane"]

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
                  prepared: Any, nbytes: int, dtype: np.dtype, op: str) -> "CompiledLane | None":
    """The lane of one plan (local), or None where it does not apply: the extension absent or ``enabled``
    False (``MPISTRAT_COMPILED_LANE``), a guard that does not gather in shared memory, a transport other
    than ``shm-small``, an empty array, or an op and dtype the kernel leaves to NumPy."""
    kind = _KINDS.get((op, np.dtype(dtype)))
    if (not enabled or kind is None or nbytes == 0 or guard is None or guard.gather is None
            or not isinstance(transport, SmallShmTransport)):
        return None
    return CompiledLane(check, guard, guard.gather, transport, prepared, kind)


class CompiledLane:
    """One plan's repeated call in one ``_lane.run`` (see the module's docstring).

    :meth:`__call__` takes over the check's bookkeeping (the guard's sequence number and open round, the
    gather's round) exactly where ``check_aux`` and ``ShmAllgather.exchange`` keep it, so the guard's
    waiting, verdicts, timeouts and stall reports apply unchanged to a round the lane posted.
    """

    __slots__ = ("_check", "_guard", "_gather", "_transport", "_prepared", "_kind", "_key", "_h", "_timeout",
                 "_timeout_ms", "_aux", "_aux_values", "_table", "_mine", "_lines", "_items", "_slots", "_capacity")

    def __init__(self, check: FoldedCheck, guard: AgreementGuard, gather: ShmAllgather, transport: SmallShmTransport,
                 prepared: Any, kind: int) -> None:
        self._check, self._guard, self._gather, self._transport = check, guard, gather, transport
        self._prepared, self._kind = prepared, kind
        self._key, self._h, self._timeout, self._aux = check.signature()
        self._timeout = guard.effective_timeout(self._timeout)
        self._timeout_ms = int(self._timeout * 1000)
        self._aux_values = [self._aux] * guard.size
        self._table, self._mine, self._lines = gather.layout()
        self._items = gather._items  # this rank's round word tells whether a call that raised had posted
        self._slots = transport.slot_addresses(prepared)
        self._capacity = transport.max_bytes

    def __call__(self, src: np.ndarray, dst: np.ndarray) -> bool:
        """Reduce ``src`` (C-contiguous, the plan's shape and dtype) into ``dst``; False, having done
        nothing, where a check is open on this guard (the caller then takes the Python path)."""
        guard = self._guard
        gather = self._gather
        if guard._open is not None or not gather._done:
            return False
        current = gather._round + 1
        parity = current & 1
        mine = self._mine[parity]
        transport = self._transport
        try:
            # AgreementGuard._opening and ShmAllgather.exchange's bookkeeping, with the plan's fingerprint
            # and timeout; only the calls below can raise, so both counters have moved when they do.
            gather._round = current
            guard.seq += 1
            arrival = int(time.time() * 1000)
            deadline = arrival + self._timeout_ms
            slot, slots = self._slots[transport.slot]
            out = _lane.run(self._table, mine, current, self._lines[parity], self._h, self._aux, deadline,
                            guard._spins, src, slot, slots, dst, self._kind, self._capacity)
        except BaseException as exc:
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
        if out is True:  # every rank posted this call, in time: summed
            guard.aux_values = self._aux_values
            transport.slot ^= 1  # whoever sums a call's slots flips their parity (SmallShmTransport.slot)
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
            # A verdict's errors leave the guard consistent; an interrupt before the round was judged does not.
            if guard._open is opened or (out is False and not isinstance(exc, Exception)):
                guard._interrupted(self._key, exc)
            raise
        transport.finish_prepared(self._prepared, dst, self._check.verdict(values))
        return True
