"""One ``all_reduce`` of a model's gradient list inside ``strategy.run`` against one raw call per gradient.

    mpiexec -bind-to core -n 2 python benchmarks/gradient_list.py [--iters 40]

The list is ``train_step.py``'s MLP (784 -> 1024 x3 -> 10, float32: 8 arrays, 11.1 MiB). Each
iteration copies the gradients afresh (as backward makes new arrays), waits at a barrier, then times
the strategy's call and the raw calls (``Allreduce(IN_PLACE)`` per array) alternately; the slowest
rank's time counts. Prints the medians and the median over iterations of raw time / strategy time
(a paired ratio), and the buckets the communicator planned.

    mpiexec -bind-to core -n 4 python benchmarks/gradient_list.py --first-lane-ab [--iters 60]

``--first-lane-ab`` times the strategy's call against itself instead, in the same processes: with the
plan's first-step lane (the list's first array reduced by the compiled kernel with the check's round)
and without it (that array through the transport's Python path, the check in its first synchronisation),
alternated, each after a barrier; prints both medians and the paired median of without / with.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

import mpistrat as ms

SHAPES = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--first-lane-ab", action="store_true", help="the first-step lane on against off")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(world.rank)
    base = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    get = ms.get_replica_context

    def step(grads: list) -> list:
        return get().all_reduce("sum", grads)

    def timed_strategy() -> float:
        grads = [b.copy() for b in base]
        world.Barrier()
        t = time.perf_counter()
        strategy.run(step, args=(grads,))
        return world.allreduce(time.perf_counter() - t, MPI.MAX)

    def timed_raw() -> float:
        grads = [b.copy() for b in base]
        world.Barrier()
        t = time.perf_counter()
        for g in grads:
            world.Allreduce(MPI.IN_PLACE, g, MPI.SUM)
        return world.allreduce(time.perf_counter() - t, MPI.MAX)

    for _ in range(5):
        timed_strategy(), timed_raw()
    if args.first_lane_ab:
        first_lane_ab(world, strategy, timed_strategy, args.iters)
        return
    pairs = [(timed_strategy(), timed_raw()) for _ in range(args.iters)]
    if world.rank == 0:
        ts, tr = zip(*pairs)
        plan = max(strategy.extended._communicator._planner._plans.values(), key=lambda p: p.nbytes)
        buckets = ", ".join(f"{s.transport.name} {s.bucket.nbytes / 2**20:.2f} MiB x{len(s.members)}" for s in plan.steps)
        print(f"{world.size} ranks, {sum(b.nbytes for b in base) / 2**20:.1f} MiB in {len(base)} arrays: "
              f"strategy {statistics.median(ts) * 1e3:.2f} ms, raw {statistics.median(tr) * 1e3:.2f} ms, "
              f"raw/strategy {statistics.median(r / s for s, r in pairs):.2f} (paired); buckets: {buckets}")


def first_lane_ab(world: MPI.Comm, strategy: ms.MultiWorkerMirroredStrategy, timed: Callable[[], float],
                  iters: int) -> None:
    """The list's call with its plan's first-step lane and without, alternated (which comes first alternates too)."""
    filed = strategy.extended._communicator._planner.lists.get(("sum", None, len(SHAPES)))
    plan = None if filed is None else filed[1]
    lane = None if plan is None else plan.lane
    if not world.allreduce(lane is not None, MPI.LAND):  # every rank stops, or none
        raise SystemExit("gradient_list.py --first-lane-ab: a rank's plan has no first-step lane (one rank, the "
                         "extension missing, MPISTRAT_COMPILED_LANE=0, or the first array not reduce-scattered)")

    def with_lane(on: bool) -> float:
        plan.lane = lane if on else None
        return timed()

    pairs = []
    try:
        for i in range(iters):
            first = bool(i % 2)
            a = with_lane(first)
            b = with_lane(not first)
            pairs.append((a, b) if first else (b, a))
    finally:
        plan.lane = lane
    if world.rank == 0:
        on, off = zip(*pairs)
        print(f"{world.size} ranks, {len(SHAPES)} arrays: with the first-step lane {statistics.median(on) * 1e3:.2f} "
              f"ms, without {statistics.median(off) * 1e3:.2f} ms, without / with "
              f"{statistics.median(b / a for a, b in pairs):.3f} (paired)")


if __name__ == "__main__":
    main()
