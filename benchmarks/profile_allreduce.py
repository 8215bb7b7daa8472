"""Profile one all-reduce path per rank: where the microseconds of a call go.

    mpiexec -bind-to core -n 2 python benchmarks/profile_allreduce.py --path strategy --size 4K --calls 20000
    mpiexec -bind-to core -n 2 python benchmarks/profile_allreduce.py --path rankcomm --size 1M --cprofile
    mpiexec -bind-to core -n 2 py-spy record --native --format raw -o /tmp/s.%r.txt -- \\
        python benchmarks/profile_allreduce.py --path strategy --size 16M --calls 400

``--path``: ``strategy`` (``get_replica_context().all_reduce("sum", buf)`` inside
``MultiWorkerMirroredStrategy.run``, a new result, the input untouched), ``rankcomm``
(``RankCommunicator.allreduce([buf], "sum")``, the call the strategy makes) or ``raw``
(``Allreduce(IN_PLACE)``). Every rank times ``--calls`` calls back to back after a warm-up
(no barrier between calls: the steady state a training loop sees) and prints its time per call;
with ``--cprofile`` each rank then profiles as many calls again and prints its top functions by
own time (cProfile's overhead inflates every Python call; read its counts, and its shares only
against each other). Without it, the loop is what a sampling profiler (``py-spy``, ``perf``)
attached from outside sees.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import numpy as np
from allreduce import parse_size
from mpi4py import MPI

import mpistrat as ms


def make_call(path: str, size: int) -> tuple:
    """The zero-argument call of ``path`` on a zero float32 buffer of ``size`` bytes, and the strategy."""
    world = MPI.COMM_WORLD
    strategy = ms.MultiWorkerMirroredStrategy()
    rc = strategy.extended._communicator
    buf = np.zeros(size // 4, np.float32)
    get = ms.get_replica_context
    if path == "strategy":
        run = strategy.run

        def step() -> object:
            return get().all_reduce("sum", buf)

        return (lambda: run(step)), strategy
    if path == "rankcomm":
        return (lambda: rc.allreduce([buf], "sum")), strategy
    if path == "raw":
        return (lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)), strategy
    raise SystemExit(f"unknown --path {path!r}: strategy, rankcomm or raw")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="strategy")
    parser.add_argument("--size", default="4K")
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--cprofile", action="store_true", help="then profile as many calls with cProfile")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    call, strategy = make_call(args.path, parse_size(args.size))
    for _ in range(max(50, args.calls // 20)):
        call()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    per_call = (time.perf_counter() - t0) / args.calls
    lines = [f"rank {world.Get_rank()}: {args.path} {args.size}: {per_call * 1e6:.1f} us per call "
             f"({args.calls} calls, unprofiled)"]
    if args.cprofile:
        world.Barrier()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        lines.append(text.getvalue())
    for r in range(world.Get_size()):  # one rank at a time, in rank order
        if r == world.Get_rank():
            print("\n".join(lines), flush=True)
        world.Barrier()
    del strategy
    return 0


if __name__ == "__main__":
    sys.exit(main())
