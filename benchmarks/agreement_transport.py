"""The agreement check's transport: MPI all-gather against node shared memory, with and without the fold.

    mpiexec -bind-to core -n 4 python benchmarks/agreement_transport.py [--iters 200]

Every ``all_reduce`` inside ``strategy.run`` first checks that all ranks agree
(comm/agreement/). On one node that check goes through shared memory
(comm/agreement/shm_allgather.py), and a repeated call to the shared-memory
transport lets the check stand for the window's first synchronisation (the
fold: ``Transport.folds_agreement``, comm/agreement/call.py). This prints, interleaved in one run, the time of
one ``all_reduce`` inside ``strategy.run`` for a list of 100 x 4 KiB and for
one 1 MiB array, with:

* ``mpi``: the MPI all-gather (``MPISTRAT_AGREEMENT=mpi``, as across nodes);
* ``shm``: the shared-memory check, the fold turned off;
* ``shm+fold``: the default on one node;

next to raw mpi4py (100 ``Allreduce`` calls, one 1 MiB ``Allreduce``), and
each one's speed-up over ``mpi`` (ratio of medians; paired: see
allreduce.paired_ratio).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpistrat as ms
from allreduce import paired_ratio, samples

AGREEMENT_ENV = "MPISTRAT_AGREEMENT"


def strategy_with_check(transport: str) -> ms.MultiWorkerMirroredStrategy:
    """A strategy whose communicator checks through ``transport`` ("mpi" or "auto")."""
    before = os.environ.get(AGREEMENT_ENV)
    os.environ[AGREEMENT_ENV] = transport
    try:
        return ms.MultiWorkerMirroredStrategy()
    finally:
        if before is None:
            del os.environ[AGREEMENT_ENV]
        else:
            os.environ[AGREEMENT_ENV] = before


def step(strategy: ms.MultiWorkerMirroredStrategy, data: Any, fold: bool = True) -> Callable[[], Any]:
    """``strategy.run`` of one ``all_reduce("sum", data)``; ``fold=False`` turns the fold off for it."""
    transport = strategy.extended._communicator.transports[0]
    get = ms.get_replica_context

    def reduce() -> Any:
        return get().all_reduce("sum", data)

    def run() -> Any:
        transport.folds_agreement = fold
        return strategy.run(reduce)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    by_mpi, by_shm = strategy_with_check("mpi"), strategy_with_check("auto")
    transports = [s.extended._communicator._guard.transport for s in (by_mpi, by_shm)]
    say = print if world.rank == 0 else (lambda *a, **k: None)
    say(f"# {world.size} ranks; checks through {transports}; median of the slowest rank, us")
    if transports[1] != "shm":
        say("# the ranks span more than one node: no shared-memory check to compare")
        return 0
    small = [np.zeros(1024, np.float32) for _ in range(100)]
    big = np.zeros(1 << 18, np.float32)

    def raw_many() -> None:
        for a in small:
            world.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    for label, data, raw in (("100 x 4 KiB", small, raw_many),
                             ("1 MiB", big, lambda: world.Allreduce(MPI.IN_PLACE, big, MPI.SUM))):
        fns = [step(by_mpi, data), step(by_shm, data, fold=False), step(by_shm, data), raw]
        for fn in fns * 10:  # warm-up: plans cached, windows grown
            fn()
        times = samples(world, fns, args.iters)
        medians = [statistics.median(times[:, j]) * 1e6 for j in range(len(fns))]
        say(f"{label:>12}: mpi {medians[0]:7.1f} | shm {medians[1]:7.1f} ({medians[0] / medians[1]:.2f}x, paired "
            f"{paired_ratio(times, 1):.2f}x) | shm+fold {medians[2]:7.1f} ({medians[0] / medians[2]:.2f}x, paired "
            f"{paired_ratio(times, 2):.2f}x) | raw mpi4py {medians[3]:7.1f}")
    del by_shm.extended._communicator.transports[0].folds_agreement  # the class's answer again
    return 0


if __name__ == "__main__":
    sys.exit(main())
