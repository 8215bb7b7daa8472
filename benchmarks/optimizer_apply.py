"""An optimizer step's cost per variable: ``apply_gradients`` inside ``strategy.run`` against raw NumPy.

    python benchmarks/optimizer_apply.py [--variables 100] [--size 64K] [--iters 200] [--warm]
    mpiexec -bind-to core -n 2 python benchmarks/optimizer_apply.py

``--variables`` float32 variables of ``--size`` bytes each (a ``MultiWorkerMirroredStrategy``
model, plain SGD) and as many gradients. Two calls alternate, each timed on every rank, the slowest
rank's time counting (``allreduce.py``'s ``samples``: a barrier before each call, a new random
order every iteration):

* ``raw``: ``p -= lr * g`` over NumPy copies of the weights (what a hand-written loop does);
* ``apply_gradients``: ``strategy.run`` of a step calling
  ``optimizer.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)``
  (``merge_call``, then every variable's update in cross-replica context).

Before each call a pass over a 64 MiB array evicts the caches, as a training step's forward and
backward do before its update (``--warm`` leaves it out). Printed: the median time of each, and the
overhead per variable = (apply_gradients - raw) / variables, from the medians and paired (median over
iterations of the difference). Both do the same arithmetic (an in-place subtraction per variable),
so the difference is the framework's Python, which runs with cold caches after the data went by.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from allreduce import parse_size, samples
from mpi4py import MPI

import mpistrat as ms
from mpistrat.optimizers import SGD

EVICT_BYTES = 64 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variables", type=int, default=100)
    parser.add_argument("--size", default="64K", help="bytes per variable")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warm", action="store_true", help="no cache-evicting pass before each call")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    n = parse_size(args.size) // 4
    rng = np.random.default_rng(0)
    with strategy.scope():
        variables = [ms.Variable(rng.standard_normal(n).astype(np.float32)) for _ in range(args.variables)]
        optimizer = SGD(1e-6)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(args.variables)]
    params = [np.array(v.numpy()) for v in variables]
    lr = optimizer.learning_rate
    evict = np.zeros(EVICT_BYTES // 8)

    def cold(fn):
        if args.warm:
            return fn

        def call() -> None:
            evict.__iadd__(1.0)
            fn()
        return call

    def raw() -> None:
        for p, g in zip(params, grads):
            p -= lr * g

    def step() -> None:
        optimizer.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)

    fns = [cold(raw), cold(lambda: strategy.run(step))]
    for fn in fns:
        for _ in range(5):
            fn()
    times = samples(world, fns, args.iters)
    # The eviction pass is in both calls' times; their difference is what the comparison reads.
    medians = np.median(times, axis=0)
    per_var = (medians[1] - medians[0]) / args.variables
    paired = float(np.median(times[:, 1] - times[:, 0])) / args.variables
    if world.Get_rank() == 0:
        print(f"# {world.Get_size()} rank(s), {args.variables} float32 variables of {args.size}, SGD, "
              f"{args.iters} iterations, {'warm' if args.warm else 'caches evicted before each call'}")
        print(f"raw p -= lr * g           {medians[0] * 1e3:8.3f} ms")
        print(f"apply_gradients in run    {medians[1] * 1e3:8.3f} ms")
        print(f"overhead per variable     {per_var * 1e6:8.1f} us  (paired {paired * 1e6:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
