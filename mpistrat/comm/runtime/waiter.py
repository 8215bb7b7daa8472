"""How a rank waits for its peers: one polling loop that spins, yields, then sleeps, up to a deadline.

Every wait of the library (the node synchronisation, the cross-node request of the shared-memory
transport, the agreement check) polls a condition with a :class:`Waiter`.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from mpi4py import MPI

__all__ = [
    "SLEEP_SECONDS",
    "SPIN_POLLS",
    "OVERSUBSCRIBED_YIELDS",
    "MAX_IDLE_SLEEP",
    "Waiter",
    "default_spin",
    "default_yields",
    "pause",
    "reads_clock",
    "ranks_outnumber_cores",
]

SLEEP_SECONDS = 20e-6  # asked for; the kernel's timer slack makes it longer
OVERSUBSCRIBED_YIELDS = 32  # yields before sleeping where ranks outnumber cores
SPIN_POLLS = 100
MAX_IDLE_SLEEP = 1e-3
_FIRST_IDLE_SLEEP = 5e-5


def default_spin(ranks_on_machine: int) -> int:
    """Polls before yielding: 0 when ranks outnumber this process's cores, else ``SPIN_POLLS``.

    The spin is short: when other jobs share the cores, a long spin burns the
    slice the awaited peer needs; an idle machine pays one cheap ``sched_yield``
    per poll after it.
    """
    return 0 if ranks_on_machine > len(_affinity()) else SPIN_POLLS


def default_yields(oversubscribed: bool) -> int | None:
    """Yields before sleeping: ``OVERSUBSCRIBED_YIELDS`` where the machine's ranks outnumber its cores
    (:func:`ranks_outnumber_cores`), else None (never sleep: a rank with a core of its own loses
    only latency by sleeping)."""
    return OVERSUBSCRIBED_YIELDS if oversubscribed else None


def pause(polls: int, spin: int, yields: int | None) -> None:
    """The pause after the ``polls``-th unsuccessful poll (counted from 1) of one wait."""
    if polls <= spin:
        return
    if yields is not None and polls - spin > yields:
        time.sleep(SLEEP_SECONDS)
    else:
        os.sched_yield()


def reads_clock(polls: int, spin: int, yields: int | None) -> bool:
    """Whether a wait with a deadline reads the clock after the ``polls``-th poll (past ``spin``): at the
    first pause (its deadline starts), every 1024th, and every one once it sleeps (a sleep costs far
    more than the clock; checked only every 1024 sleeps, a deadline would pass unnoticed for long)."""
    return polls == spin + 1 or (polls & 1023) == 0 or (yields is not None and polls - spin > yields)


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def ranks_outnumber_cores(machine: MPI.Comm) -> bool:
    """Whether the ranks of ``machine`` (one machine's ranks) outnumber the cores they may run on
    together, the union of their CPU affinities (collective). Unlike :func:`default_spin`, two ranks
    bound one to a core each are not oversubscribed."""
    cores = set().union(*machine.allgather(_affinity()))
    return machine.Get_size() > len(cores)


class Waiter:
    """One polling policy: ``spin`` polls, then yields, then (after ``yields`` of them) sleeps.

    Between unsuccessful polls a wait :func:`pause`\\ s:

    * first ``spin`` polls with no pause (:func:`default_spin`: none when the
      ranks outnumber this process's cores, since a spinning rank keeps the
      peer it waits for off the CPU);
    * then ``os.sched_yield()`` on every poll, so the CPU goes to a rank that
      computes;
    * then, after ``yields`` yields, a short sleep (``SLEEP_SECONDS``) per poll,
      where the ranks of the machine outnumber its cores (:func:`default_yields`):
      under Linux's EEVDF scheduler a yield hands the CPU only to a peer that has
      had no more than its share, so two ranks that never sleep may keep a waiting
      rank on the CPU for a whole slice (benchmarks/README.md, "polling");
    * a wait that asks for it (``idle_after``) sleeps instead, backing off to
      ``MAX_IDLE_SLEEP``, once it has waited that long: a peer that is that late
      is computing, not communicating.
    """

    __slots__ = ("spin", "yields")

    def __init__(self, spin: int, yields: int | None) -> None:
        self.spin = spin
        self.yields = yields

    def until(
        self,
        done: Callable[[], bool],
        timeout: float | None = None,
        *,
        tick: Callable[[float], bool] | None = None,
        tick_seconds: float = 1e-3,
        idle_after: float | None = None,
    ) -> bool:
        """Poll ``done`` until it is true (True), or until ``timeout`` seconds have passed since the first
        pause (False). ``tick(now)``, when given, runs every ``tick_seconds`` while waiting and may end
        the wait by returning True (the condition was met another way) or by raising. With
        ``idle_after``, polls sleep backing off to ``MAX_IDLE_SLEEP`` once the wait is that long."""
        if done():
            return True
        spin, yields = self.spin, self.yields
        polls = 0
        if tick is None and idle_after is None:
            deadline = None
            while not done():
                polls += 1
                if polls > spin:
                    pause(polls, spin, yields)
                    if timeout is not None and reads_clock(polls, spin, yields):
                        now = time.monotonic()
                        if deadline is None:
                            deadline = now + timeout
                        elif now > deadline:
                            return False
            return True
        return self._until_with_clock(done, timeout, tick, tick_seconds, idle_after)

    def _until_with_clock(
        self,
        done: Callable[[], bool],
        timeout: float | None,
        tick: Callable[[float], bool] | None,
        tick_seconds: float,
        idle_after: float | None,
    ) -> bool:
        """:meth:`until` reading the clock at every poll past the spin (ticks and idle sleeps need it)."""
        for _ in range(self.spin):
            if done():
                return True
        yields = self.yields
        start = time.monotonic()
        deadline = start + timeout if timeout is not None else float("inf")
        idle = start + idle_after if idle_after is not None else float("inf")
        next_tick = start + tick_seconds
        delay = _FIRST_IDLE_SLEEP
        polls = 0
        while True:
            if done():
                return True
            now = time.monotonic()
            if tick is not None and now >= next_tick:
                if tick(now):
                    return True
                next_tick = time.monotonic() + tick_seconds
            if now >= deadline:
                return False
            polls += 1
            if now < idle:
                pause(polls, 0, yields)
            else:
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, MAX_IDLE_SLEEP)
