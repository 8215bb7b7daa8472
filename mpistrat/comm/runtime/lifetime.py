"""Releasing what a dropped communicator holds, collectively and safely.

A finalizer only files a dropped communicator's :class:`Resources` (:func:`track`); the next
collective point over its ranks releases them, in one order on every rank (:func:`release_dropped`).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from mpi4py import MPI

__all__ = ["Resources", "group_key", "track", "release_dropped", "dropped_count"]

# Per group of ranks: how many communicators were created on it (serials agree
# across ranks: communicators are created collectively, in program order).
_SERIALS: dict[tuple[int, ...], int] = {}
# Resources of communicators dropped without close(), waiting for a collective point.
_DROPPED: list["Resources"] = []


def group_key(comm: MPI.Comm) -> tuple[int, ...]:
    """The ``COMM_WORLD`` ranks of ``comm``'s processes, in its rank order."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(group.Translate_ranks(list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


class Resources:
    """What one communicator must release collectively: its duplicate of the communicator, its
    topology's communicators, the agreement guard, the host and device transports."""

    __slots__ = ("key", "serial", "comm", "guard", "transports", "topology", "device", "released")

    def __init__(self, comm: MPI.Comm, guard: Any, transports: list, topology: Any = None,
                 key: tuple[int, ...] | None = None) -> None:
        self.key = group_key(comm) if key is None else key
        self.serial = _SERIALS.get(self.key, 0) + 1
        _SERIALS[self.key] = self.serial
        self.comm = comm
        self.guard = guard
        self.transports = transports
        self.topology = topology
        self.device: list = []
        self.released = False

    def release(self) -> None:
        """Release everything (collective over ``comm``; idempotent).

        A guard that broke (a timeout or a failed close) means peers may be
        gone: only local clean-up then, no shared windows or ``Comm.Free``.
        """
        if self.released:
            return
        self.released = True
        broken = self.guard is not None and self.guard.broken is not None
        if self.guard is not None:
            self.guard.close()
        if broken:
            return
        for transport in self.device + self.transports:
            transport.close()
        if self.topology is not None:
            self.topology.free()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def _file_dropped(resources: Resources) -> None:
    if resources.released:
        return
    if resources.guard is not None and resources.guard.broken is not None:
        resources.release()  # broken: only local clean-up, which needs no peers (and they may never file it)
        return
    _DROPPED.append(resources)


def track(owner: object, resources: Resources) -> weakref.finalize:
    """File ``resources`` as dropped when ``owner`` is garbage-collected (not at exit).

    A :class:`~mpistrat.comm.communicator.RankCommunicator` owns resources whose
    release is collective: node shared-memory windows (``Win.Free``), duplicated
    communicators, the agreement guard's persistent request. ``close()`` releases
    them at once. A communicator that is simply dropped (its strategy goes out of
    scope) cannot do that in a finalizer: strategies hold reference cycles, so the
    garbage collector finalizes them at a different moment on every rank, and a
    collective started on one rank alone would hang. So the finalizer only files
    the communicator's :class:`Resources` as dropped (no MPI call), for
    :func:`release_dropped`.

    Call ``detach()`` on the returned finalizer once released explicitly.
    """
    finalizer = weakref.finalize(owner, _file_dropped, resources)
    finalizer.atexit = False
    return finalizer


def dropped_count() -> int:
    """How many dropped communicators await release on this rank (over any ranks)."""
    return len(_DROPPED)


def release_dropped(comm: MPI.Comm | None = None) -> int:
    """Release the dropped communicators over ``comm``'s ranks or a subset of them (collective).

    A communicator is released once every rank it spans has dropped it.
    Returns how many this rank released. Communicators dropped on some of
    their ranks only stay filed for a later call.

    Every collective point over the same ranks or a superset of them (the
    creation of another communicator there, or this call) runs the garbage
    collector, agrees in one small ``allgather`` on what every rank has dropped,
    and releases exactly that: a communicator over a subset of the ranks (a
    strategy on a ``Split`` of them) is released once every rank of that subset
    has dropped it, so a strategy on a sub-communicator that is never rebuilt
    does not hold its windows and communicators until exit. Releases run in one
    order on every rank (by group, then creation order), so their collectives on
    different communicators cannot cross. Whatever is still held at exit is freed
    there (shared windows by :mod:`~mpistrat.comm.runtime.shm_window`'s exit hook,
    the rest by ``MPI_Finalize``).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    gc.collect()  # finalize unreachable strategies now, on every rank
    ranks = set(group_key(comm))
    mine = [(r.key, r.serial) for r in _DROPPED if ranks.issuperset(r.key)]
    # Who filed each (group, serial): released where every rank of the group did.
    filed: dict[tuple, set[int]] = {}
    for world_rank, theirs in comm.allgather((MPI.COMM_WORLD.Get_rank(), mine)):
        for entry in theirs:
            filed.setdefault(entry, set()).add(world_rank)
    everywhere = {entry for entry, by in filed.items() if by.issuperset(entry[0])}
    if not everywhere:
        return 0
    chosen = sorted((r for r in _DROPPED if (r.key, r.serial) in everywhere), key=lambda r: (r.key, r.serial))
    _DROPPED[:] = [r for r in _DROPPED if (r.key, r.serial) not in everywhere]
    for resources in chosen:  # one order on every rank: collectives on different communicators never cross
        resources.release()
    return len(chosen)

