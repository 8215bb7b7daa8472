"""What Python costs on a cold path: small calls timed right after a raw all-reduce of a given size.

    mpiexec -bind-to core -n 2 python benchmarks/cold_path.py [--sizes 4K 1M 4M] [--calls 300]

Before each timed call: a raw ``Allreduce(IN_PLACE)`` of ``--size`` bytes (what the benchmarks'
interleaving, and a training step's compute, leave in the caches), then a barrier. Prints, per size,
the median over ``--calls`` of rank 0's time for: a no-op lambda, ten nested empty Python calls, an
empty ``strategy.run``, and a repeated 4 KiB ``all_reduce`` inside ``strategy.run``. The larger the
preceding transfer, the more of the interpreter's code and objects it evicted, and the more each
Python call on the path costs (benchmarks/README.md, "The lean path of a repeated call").
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from allreduce import parse_size
from mpi4py import MPI

import mpistrat as ms


def nested(depth: int = 10) -> None:
    """``depth`` nested empty Python calls."""
    if depth:
        nested(depth - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "4M"])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    small = np.zeros(1024, np.float32)
    get = ms.get_replica_context

    def step() -> None:
        get().all_reduce("sum", small)

    for _ in range(5):
        strategy.run(step)  # planned: the timed calls are repeats
    cases = {"no-op": lambda: None, "10 nested calls": nested, "strategy.run(empty)": lambda: strategy.run(lambda: None),
             "strategy.run(all_reduce 4K)": lambda: strategy.run(step)}
    for size in args.sizes:
        buf = np.zeros(parse_size(size) // 4, np.float32)
        medians = {}
        for name, fn in cases.items():
            times = []
            for _ in range(args.calls):
                world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            medians[name] = float(np.median(times)) * 1e6
        if world.Get_rank() == 0:
            print(f"after {size:>4}: " + ", ".join(f"{k} {v:.1f} us" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
