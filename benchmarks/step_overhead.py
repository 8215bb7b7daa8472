"""The Python around a collective: ``strategy.run`` and ``all_reduce`` against the communicator and raw mpi4py.

    mpiexec -n 2 python benchmarks/step_overhead.py [--size 4K] [--arrays 1] [--iters 2000]

Prints, interleaved in one run (median over iterations of the slowest rank, ``allreduce.py``'s
method: a barrier before each call, a new random order of the functions every iteration):
``strategy.run`` of an empty step, of a step calling ``all_reduce`` on
``--arrays`` float32 arrays of ``--size`` bytes, the same reduction through
``RankCommunicator.allreduce`` alone, and raw ``Allreduce(IN_PLACE)`` calls on
the same arrays; each as its time over raw's, from the medians and paired (the median
over iterations of the two calls' ratio, robust to a machine that changes speed). Under
oversubscription (more ranks than cores) each microsecond of Python before a collective
costs several of wall time. Issue 23's target: ``strategy.run(all_reduce)`` of 4 KiB at
most 2x raw.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from allreduce import parse_size, samples
from mpi4py import MPI

import mpistrat as ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4K", help="bytes per array")
    parser.add_argument("--arrays", type=int, default=1)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    rc = strategy.extended._communicator
    arrays = [np.zeros(parse_size(args.size) // 4, np.float32) for _ in range(args.arrays)]
    get = ms.get_replica_context

    def raw() -> None:
        for a in arrays:
            world.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    measured = {
        "raw Allreduce(IN_PLACE)": raw,
        "strategy.run(empty step)": lambda: strategy.run(lambda: None),
        "strategy.run(all_reduce)": lambda: strategy.run(lambda: get().all_reduce("sum", arrays)),
        "RankCommunicator.allreduce": lambda: rc.allreduce(arrays, "sum"),
    }
    fns = list(measured.values())
    for fn in fns:
        for _ in range(20):
            fn()
    times = samples(world, fns, args.iters)
    medians = np.median(times, axis=0)
    if world.Get_rank() == 0:
        print(f"# {world.Get_size()} ranks, {args.arrays} x {args.size} float32, {args.iters} iterations")
        for j, (name, t) in enumerate(zip(measured, medians)):
            paired = float(np.median(times[:, j] / times[:, 0]))
            print(f"{name:28s} {t * 1e6:9.1f} us  {t / medians[0]:5.2f}x raw  (paired {paired:5.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
