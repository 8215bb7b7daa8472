"""How a rank waits for its peers on one machine: spin, then yield, then sleep.

The node synchronisation (``shm_window.CounterSync``) and the cross-node wait
of ``shm_allreduce`` poll shared memory or an MPI request in a loop. Between
unsuccessful polls they :func:`pause`:

* first ``spin`` polls with no pause (:func:`default_spin`: none when the
  ranks outnumber this process's cores, else 100);
* then ``os.sched_yield()`` on every poll, so the CPU goes to a rank that
  computes;
* then, after ``yields`` yields, a short sleep (``SLEEP_SECONDS``) per poll,
  where the ranks of the machine outnumber its cores (:func:`default_yields`).

Why the sleep: under Linux's EEVDF scheduler (6.6 and later) ``sched_yield``
hands the CPU to a runnable task only if that task is *eligible*, that is,
it has had no more than its share of the CPU. Two ranks that never sleep
keep their CPU-time difference, so a waiting rank that has run less than
the peer it waits for gets the CPU straight back, and spins until its
vruntime catches up, up to a whole slice (0.75 ms x (1 + log2 CPUs): 1.5 ms
on 2 CPUs). Measured, 4 ranks on 2 cores, a 64 MiB all-reduce (64 chunks,
128 synchronisations): in 3 of 7 runs every synchronisation cost about a
slice, 168-181 ms per call instead of 29-33 ms, while the two ranks of the
waiting core switched 100 times more often than the two ranks of the other.
A sleeping task leaves the run queue, so its peer runs whatever its share:
32 yields, then sleeps, gave 28-39 ms in 7 of 7 runs, and no change at 1-4 MiB.
"""

from __future__ import annotations

import os
import time

from mpi4py import MPI

__all__ = [
    "SLEEP_SECONDS",
    "OVERSUBSCRIBED_YIELDS",
    "default_spin",
    "default_yields",
    "pause",
    "reads_clock",
    "ranks_outnumber_cores",
]

SLEEP_SECONDS = 20e-6  # asked for; the kernel's default timer slack makes it about 70 us
OVERSUBSCRIBED_YIELDS = 32  # about 15-30 us of yields before sleeping


def default_spin(ranks_on_machine: int) -> int:
    """Polls before yielding: 0 when ranks outnumber this process's cores, else 100.

    A short spin: when other jobs share the cores, a long spin burns the slice
    the awaited peer needs (2.8 ms per 4 KiB call at 2000 polls on a loaded
    2-core machine); an idle machine pays one cheap ``sched_yield`` per poll.
    """
    return 0 if ranks_on_machine > len(_affinity()) else 100


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
    """Whether a wait with a timeout reads the clock after the ``polls``-th poll (past ``spin``): at the
    first pause (its deadline starts), every 1024th, and every one once it sleeps (a sleep costs far
    more than the clock; checked only every 1024 sleeps, a timeout would come some 70 ms late)."""
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
