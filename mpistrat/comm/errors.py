"""The errors of cross-rank collectives, which every rank of a failed collective raises alike.

The agreement check (agreement/) raises them on every rank, naming the ranks
involved; :func:`allgather_checked` does the same for per-rank input checked
before a constructor's first collective.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorBrokenError",
    "PeerExitedError",
    "allgather_checked",
]


class CollectiveError(RuntimeError):
    """Base class of the errors raised by cross-rank collectives."""


class CollectiveMismatchError(CollectiveError):
    """The ranks called a collective with different ops, shapes or dtypes.

    ``signatures`` holds what each rank sent (index = rank): its call key
    ``(kind, params, arrays)``, see agreement/signatures.py.
    """

    def __init__(self, message: str, signatures: Sequence[tuple] = ()) -> None:
        super().__init__(message)
        self.signatures = list(signatures)


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than its timeout.

    ``missing_ranks`` are the ranks that never arrived (empty on a rank that
    arrived late and found the collective abandoned; ``abandoned_by`` names
    the ranks that gave up then).
    """

    def __init__(self, message: str, missing_ranks: Sequence[int] = (), abandoned_by: Sequence[int] = (),
                 collective: str = "") -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)
        self.abandoned_by = list(abandoned_by)
        self.collective = collective


class CommunicatorBrokenError(CollectiveError):
    """A communicator was used after one of its collectives timed out."""


class PeerExitedError(CollectiveError):
    """A collective can never complete: ``exited_ranks`` ended their programs without joining it.

    ``collective`` names the collective (``"#3 (allreduce(op=sum) [(4,), float64])"``).
    """

    def __init__(self, message: str, exited_ranks: Sequence[int] = (), collective: str = "") -> None:
        super().__init__(message)
        self.exited_ranks = list(exited_ranks)
        self.collective = collective


def allgather_checked(comm: Any, value: Any, error: BaseException | None, what: str) -> list:
    """Collective over ``comm``: every rank's ``value``, in rank order, unless a rank had an ``error``.

    Then ``error`` is raised where it happened and a ValueError naming the
    failed ranks everywhere else. For per-rank input checked before a
    constructor's first collective, so a bad value on one rank cannot leave the
    others waiting in it; one collective both reports the errors and shares the
    values.
    """
    gathered = comm.allgather((None, value) if error is None else (f"{type(error).__name__}: {error}", None))
    if error is not None:
        raise error
    failed = [rank for rank, (message, _) in enumerate(gathered) if message is not None]
    if failed:
        raise ValueError(f"{what} failed on rank(s) {failed}: {gathered[failed[0]][0]}")
    return [v for _, v in gathered]
