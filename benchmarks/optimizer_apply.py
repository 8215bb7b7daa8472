"""An optimizer step's cost per variable: ``apply_gradients`` inside ``strategy.run`` against raw NumPy.

    python benchmarks/optimizer_apply.py [--variables 100] [--size 64K] [--iters 200] [--warm]
                                         [--mlp] [--optimizer sgd|momentum|adam]
    mpiexec -bind-to core -n 2 python benchmarks/optimizer_apply.py

``--variables`` float32 variables of ``--size`` bytes each (a ``MultiWorkerMirroredStrategy`` model;
``--mlp``: instead the 8 weights of ``train_step.py``'s MLP, 40 bytes to 4 MiB) and as many
gradients. Two calls alternate, each timed on every rank, the slowest rank's time counting
(``allreduce.py``'s ``samples``: a barrier before each call, a new random order every iteration):

* ``raw``: the rule over NumPy copies of the weights, written as a hand-written loop does
  (``p -= lr * g``; momentum ``v[...] = mu * v - lr * g; p += v``; Adam's three expressions);
* ``apply_gradients``: ``strategy.run`` of a step calling
  ``optimizer.apply_gradients(zip(grads, variables), experimental_aggregate_gradients=False)``
  (``merge_call``, then every variable's update in cross-replica context).

Before each call a pass over a 64 MiB array evicts the caches, as a training step's forward and
backward do before its update (``--warm`` leaves it out). Printed: the median time of each, and the
difference per variable = (apply_gradients - raw) / variables, from the medians and paired (median
over iterations of the difference). For SGD on variables that fit in the L2 cache with their
temporaries, both move the same memory and the difference is the framework's Python, which runs cold
after the data went by. The optimizers update block by block (``train/kernels.py``), which keeps
the temporaries in cache: on larger variables, and with momentum or Adam, the difference can be negative.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from allreduce import parse_size, samples
from mpi4py import MPI

import mpistrat as ms
from mpistrat.optimizers import SGD, Adam

EVICT_BYTES = 64 << 20
MLP_SIZES = (784, 1024, 1024, 1024, 10)  # train_step.py's LAYER_SIZES
LR, MU, B1, B2, EPS = 1e-6, 0.9, 0.9, 0.999, 1e-7


def _sgd(p: np.ndarray, g: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    p -= LR * g


def _momentum(p: np.ndarray, g: np.ndarray, v: np.ndarray, _: np.ndarray) -> None:
    v[...] = MU * v - LR * g
    p += v


def _adam(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    m[...] = B1 * m + (1 - B1) * g
    v[...] = B2 * v + (1 - B2) * (g * g)
    p -= LR * m / (np.sqrt(v) + EPS)  # without the bias correction's two scalars


RAW_RULES = {"sgd": _sgd, "momentum": _momentum, "adam": _adam}  # as a hand-written loop does them


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variables", type=int, default=100)
    parser.add_argument("--size", default="64K", help="bytes per variable")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warm", action="store_true", help="no cache-evicting pass before each call")
    parser.add_argument("--mlp", action="store_true", help="the shapes of train_step.py's MLP instead")
    parser.add_argument("--optimizer", choices=sorted(RAW_RULES), default="sgd",
                        help="SGD, SGD with momentum 0.9, or Adam; raw: the same rule in NumPy expressions")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    if args.mlp:
        shapes = [s for a, b in zip(MLP_SIZES, MLP_SIZES[1:]) for s in ((a, b), (b,))]
        args.variables, args.size = len(shapes), "the MLP's sizes"
    else:
        shapes = [(parse_size(args.size) // 4,)] * args.variables
    rng = np.random.default_rng(0)
    with strategy.scope():
        variables = [ms.Variable(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        optimizer = {"sgd": lambda: SGD(1e-6), "momentum": lambda: SGD(1e-6, momentum=0.9),
                     "adam": lambda: Adam(1e-6)}[args.optimizer]()
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [np.array(v.numpy()) for v in variables]
    state = [(np.zeros(s, np.float32), np.zeros(s, np.float32)) for s in shapes]
    rule = RAW_RULES[args.optimizer]
    evict = np.zeros(EVICT_BYTES // 8)

    def cold(fn):
        if args.warm:
            return fn

        def call() -> None:
            evict.__iadd__(1.0)
            fn()
        return call

    def raw() -> None:
        for p, g, (a, b) in zip(params, grads, state):
            rule(p, g, a, b)

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
        print(f"# {world.Get_size()} rank(s), {args.variables} float32 variables of {args.size}, "
              f"{args.optimizer}, {args.iters} iterations, "
              f"{'warm' if args.warm else 'caches evicted before each call'}")
        print(f"raw NumPy expressions     {medians[0] * 1e3:8.3f} ms")
        print(f"apply_gradients in run    {medians[1] * 1e3:8.3f} ms")
        print(f"overhead per variable     {per_var * 1e6:8.1f} us  (paired {paired * 1e6:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
