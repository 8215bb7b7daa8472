"""Reductions in flight: the handle ``ReplicaContext.experimental_all_reduce_async`` returns."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from mpistrat import nest

__all__ = ["InFlightReduction", "AllReduceHandle"]


class InFlightReduction:
    """One batch all-reduce started by ``CrossDeviceOps.batch_all_reduce_async``, shared by the local replicas.

    ``pending`` is the cross-rank all-reduce running on the communicator's
    worker (``RankCommunicator.allreduce_async``'s handle), or None when there
    is none (one rank): then ``reduced`` is the result already. ``finish(reduced)``
    turns the cross-rank result into every local replica's leaves (MEAN's
    division, copies to the replicas' devices); it runs once, in the first
    thread that asks for :meth:`rows`.
    """

    __slots__ = ("_pending", "_reduced", "_finish", "_rows", "_lock", "_delivered")

    def __init__(self, pending: Any, reduced: list, finish: Callable[[list], list[list]]) -> None:
        self._pending = pending
        self._reduced = reduced
        self._finish = finish
        self._rows: list[list] | None = None
        self._lock = threading.Lock()
        self._delivered = False  # an error was raised to a caller of rows()

    def done(self) -> bool:
        """Whether the cross-rank part has finished (never blocks)."""
        return self._pending is None or self._pending.done()

    def rows(self) -> list[list]:
        """Wait; every local replica's reduced leaves (``batch_all_reduce``'s return value), or the error."""
        rows = self._rows
        if rows is not None:
            return rows
        with self._lock:
            if self._rows is None:
                reduced = self._reduced
                if self._pending is not None:
                    try:
                        reduced = self._pending.result()
                    except BaseException:
                        self._delivered = True
                        raise
                self._rows = self._finish(reduced)
                self._pending = self._reduced = self._finish = None  # the rows are all that is needed now
            return self._rows

    def unread_error(self) -> BaseException | None:
        """Wait for the cross-rank part; its error if no caller of :meth:`rows` was given it (then only once)."""
        with self._lock:
            pending = self._pending
            if pending is None or self._delivered:
                return None
            error = pending.exception()
            if error is not None:
                self._delivered = True
            return error


class AllReduceHandle:
    """What ``ReplicaContext.experimental_all_reduce_async`` returns to one replica.

    ``result()`` waits and returns what ``all_reduce`` would have returned for
    the same arguments (a new value with the structure of the one passed), or
    raises its error; ``done()`` says, without blocking, whether the reduction
    has finished.
    """

    __slots__ = ("_reduction", "_replica", "_structure", "_as_list")

    def __init__(self, reduction: InFlightReduction, local_replica_id: int, structure: Any, as_list: bool) -> None:
        self._reduction = reduction
        self._replica = local_replica_id
        self._structure = structure
        self._as_list = as_list  # the value was a flat list of plain leaves: the result is a list

    def done(self) -> bool:
        """Whether the reduction has finished: :meth:`result` would not wait (never blocks)."""
        return self._reduction.done()

    def result(self) -> Any:
        """Wait for the reduction; the reduced value (as ``all_reduce`` returns it), or its error."""
        leaves = self._reduction.rows()[self._replica]
        if self._as_list:
            return list(leaves)
        if type(self._structure) is np.ndarray:
            return leaves[0]
        return nest.pack_sequence_as(self._structure, leaves)

    def __repr__(self) -> str:
        return f"<AllReduceHandle replica={self._replica} {'done' if self.done() else 'in flight'}>"
