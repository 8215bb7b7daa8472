"""Messages between the job's ranks: a request and its reply within a timeout, and waiting for a message."""

from __future__ import annotations

import itertools
import time
from typing import Any

from mpi4py import MPI

from mpistrat.comm import OVERSUBSCRIBED_YIELDS, SPIN_POLLS, Waiter
from mpistrat.distribute.parameter_server.protocol import TAG_PS, TAG_REPLY, Runtime
from mpistrat.errors import UnavailableError

__all__ = ["BUSY", "call", "wait_message"]

# Waits of the job's ranks are long and idle (a ps between requests, a worker between functions): they
# spin a little, then yield, then sleep, so that idle ranks leave the cores to the ranks computing.
_WAITER = Waiter(SPIN_POLLS, OVERSUBSCRIBED_YIELDS)
# A message in transit: MPI moves a large one in pieces, each when both ranks are in MPI, so the sender
# polls without sleeping until it is out.
BUSY = Waiter(SPIN_POLLS, None)
_IDLE_AFTER = 1e-3
_seq = itertools.count(1)
_sends: list[Any] = []  # requests whose isend may still be in flight (kept alive until done)


def wait_message(comm: Any, source: int, tag: int, timeout: float | None = None) -> tuple[Any, int] | None:
    """The next message from ``source`` (``MPI.ANY_SOURCE``) with ``tag``, and its sender; None after ``timeout``."""
    status = MPI.Status()
    found: list[Any] = []

    def arrived() -> bool:
        message = comm.improbe(source=source, tag=tag, status=status)
        if message is not None:
            found.append(message)
        return message is not None

    if not _WAITER.until(arrived, timeout, idle_after=_IDLE_AFTER):
        return None
    return found[0].recv(), status.Get_source()


def call(rt: Runtime, dest: int, request: tuple, what: str) -> Any:
    """Send ``request`` to rank ``dest`` and return its answer's value (raising the error it answered).

    Raises :class:`~mpistrat.errors.UnavailableError` when no answer came within the runtime's
    timeout. Each request carries a number that its answer repeats, so an answer that comes after
    its request timed out is recognised and dropped by the next request to that rank.
    """
    seq = next(_seq)
    _sends[:] = [r for r in _sends if not r.Test()]
    send = rt.comm.isend((seq, request), dest=dest, tag=TAG_PS)
    # A large request moves in several steps, each needing this rank in MPI: poll without sleeping until
    # it is out (a stopped receiver still ends in the timeout), then wait for the answer, idle.
    deadline = time.monotonic() + rt.timeout_seconds
    if not BUSY.until(send.Test, rt.timeout_seconds):
        _sends.append(send)  # still in flight: kept alive until MPI is done with it
        raise _unavailable(rt, dest, what, "take the request")
    while True:
        got = wait_message(rt.comm, dest, TAG_REPLY, max(deadline - time.monotonic(), 0.0))
        if got is None:
            raise _unavailable(rt, dest, what, "answer")
        (answer_seq, (status, value)), _ = got
        if answer_seq != seq:
            continue  # the late answer of a request that timed out
        if status == "error":
            raise value
        return value


def _unavailable(rt: Runtime, dest: int, what: str, did_not: str) -> UnavailableError:
    return UnavailableError(f"{what}: rank {dest} did not {did_not} within {rt.timeout_seconds:g} s "
                            "(timeout_seconds of ParameterServerStrategy); it may be stopped or overloaded")
