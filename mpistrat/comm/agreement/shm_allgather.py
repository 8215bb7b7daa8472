"""The agreement check's all-gather through node shared memory.

Over MPI the check's ``Iallgather`` progresses only while each rank polls it, so on a node with more
ranks than cores a rank that computes holds up every round of it; when every rank of the communicator
shares one node, :class:`ShmAllgather` does the same gather in one shared-memory round instead.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpistrat.comm.runtime.shm_window import SharedWindow

__all__ = ["ShmAllgather"]

_SLOT_ITEMS = 4  # round, then the three gathered values
_LINE_ITEMS = 8  # a 64-byte cache line per slot


class ShmAllgather:
    """A persistent all-gather of ``send`` (3 int64) into ``recv`` (3 per rank) in shared memory.

    Collective to create and to ``Free`` over ``comm``, whose ranks must all
    share one node. ``Start`` posts this rank's values for the next round;
    ``Test`` is True once every rank posted that round, ``recv`` then holding
    all of them (index = rank).

    :class:`~mpistrat.comm.agreement.guard.AgreementGuard` gathers three int64 per
    rank (fingerprint, aux, deadline) before every collective: each rank writes its
    values and a round number into its own cache line; the gather is complete once
    every rank's line shows the round. This class stands in for the persistent
    request (``Start``, ``Test``, ``Free``), so the guard's waiting, timeouts,
    verdicts and stall reports are unchanged. ``MPISTRAT_AGREEMENT=mpi`` keeps the
    MPI all-gather (``auto``, the default: shared memory when the communicator
    spans one node).

    Two slots per rank, alternating by round: a rank starts round ``k + 1`` only
    after every rank posted round ``k``, and a rank posts ``k + 1`` only after
    it read round ``k``, so a peer is never more than one round ahead and never
    overwrites a slot that a rank still has to read.

    The compiled lane (:mod:`~mpistrat.comm.agreement.lane`) posts rounds in the same table from C and
    keeps this class's books (``_round``, ``_done``, ``_next``) as :meth:`exchange` does: a change to
    the layout or to that bookkeeping changes both.
    """

    def __init__(self, comm: MPI.Comm, send: np.ndarray, recv: np.ndarray) -> None:
        n = comm.Get_size()
        me = comm.Get_rank()
        # The slots of one parity, a cache line per rank, back to back in one table in rank 0's segment:
        # a round's values are read in one go. Freed with its guard (collectively, unless broken), never
        # at exit.
        self._window = SharedWindow(comm, 2 * n * _LINE_ITEMS * 8 if me == 0 else 0, free_at_exit=False)
        self._sync = self._window.win.Sync
        table = self._window.view(0, np.int64, 0, 2 * n * _LINE_ITEMS).reshape(2, n, _LINE_ITEMS)
        self._values = [table[parity, :, 1:_SLOT_ITEMS] for parity in (0, 1)]
        # The table as Python sees it item by item: a memoryview reads and writes one int64 several
        # times faster than NumPy's scalar indexing, and the polls are what a waiting rank repeats.
        self._items = memoryview(self._window.segment(0)).cast("q")
        self._mine = [(parity * n + me) * _LINE_ITEMS for parity in (0, 1)]  # my slot's first item
        self._rounds = [[(parity * n + r) * _LINE_ITEMS for r in range(n)] for parity in (0, 1)]
        self._lines = [(parity * n * _LINE_ITEMS, (parity + 1) * n * _LINE_ITEMS) for parity in (0, 1)]
        self._send = send
        self._recv = recv.reshape(n, 3)
        self._round = 0
        self._next = 0  # ranks below this one have posted the current round
        self._done = True

    #: :meth:`values` holds rank r's fingerprint, aux and deadline at ``STRIDE * r + 1``, ``+ 2``, ``+ 3``.
    STRIDE = _LINE_ITEMS

    def Start(self) -> None:  # noqa: N802  (mpi4py's request API)
        """Post this rank's ``send`` for the next round (RuntimeError while the last one is incomplete,
        as MPI refuses to start an active request: a peer could still be reading its slot)."""
        h, aux, deadline = self._send.tolist()
        self.post(h, aux, deadline)

    def post(self, h: int, aux: int, deadline: int) -> "ShmAllgather":
        """:meth:`Start` with this rank's three values given (``send`` is not read); returns itself."""
        self.exchange(h, aux, deadline, -1)
        return self

    def exchange(self, h: int, aux: int, deadline: int, spins: int) -> list[int] | None:
        """:meth:`post`, then, unless ``spins`` is negative, :meth:`poll` with ``spins`` and :meth:`values`
        in the same call: the round's lines when every rank posted within the spin, else None (the
        caller then polls). A whole round of a small all-reduce's check is this one call."""
        if not self._done:
            raise RuntimeError(f"ShmAllgather.Start: round {self._round} has not completed")
        self._round = current = self._round + 1
        parity = current & 1
        base = self._mine[parity]
        items = self._items
        items[base + 1] = h
        items[base + 2] = aux
        items[base + 3] = deadline
        sync = self._sync
        sync()  # the values before the round number
        items[base] = current
        self._next = 0
        self._done = False
        if spins < 0:
            return None
        for r in self._rounds[parity]:  # poll(spins), inline: this is every small all-reduce's wait
            while items[r] != current:
                if spins <= 0:
                    return None
                spins -= 1
        sync()  # the round numbers before the values
        self._done = True
        lo, hi = self._lines[parity]
        return items[lo:hi].tolist()

    def layout(self) -> tuple[int, list[int], list[bytes]]:
        """Where the rounds live, for a compiled reader (``_lane.c``): the table's address, this rank's line
        per parity (the index of its round item) and every rank's, per parity, as native int64 bytes."""
        address = self._window.segment(0).__array_interface__["data"][0]
        lines = [np.array(rounds, np.int64).tobytes() for rounds in self._rounds]
        return address, list(self._mine), lines

    def poll(self, spins: int = 0) -> bool:
        """Whether every rank posted the current round (then :meth:`values` returns them; ``recv`` is
        not written). ``spins``: re-read a missing rank's round up to that many times first (the
        cheapest wait there is, for a peer about to arrive; the caller's waiter decides how many)."""
        if self._done:
            return True
        current = self._round
        rounds = self._rounds[current & 1]
        items = self._items
        i, n = self._next, len(rounds)
        while i < n:
            if items[rounds[i]] != current:
                while spins > 0 and items[rounds[i]] != current:
                    spins -= 1
                if items[rounds[i]] != current:
                    self._next = i
                    return False
            i += 1
        self._sync()  # the round numbers before the values
        self._done = True
        return True

    def values(self) -> list[int]:
        """The completed round's lines, every rank's values in them (see :attr:`STRIDE`)."""
        lo, hi = self._lines[self._round & 1]
        return self._items[lo:hi].tolist()

    def Test(self) -> bool:  # noqa: N802
        """Whether every rank posted the current round (then ``recv`` holds the values)."""
        if self._done:
            return True
        if not self.poll():
            return False
        np.copyto(self._recv, self._values[self._round & 1])
        return True

    def Free(self) -> None:  # noqa: N802
        """Free the shared memory (collective)."""
        self._items.release()  # no views left: the window can be unmapped
        self._values = []
        self._window.free()
