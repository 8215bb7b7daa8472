"""One ``all_reduce`` of a model's gradient list inside ``strategy.run`` against one raw call per gradient.

    mpiexec -bind-to core -n 2 python benchmarks/gradient_list.py [--iters 40]

The list is ``train_step.py``'s MLP (784 -> 1024 x3 -> 10, float32: 8 arrays, 11.1 MiB). Each
iteration copies the gradients afresh (as backward makes new arrays), waits at a barrier, then times
the strategy's call and the raw calls (``Allreduce(IN_PLACE)`` per array) alternately; the slowest
rank's time counts. Prints the medians and the median over iterations of raw time / strategy time
(a paired ratio), and the buckets the communicator planned.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpistrat as ms

SHAPES = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=40)
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
    pairs = [(timed_strategy(), timed_raw()) for _ in range(args.iters)]
    if world.rank == 0:
        ts, tr = zip(*pairs)
        plan = max(strategy.extended._communicator._planner._plans.values(), key=lambda p: p.nbytes)
        buckets = ", ".join(f"{s.transport.name} {s.bucket.nbytes / 2**20:.2f} MiB x{len(s.members)}" for s in plan.steps)
        print(f"{world.size} ranks, {sum(b.nbytes for b in base) / 2**20:.1f} MiB in {len(base)} arrays: "
              f"strategy {statistics.median(ts) * 1e3:.2f} ms, raw {statistics.median(tr) * 1e3:.2f} ms, "
              f"raw/strategy {statistics.median(r / s for s, r in pairs):.2f} (paired); buckets: {buckets}")


if __name__ == "__main__":
    main()
