"""The agreement check before every cross-rank call: every rank makes the same call, or every rank raises.

:class:`AgreementGuard` runs it with timeouts, stall reports and exit notices, so a collective never
hangs and never moves mismatched data. The errors it raises are in :mod:`mpistrat.comm.errors`; ending
the whole job on an uncaught exception is :mod:`mpistrat.comm.runtime.abort`.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat import config
from mpistrat.comm.agreement.query_channel import QueryChannel
from mpistrat.comm.agreement.shm_allgather import ShmAllgather
from mpistrat.comm.agreement.signatures import CallKey, describe_call, fingerprint, format_mismatch, format_ranks
from mpistrat.comm.agreement.stall import STALL_SHUTDOWN_ENV, format_stall, report_stall
from mpistrat.comm.errors import CollectiveMismatchError, CollectiveTimeoutError, CommunicatorBrokenError, PeerExitedError
from mpistrat.comm.runtime.topology import Topology, topology as make_topology

__all__ = ["AgreementGuard"]

_YIELD_SECONDS = 0.05  # a wait this long sleeps between polls (backing off): the peers are computing
_TAG_QUERY, _TAG_REPLY, _TAG_ABANDON, _TAG_RESOLVED, _TAG_EXITED = 1, 2, 3, 4, 5


# --------------------------------------------------------------------------- the guard

_LIVE: "weakref.WeakSet[AgreementGuard]" = weakref.WeakSet()
_GUARD_COUNT = 0
# What this process is waiting on, for answers to peers' queries:
# (guard index, seq, call key, since) or None.
_WAITING: tuple | None = None


def _service_all() -> None:
    for guard in list(_LIVE):
        guard._answer_queries()


class AgreementGuard:
    """Fingerprint checks with timeouts for one communicator.

    Every cross-rank call of a :class:`~mpistrat.comm.communicator.RankCommunicator` first runs
    :meth:`check`: one tiny non-blocking collective on a private duplicate of the communicator, an
    all-gather of three int64 per rank (a fingerprint of the call, one auxiliary integer, the rank's
    wall-clock deadline). It is a persistent ``Allgather_init`` request where MPI-4 offers it, else
    ``Iallgather``; when every rank of the communicator shares one node, one round through node shared
    memory instead, :class:`~mpistrat.comm.agreement.shm_allgather.ShmAllgather`, unless
    ``MPISTRAT_AGREEMENT=mpi``. A check that does not pass ends in an error on every rank: a mismatch
    (:meth:`finish`), a timeout (:meth:`_on_timeout`, and :meth:`_settle` for a rank that arrives after
    a peer gave up), or a peer that exited (:meth:`_peer_exited`). After a timeout the guard is broken:
    later calls raise :class:`CommunicatorBrokenError`. Nothing in this path blocks: every receive
    follows a matched probe and every send is non-blocking and small.

    The data transfer after a passed check uses blocking MPI calls: everyone has arrived, so it can
    only hang if a rank dies in between (the launcher then ends the job).

    Creating one is collective over ``comm`` (two ``Dup``, and a shared window on one node;
    :attr:`transport` says which all-gather it uses: ``"shm"`` or ``"mpi"``). Not thread-safe:
    one thread at a time per guard, like the communicator it guards.
    """

    def __init__(self, comm: MPI.Comm, topology: Topology | None = None, settings: config.Settings | None = None) -> None:
        global _GUARD_COUNT
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        settings = config.settings() if settings is None else settings
        owned = make_topology(comm) if topology is None else None
        topology = topology or owned
        assert topology is not None
        self._ctl = comm.Dup()
        self._channel = QueryChannel(comm)
        self._query = self._channel.comm
        # Where the machine's ranks outnumber its cores, polls sleep after their yields (waiter).
        self._waiter = topology.waiter
        # A spin over the shared round words reads one int per turn, about a tenth of a waiter's poll
        # (a call), so a tenth of the cost per turn: the waiter's spin time, before its set-up.
        self._spins = topology.waiter.spin * 10
        shm_wanted = settings.agreement == "auto" and topology.one_machine
        if owned is not None:
            owned.free()
        # The index is the same on every rank of comm (queries and replies name guards by it), even
        # when ranks have made different numbers of guards (on sub-communicators): one above the
        # largest; shared memory only if every rank wants it.
        agreed = self._ctl.allgather((_GUARD_COUNT, shm_wanted))
        _GUARD_COUNT = max(count for count, _ in agreed) + 1
        self.index = _GUARD_COUNT
        self.seq = 0
        # Per rank: fingerprint, aux, wall-clock deadline (ms) of its wait.
        self._send = np.zeros(3, dtype=np.int64)
        self._recv = np.zeros(3 * self.size, dtype=np.int64)
        self._recv_aux = self._recv[1::3]
        self.aux_values: list[int] = []  # every rank's aux in the last completed check
        self.transport = "shm" if all(shm for _, shm in agreed) else "mpi"
        if self.transport == "shm":  # one node: one shared-memory round (shm_allgather.py)
            gather = ShmAllgather(self._ctl, self._send, self._recv)
            self.gather: ShmAllgather | None = gather  # the compiled lane (lane.py) posts in its rounds too
            self._persistent: Any = gather
            # A completed round is read straight from the shared lines: rank r's values at stride * r + 1..3.
            self._post, self._poll, self._read = gather.post, gather.poll, gather.values
            self._exchange: Any = gather.exchange
            self._stride, self._first = gather.STRIDE, 1
        else:  # a persistent collective (MPI-4) saves a few microseconds per check
            self.gather = None
            try:
                self._persistent = self._ctl.Allgather_init(self._send, self._recv)
            except (AttributeError, NotImplementedError, MPI.Exception):
                self._persistent = None
            self._post, self._poll, self._read = self._post_mpi, None, self._recv.tolist
            self._exchange = None
            self._stride, self._first = 3, 0
        self._qid = 0
        self._grace = settings.timeout_grace_seconds
        self.broken: str | None = None
        self.abandoned_seq: int | None = None
        self._open: tuple | None = None  # a started check: (request, key, timeout, fingerprint, arrival ms, deadline ms)
        self._stall_warning, self._stall_shutdown = settings.stall_warning_seconds, settings.stall_shutdown_seconds
        self._timeout_cap = self._stall_shutdown or float("inf")  # a stall shutdown shortens every check's timeout
        self._exited: dict[int, tuple] = {}  # rank -> (its last seq, how it ended)
        self._waiting_for: tuple | None = None  # the wait in progress: (request, key, start, deadline)
        self._next_stall = 0.0
        _LIVE.add(self)

    # ---------------------------------------------------------------- public

    def check(self, key: CallKey, timeout: float, aux: int = 0, h: int | None = None) -> np.ndarray:
        """Agree on ``key`` with every rank; return each rank's ``aux``.

        The returned int64 array (index = rank) is valid until the next check.
        ``h`` is ``fingerprint(key)`` when the caller already has it.
        Raises :class:`CollectiveMismatchError` on every rank when the keys
        differ and :class:`CollectiveTimeoutError` after ``timeout`` seconds.
        """
        self.start(key, timeout, aux, h)
        return self.finish()

    def check_aux(self, key: CallKey, timeout: float, aux: int = 0, h: int | None = None) -> list[int]:
        """:meth:`check`, returning every rank's ``aux`` as a Python list (index = rank) the caller may
        keep: what a caller reading a few values needs, without NumPy's per-item cost."""
        exchange = self._exchange
        if exchange is None or self._open is not None or self.broken is not None:
            self.start(key, timeout, aux, h)  # raises where a check may not start
            return self._complete(True)
        # One node's shared-memory round: start, and finish when every rank posts within the spin,
        # in one frame (every small all-reduce's check); else finish() waits as always.
        timeout, h, arrival, deadline = self._opening(key, timeout, h)
        self._open = opened = (self._persistent, key, timeout, h, arrival, deadline)
        try:
            values = exchange(h, aux, deadline, self._spins)
        except BaseException as exc:  # KeyboardInterrupt in the spin: the round is out
            self._interrupted(key, exc)
            raise
        if values is None:
            return self._complete(True, 0)  # spun already: wait
        self._open = None
        try:
            now = int(time.time() * 1000)
            stride = self._stride
            # The common verdict, _judge's without a call: no deadline passed, every fingerprint ours.
            if now <= deadline and min(values[3::stride]) >= now and values[1::stride].count(h) == self.size:
                self.aux_values = aux_values = values[2::stride]
                return aux_values
            return self._judge(values, opened, False, now, now, True)
        except BaseException as exc:  # a verdict's errors leave the guard consistent; an interrupt does not
            if not isinstance(exc, Exception):
                self._interrupted(key, exc)
            raise

    @property
    def started(self) -> bool:
        """Whether a check was started and not finished."""
        return self._open is not None

    def require_usable(self) -> None:
        """Raise :class:`CommunicatorBrokenError` if a timeout, an exited peer, an interrupted or failed
        close broke this guard (called before a rank touches anything its peers may still read)."""
        if self.broken is not None:
            raise CommunicatorBrokenError(self.broken)

    def start(self, key: CallKey, timeout: float, aux: int = 0, h: int | None = None) -> None:
        """The first half of :meth:`check`: send this rank's signature and return at once.

        The caller may do local work (staging its data, never anything that
        needs the other ranks) and must then call :meth:`finish`, also when
        that work fails: the check's request must not stay open.
        ``MPISTRAT_STALL_SHUTDOWN_SECONDS``, when shorter than ``timeout``, replaces it: a stall that
        long ends in the timeout's error on every rank.
        """
        if self._open is not None:
            raise RuntimeError("AgreementGuard.start: the previous check was not finished")
        if self.broken is not None:
            raise CommunicatorBrokenError(self.broken)
        timeout, h, arrival, deadline = self._opening(key, timeout, h)
        self._open = (self._post(h, aux, deadline), key, timeout, h, arrival, deadline)

    def effective_timeout(self, timeout: float) -> float:
        """A check's timeout: ``timeout``, or the stall shutdown's where shorter."""
        return min(timeout, self._timeout_cap)

    def _opening(self, key: CallKey, timeout: float, h: int | None) -> tuple[float, int, int, int]:
        """A new check's timeout (:meth:`effective_timeout`), fingerprint, arrival and deadline (ms, this
        rank's clock); counts the check. The compiled lane (lane.py) opens its rounds the same way, and
        keeps ``seq`` and ``_open`` as this class does."""
        timeout = min(timeout, self._timeout_cap)  # effective_timeout, inline: every check
        if h is None:
            h = fingerprint(key)
        self.seq += 1
        arrival = int(time.time() * 1000)
        return timeout, h, arrival, arrival + int(timeout * 1000)

    def _post_mpi(self, h: int, aux: int, deadline: int) -> MPI.Request:
        """Post this rank's values in the MPI all-gather; its request."""
        send = self._send
        send[0] = h
        send[1] = aux
        send[2] = deadline
        req = self._persistent
        if req is None:
            return self._ctl.Iallgather(send, self._recv)
        req.Start()
        return req

    def finish(self) -> np.ndarray:
        """The second half of :meth:`check`: wait for every rank, compare, return each rank's ``aux``.

        When the fingerprints differ (op, array count, shapes, dtypes, call kind, root...), every rank
        has seen every fingerprint, so all of them gather the call signatures (everyone is present by
        then) and raise the same :class:`CollectiveMismatchError`, naming the ranks and what each sent
        (``Mismatched allreduce shapes in collective #3: rank 0 sent [(4,), float32]; rank 1 sent
        [(5,), float32]``).
        """
        return self._complete(False)

    def _complete(self, list_only: bool, spins: int | None = None) -> Any:
        """:meth:`finish`; with ``list_only``, every rank's ``aux`` as a list (``recv`` is not written).
        ``spins``: the shared-memory spin before waiting (None: the waiter's, ``_spins``)."""
        opened = self._open
        if opened is None:
            raise RuntimeError("AgreementGuard.finish: no check was started")
        req, key, timeout, h, arrival, deadline = opened
        self._open = None
        now = 0
        try:
            # Complete already, or after the waiter's spin over the shared round words (a peer arriving
            # within it costs no wait set-up): one clock reading serves both questions below.
            if self._poll(self._spins if spins is None else spins) if self._poll is not None else req.Test():
                late = False
                now = resumed = int(time.time() * 1000)
            else:
                resumed = int(time.time() * 1000)  # after start(), the caller may have staged without polling
                late = self._wait(req, key, timeout)
        except BaseException as exc:  # KeyboardInterrupt, a signal handler's error: the round is still open
            self._interrupted(key, exc)
            raise
        completed = now or (0 if late else time.time() * 1000)
        return self._judge(self._read(), opened, late, resumed, completed, list_only)

    def _interrupted(self, key: CallKey, exc: BaseException) -> None:
        """A posted round ended by ``exc`` before its verdict: this guard is broken (the peers may still
        read the round, or have gone on to the call's data without this rank)."""
        self._open = None
        if self.broken is None:
            self.broken = (f"collective #{self.seq} ({describe_call(key)}) was interrupted on rank "
                           f"{self.rank} in its agreement round ({type(exc).__name__})")

    def _judge(self, values: list[int], opened: tuple, late: bool, resumed: float, completed: float,
               list_only: bool) -> Any:
        """The verdict of a completed round (``values``: every rank's lines, :meth:`_read`; ``resumed``:
        the clock in ms when this rank came back to the check after staging, ``completed`` when it saw
        the round complete): deadlines passed, fingerprints differing (a mismatch on every rank); every
        rank's ``aux``."""
        _, key, timeout, h, arrival, deadline = opened
        if not late and completed > deadline:
            # Completed past our deadline, before noticing it (while waiting, or
            # while staging after start): a peer that arrived after the deadline
            # expects a verdict from us.
            self._resolved([r for r in range(self.size) if r != self.rank])
        stride, first = self._stride, self._first
        # A peer whose deadline passed before we arrived has timed out: it
        # sends a verdict (RESOLVED or ABANDON) that we must wait for.
        deadlines = values[first + 2 :: stride]
        earliest = min(deadlines)
        if late or earliest < arrival:
            self._settle(key, timeout, deadlines, arrival)
        elif earliest < resumed:
            # A peer's deadline passed while we staged: it may have timed out
            # (then it queried us, and its verdict is on the way) or completed
            # in time (then it sent nothing): wait only for those that queried.
            self._settle(key, timeout, deadlines, arrival, only_queried=True)
        if values[first::stride].count(h) != self.size:
            keys = self._ctl.allgather(key)
            message = format_mismatch(keys, self.seq)
            if any(k[0] == "close" for k in keys):
                # Some ranks are closing: the communicator is done for everyone.
                self.broken = f"ranks disagreed while closing this communicator ({message})"
            raise CollectiveMismatchError(message, keys)
        self.aux_values = aux = values[first + 1 :: stride]
        if list_only:
            return aux
        if self._poll is not None:  # gathered in shared memory: recv holds nothing yet
            self._recv_aux[:] = aux
        return self._recv_aux

    def close(self) -> None:
        """Free the guard's communicators (kept when broken: a request is pending)."""
        _LIVE.discard(self)
        if self.broken is None:
            # Never raise between the collectives below: a bad value on one rank would strand the others.
            grace = self._grace
            if self._persistent is not None:
                self._persistent.Free()
            self._channel.drain(self._ctl, grace)  # nothing left for a later communicator
            self._channel.free()
            self._ctl.Free()
        self._ctl = self._query = MPI.COMM_NULL
        if self.broken is None:
            self.broken = "this communicator was closed"

    # ---------------------------------------------------------------- waiting

    def _wait(self, req: MPI.Request, key: CallKey, timeout: float) -> bool:
        """Poll until done; True when it completed only after the timeout.

        ``req`` is polled with ``Test`` by the topology's waiter: a short spin (none when the node has
        more ranks than cores), then polls that yield the CPU (``sched_yield``), then, after 50 ms,
        sleeps backing off to 1 ms, so waiting ranks leave the CPU to ranks that compute. While
        polling, a rank also answers "where are you?" queries on a second duplicate communicator
        (matched probes, never blocking; :mod:`~mpistrat.comm.agreement.query_channel`), looks for exit
        notices and verdicts, and inspects stalls (:meth:`_inspect_stall`).
        """
        global _WAITING
        start = time.monotonic()
        previous = _WAITING
        _WAITING = (self.index, self.seq, key, start)  # described only if a peer asks
        interval = self._stall_warning
        self._waiting_for = (req, key, start, start + timeout)
        self._next_stall = start + interval if interval > 0 else float("inf")
        try:
            if self._waiter.until(self._poll or req.Test, timeout, tick=self._tick, idle_after=_YIELD_SECONDS):
                return False
            self._on_timeout(req, key, timeout, start)
            return True
        finally:
            _WAITING = previous
            self._waiting_for = None

    def _tick(self, now: float) -> bool:
        """Every millisecond of a wait (:meth:`_wait`): answer queries, look for exit notices and
        verdicts, inspect a stall when due; True when the check completed meanwhile."""
        assert self._waiting_for is not None
        req, key, start, deadline = self._waiting_for
        _service_all()
        if self._exited or self._query.Iprobe(MPI.ANY_SOURCE, _TAG_EXITED):
            self._peer_exited(key)
        if self._query.Iprobe(MPI.ANY_SOURCE, _TAG_ABANDON):
            self._abandoned_while_waiting(key)
        if self._next_stall <= now < deadline:
            if self._inspect_stall(req, key, start):
                return True
            self._next_stall += self._stall_warning
        return False

    def _answer_queries(self) -> None:
        """Answer pending "where are you?" queries (never blocks)."""
        if self._query == MPI.COMM_NULL:
            return
        status = MPI.Status()
        while True:
            msg = self._channel.probe(_TAG_QUERY, status)
            if msg is None:
                break
            qid = self._channel.take(msg, status)
            if qid[0] == self.index and qid[1] == self.abandoned_seq:
                state = ("abandoned",)  # we arrived too, then timed out
            else:
                waiting = _WAITING
                state = None if waiting is None else (
                    waiting[0], waiting[1], describe_call(waiting[2]), time.monotonic() - waiting[3]
                )
            self._channel.post((qid, state), status.Get_source(), _TAG_REPLY)
        self._channel.reap()

    def _others(self) -> list[int]:
        return [r for r in range(self.size) if r != self.rank]

    def _ask_peers(self, req: MPI.Request) -> dict[int, Any] | None:
        """Ask every peer where it is; the answers that came within the grace
        period (rank -> state, None if not waiting in a collective), or None
        when ``req`` completed meanwhile."""
        self._qid += 1
        qid = (self.index, self.seq, self._qid)
        others = self._others()
        for r in others:
            self._channel.post(qid, r, _TAG_QUERY)
        replies: dict[int, Any] = {}
        status = MPI.Status()
        grace_end = time.monotonic() + self._grace
        while len(replies) < len(others) and time.monotonic() < grace_end:
            if req.Test():
                return None
            _service_all()
            while True:
                msg = self._channel.probe(_TAG_REPLY, status)
                if msg is None:
                    break
                rqid, state = self._channel.take(msg, status)
                if rqid == qid:
                    replies[status.Get_source()] = state
            time.sleep(1e-3)
        return None if req.Test() else replies

    def _classify(self, key: CallKey, replies: dict[int, Any]) -> tuple:
        """From peers' answers: ``(present, missing, silent, elsewhere, submitted)``.

        ``present`` ranks wait in (or timed out of) this collective, ``missing``
        ones do not; ``silent`` missing ranks did not answer; ``elsewhere``
        describes missing ranks waiting in another collective; ``submitted``
        maps each present rank's call description to its ranks.
        """
        present, missing, elsewhere = [self.rank], [], []
        submitted: dict[str, list[int]] = {describe_call(key): [self.rank]}
        for r in self._others():
            state = replies.get(r)
            if state is None:
                missing.append(r)
            elif state[0] == "abandoned":
                present.append(r)
            elif state[0] == self.index and state[1] == self.seq:
                present.append(r)
                submitted.setdefault(state[2], []).append(r)
            else:
                missing.append(r)
                elsewhere.append(
                    f"rank {r} is waiting in collective #{state[1]} of communicator #{state[0]} "
                    f"({state[2]}) since {state[3]:.1f} s"
                )
        silent = [r for r in missing if replies.get(r) is None]
        return present, missing, silent, elsewhere, submitted

    def _inspect_stall(self, req: MPI.Request, key: CallKey, start: float) -> bool:
        """Report a stalled collective (from the lowest waiting rank); True if it completed meanwhile.

        After ``MPISTRAT_STALL_WARNING_SECONDS`` (default 60) of waiting and again at every further
        interval, a waiting rank asks every peer where it is, and the lowest-ranked waiting rank (rank 0
        when it is among them) logs which ranks have not arrived and what the waiting ranks submitted
        (:mod:`mpistrat.comm.agreement.stall`).
        """
        replies = self._ask_peers(req)
        if replies is None:
            return True
        present, missing, silent, elsewhere, submitted = self._classify(key, replies)
        if missing and self.rank == min(present):
            what = f"collective #{self.seq} of communicator #{self.index} ({describe_call(key)})"
            message = format_stall(self.rank, what, time.monotonic() - start, missing, silent, elsewhere,
                                   submitted, self._stall_warning, self._stall_shutdown)
            report_stall(message, seq=self.seq, missing=missing)
        return False

    def _limit(self, timeout: float) -> str:
        """Which setting ended a wait of ``timeout`` seconds, as ``name=value``."""
        name = STALL_SHUTDOWN_ENV if timeout == self._stall_shutdown else "timeout_seconds"
        return f"{name}={timeout:g}"

    def _on_timeout(self, req: MPI.Request, key: CallKey, timeout: float, start: float) -> None:
        """A wait passed ``timeout``: raise :class:`CollectiveTimeoutError`, unless the call completed meanwhile.

        The rank queries every peer, waits a short grace period (``MPISTRAT_TIMEOUT_GRACE_SECONDS``,
        default 0.5 s) for answers, and raises naming the ranks that never arrived: a rank that is busy
        in Python, blocked in another MPI call or dead does not answer and is named as such; a rank
        waiting in a different mpistrat collective says which. The timed-out rank sends every peer a
        verdict: ABANDON (it raised) or RESOLVED (the collective completed during the grace period after
        all). A rank that completes a check and sees from the gathered deadlines that a peer's deadline
        had passed before it arrived waits (bounded) for that peer's verdict (:meth:`_settle`), so a late
        rank raises too instead of entering the data transfer alone.
        """
        others = self._others()
        replies = self._ask_peers(req)
        if replies is None:
            return self._resolved(others)  # everybody arrived after all
        present, missing, silent, elsewhere, _ = self._classify(key, replies)
        waited = time.monotonic() - start
        limit = self._limit(timeout)
        parts = [
            f"Collective #{self.seq} ({describe_call(key)}) timed out on rank {self.rank} "
            f"after {waited:.1f} s ({limit}): {format_ranks(missing)} never arrived"
        ]
        if silent:
            parts.append(
                f"{format_ranks(silent)} did not answer: busy outside mpistrat collectives "
                "(computing, blocked in another MPI call) or dead (killed, or ended through os._exit, which tells no "
                "peer)"
            )
        parts.extend(elsewhere)
        parts.append(f"present (waiting or timed out too): {format_ranks(present)}")
        message = "; ".join(parts) + "."
        for r in others:
            self._channel.post((self.seq, self.rank, limit), r, _TAG_ABANDON)
        self._channel.flush(self._grace)
        self.broken = f"a collective of this communicator timed out earlier ({message})"
        self.abandoned_seq = self.seq
        raise CollectiveTimeoutError(message, missing_ranks=missing,
                                     collective=f"#{self.seq} ({describe_call(key)})")

    def _peer_exited(self, key: CallKey) -> None:
        """Raise if a peer exited before joining the collective we wait in.

        At exit (``atexit``), a rank tells the peers of each of its live guards how many checks it made
        (:meth:`_announce_exit`). A peer waiting in a later collective of that guard can never be joined:
        it raises :class:`PeerExitedError` at once, naming the rank (a rank that finished its loop early:
        uneven step counts), instead of waiting for the timeout.
        """
        status = MPI.Status()
        while True:
            msg = self._channel.probe(_TAG_EXITED, status)
            if msg is None:
                break
            self._exited[status.Get_source()] = self._channel.take(msg, status)
        gone = sorted(r for r, (seq, _) in self._exited.items() if seq < self.seq)
        if not gone:
            return
        how = "; ".join(f"rank {r} {self._exited[r][1]} after its collective #{self._exited[r][0]}" for r in gone)
        message = (
            f"Collective #{self.seq} ({describe_call(key)}) can never complete on rank {self.rank}: "
            f"{format_ranks(gone)} exited without joining it ({how}). Every rank must make the same collective "
            "calls in the same order: did a rank run fewer steps (uneven data, a loop that ended early)? "
            "A distributed dataset ends on every rank at the same step."
        )
        self.broken = f"a peer of this communicator has exited ({message})"
        raise PeerExitedError(message, exited_ranks=gone, collective=f"#{self.seq} ({describe_call(key)})")

    def _announce_exit(self, how: str) -> None:
        """Tell every peer that this process is exiting after ``self.seq`` checks."""
        if self.broken is None and self._query != MPI.COMM_NULL:
            for r in self._others():
                self._channel.post((self.seq, how), r, _TAG_EXITED)

    def _abandoned_while_waiting(self, key: CallKey) -> None:
        status = MPI.Status()
        givers, their_limit = [], ""
        while True:
            msg = self._channel.probe(_TAG_ABANDON, status)
            if msg is None:
                break
            payload = self._channel.take(msg, status)
            if payload[0] == self.seq:
                givers.append(status.Get_source())
                their_limit = payload[2]
        if givers:
            message = (
                f"Collective #{self.seq} ({describe_call(key)}) was abandoned while rank {self.rank} waited: "
                f"{format_ranks(givers)} gave up after {their_limit}."
            )
            self.broken = f"a collective of this communicator timed out earlier ({message})"
            self.abandoned_seq = self.seq
            raise CollectiveTimeoutError(message, abandoned_by=givers)

    def _resolved(self, others: list[int]) -> None:
        """Tell the peers we queried that the collective completed after all."""
        for r in others:
            self._channel.post(self.seq, r, _TAG_RESOLVED)
        self._channel.flush(self._grace)

    def _settle(self, key: CallKey, timeout: float, deadlines: list, arrival: int, only_queried: bool = False) -> None:
        """After a completed check, learn whether a peer gave up on it.

        A peer that timed out on this collective queried us; it then sends a
        verdict: RESOLVED (it saw the collective complete) or ABANDON (it
        raised). Wait for the verdicts, bounded; raise on ABANDON or silence.
        Expected from the peers whose deadline passed before ``arrival`` and
        those that queried us, or (``only_queried``) only the latter.
        """
        status = MPI.Status()
        pending = set() if only_queried else {r for r, d in enumerate(deadlines) if d < arrival and r != self.rank}
        givers: list[int] = []
        their_limit = self._limit(timeout)
        latest = max([deadlines[r] for r in pending], default=arrival) / 1000.0
        end = time.monotonic() + max(0.0, latest - time.time()) + 3 * self._grace + 1.0
        while True:
            while True:
                msg = self._channel.probe(MPI.ANY_TAG, status)
                if msg is None:
                    break
                source, tag = status.Get_source(), status.Get_tag()
                payload = self._channel.take(msg, status)
                if tag == _TAG_QUERY:
                    if payload[0] == self.index and payload[1] == self.seq:
                        pending.add(source)
                    state = (self.index, self.seq, describe_call(key), 0.0)
                    self._channel.post((payload, state), source, _TAG_REPLY)
                elif tag == _TAG_ABANDON and payload[0] == self.seq:
                    givers.append(source)
                    their_limit = payload[2]
                    pending.discard(source)
                elif tag == _TAG_RESOLVED and payload == self.seq:
                    pending.discard(source)
                elif tag == _TAG_EXITED:
                    self._exited[source] = payload  # raised on at our next wait
                # anything else: stale replies or notices of earlier collectives
            if not pending or time.monotonic() >= end:
                break
            time.sleep(1e-3)
        self._channel.flush(self._grace)
        if givers or pending:
            parts = []
            if givers:
                parts.append(f"{format_ranks(givers)} gave up waiting after {their_limit}")
            if pending:
                parts.append(f"{format_ranks(sorted(pending))} timed out and sent no verdict")
            message = (
                f"Collective #{self.seq} ({describe_call(key)}) was abandoned before rank {self.rank} "
                f"arrived: " + "; ".join(parts) + "."
            )
            self.broken = f"a collective of this communicator timed out earlier ({message})"
            self.abandoned_seq = self.seq
            raise CollectiveTimeoutError(message, abandoned_by=sorted(set(givers) | pending))


def _how_this_process_ends() -> str:
    exc = getattr(sys, "last_value", None)  # set when an uncaught exception was printed
    if exc is not None:
        return f"ended with an uncaught {type(exc).__name__}"
    return "ended its program (returned or called sys.exit)"


def _announce_exit() -> None:
    """At exit: tell the peers of every live guard (see :class:`PeerExitedError`)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    guards = list(_LIVE)
    how = _how_this_process_ends()
    for guard in guards:
        guard._announce_exit(how)
    for guard in guards:
        guard._channel.flush(guard._grace)


# Before the atexit hooks (threading's exit hooks run first), some of which free
# shared-memory windows collectively and would block while peers wait.
getattr(threading, "_register_atexit", atexit.register)(_announce_exit)
