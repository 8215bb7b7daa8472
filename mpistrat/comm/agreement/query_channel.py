"""The agreement guard's side channel: small point-to-point messages, counted so they can be drained."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["QueryChannel"]


class QueryChannel:
    """Non-blocking messages to and from the ranks of ``comm`` (collective to create: one ``Dup``).

    :class:`~mpistrat.comm.agreement.guard.AgreementGuard` sends "where are you?"
    queries, their replies, verdicts and exit notices on this private duplicate of
    its communicator, never blocking: every send is an ``isend``, every receive
    follows a matched probe.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm: MPI.Comm = comm.Dup()
        size = comm.Get_size()
        self._pending: list[MPI.Request] = []
        self._sent_to = np.zeros(size, dtype=np.int64)
        self._received_from = np.zeros(size, dtype=np.int64)

    def post(self, payload: Any, dest: int, tag: int) -> None:
        """Send ``payload`` (pickled) to ``dest`` without waiting."""
        self._pending.append(self.comm.isend(payload, dest=dest, tag=tag))
        self._sent_to[dest] += 1

    def probe(self, tag: int, status: MPI.Status) -> MPI.Message | None:
        """A matched probe of a message with ``tag`` (``MPI.ANY_TAG``: any) from any rank, or None."""
        return self.comm.improbe(MPI.ANY_SOURCE, tag, status)

    def take(self, msg: MPI.Message, status: MPI.Status) -> Any:
        """Receive the probed ``msg`` (``status``: its probe's status)."""
        payload = msg.recv()
        self._received_from[status.Get_source()] += 1
        return payload

    def reap(self) -> None:
        """Forget the sends that completed."""
        self._pending = [r for r in self._pending if not r.Test()]

    def flush(self, seconds: float) -> None:
        """Drive progress until the sends are out (some transports send only while the sender
        polls), for at most ``seconds``: a dead peer never takes them."""
        end = time.monotonic() + seconds
        while True:
            self.reap()
            if not self._pending or time.monotonic() >= end:
                return
            time.sleep(1e-3)

    def drain(self, ctl: MPI.Comm, seconds: float) -> None:
        """Receive every message sent to this rank and not read yet (collective over ``ctl``, a
        communicator of the same ranks; every rank must be alive).

        Some messages are never read (a reply to a query whose collective completed meanwhile).
        Left on the communicator when it is freed, such a message would be delivered to the next
        communicator that reuses its context id, so the ranks exchange how many messages each sent
        each other rank and receive exactly what is still owed. Probing until nothing shows is not
        enough: a message sent may not be visible to a probe yet.
        """
        self.flush(seconds)
        owed = np.empty_like(self._sent_to)
        ctl.Alltoall(self._sent_to, owed)
        status = MPI.Status()
        for source in np.flatnonzero(owed > self._received_from).tolist():
            while self._received_from[source] < owed[source]:
                self.take(self.comm.mprobe(source, MPI.ANY_TAG, status), status)

    def free(self) -> None:
        """Free the communicator (collective; after :meth:`drain`)."""
        self.comm.Free()
