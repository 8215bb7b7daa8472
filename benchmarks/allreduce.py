"""All-reduce benchmark: mpistrat against raw mpi4py, in the same run.

    mpiexec -n 2 python benchmarks/allreduce.py
    mpiexec -n 4 python benchmarks/allreduce.py [--max-size 64M] [--budget 0.6] [--implementation AUTO]

Prints, for float32 buffers of 4 KiB..64 MiB, the time per all-reduce, algbw
and busbw (nccl-tests convention: algbw = bytes / time, busbw = algbw *
2(n-1)/n) of every measured function, and each one's busbw ratio to raw
``Allreduce(IN_PLACE)``; then 100 arrays of 4 KiB in one fused call against
100 raw calls, and the cost of the agreement check alone.

Timing: warm-up first; then every iteration starts with a barrier, each rank
times the call, the slowest rank's time counts, and the median over
iterations is reported. The measured functions run interleaved on the same
buffers, so they see the same machine state.

To add a column, add a function ``setup(ctx, buf) -> callable`` to
:data:`MEASURED` (e.g. ``all_reduce`` inside ``strategy.run``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from mpi4py import MPI

from mpistrat.comm.communicator import RankCommunicator
from mpistrat.comm.options import CommunicationOptions


@dataclass
class Context:
    """What a measured function may use."""

    world: MPI.Comm
    rc: RankCommunicator


def raw_allreduce(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """Raw mpi4py ``Allreduce(IN_PLACE)`` (the reference)."""
    comm = ctx.world
    return lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)


def rank_communicator(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """``RankCommunicator.allreduce([buf], "sum")`` (checked; result in a new array)."""
    rc = ctx.rc
    return lambda: rc.allreduce([buf], "sum")


def rank_communicator_inplace(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """``RankCommunicator.allreduce([buf], "sum", inplace=True)``."""
    rc = ctx.rc
    return lambda: rc.allreduce([buf], "sum", inplace=True)


# name -> setup; the first entry is the reference for the ratios.
MEASURED: dict[str, Callable[[Context, np.ndarray], Callable[[], None]]] = {
    "raw mpi4py": raw_allreduce,
    "RankCommunicator": rank_communicator,
    "RankComm inplace": rank_communicator_inplace,
}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def timed(world: MPI.Comm, fns: list[Callable[[], None]], iters: int) -> list[float]:
    """Median (over iterations) of the slowest rank's time of each function, interleaved."""
    times = np.zeros((iters, len(fns)))
    for i in range(iters):
        for j, fn in enumerate(fns):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times[i, j] = time.perf_counter() - t0
    world.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return [statistics.median(times[:, j]) for j in range(len(fns))]


def choose_iters(world: MPI.Comm, fns: list[Callable[[], None]], budget: float) -> int:
    """Warm up, then pick an iteration count so one measurement takes about ``budget`` seconds."""
    for fn in fns:
        fn()
    est = timed(world, fns, 3)
    per_iter = sum(est) + 20e-6 * len(fns)
    return int(min(500, max(5, budget / per_iter)))


def busbw(nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    alg = nbytes / seconds / 1e9
    return alg, alg * 2 * (n - 1) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="64M")
    parser.add_argument("--budget", type=float, default=0.6, help="seconds per size (all functions together)")
    parser.add_argument("--implementation", default="AUTO", help="CommunicationImplementation for RankCommunicator")
    parser.add_argument("--fused-count", type=int, default=100)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    rc = RankCommunicator(world, CommunicationOptions(implementation=args.implementation))
    ctx = Context(world, rc)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# mpistrat all-reduce benchmark: {n} ranks, float32, {MPI.Get_library_version().splitlines()[0]}")
    described = [b.name + (f"(min_bytes={b.min_bytes}, sync={b.sync_kind})" if hasattr(b, "min_bytes") else "")
                 for b in rc._host_backends]
    say(f"# RankCommunicator backends: {described}; implementation={args.implementation}")
    say("# time = median over iterations of the slowest rank; busbw = algbw * 2(n-1)/n; ratio = busbw / raw busbw")
    names = list(MEASURED)
    header = f"{'size':>9} {'iters':>5}"
    for name in names:
        header += f" | {name:>17} {'algbw':>6} {'busbw':>6}"
        if name != names[0]:
            header += f" {'ratio':>5}"
    say(header)
    say(f"{'':>9} {'':>5}" + "".join(f" | {'(us)':>17} {'GB/s':>6} {'GB/s':>6}" + (" " * 6 if i else "")
                                       for i, _ in enumerate(names)))
    size = parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        buf = np.zeros(size // 4, dtype=np.float32)  # zeros: repeated in-place sums stay finite
        fns = [MEASURED[name](ctx, buf) for name in names]
        iters = choose_iters(world, fns, args.budget)
        medians = timed(world, fns, iters)
        line = f"{human(size):>9} {iters:>5}"
        ref = busbw(size, medians[0], n)[1]
        for j, t in enumerate(medians):
            alg, bus = busbw(size, t, n)
            line += f" | {t * 1e6:>17.1f} {alg:>6.2f} {bus:>6.2f}"
            if j:
                line += f" {bus / ref:>5.2f}"
        say(line, flush=True)
        size *= 4

    # 100 small arrays: one fused call against one raw call per array.
    count = args.fused_count
    arrays = [np.zeros(1024, dtype=np.float32) for _ in range(count)]

    def raw_many() -> None:
        for a in arrays:
            world.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    fns = [raw_many, lambda: rc.allreduce(arrays, "sum"), lambda: rc.allreduce(arrays, "sum", inplace=True)]
    iters = choose_iters(world, fns, 2 * args.budget)
    raw_t, fused_t, fused_in_t = timed(world, fns, iters)
    say(f"\n{count} x 4 KiB float32 ({iters} iterations):")
    say(f"  {count} raw Allreduce(IN_PLACE) calls: {raw_t * 1e3:8.3f} ms")
    say(f"  one fused RankCommunicator call:  {fused_t * 1e3:8.3f} ms  ({raw_t / fused_t:.1f}x faster)")
    say(f"  same, inplace=True:               {fused_in_t * 1e3:8.3f} ms  ({raw_t / fused_in_t:.1f}x faster)")

    # The agreement check alone (one tiny non-blocking collective).
    key = ("allreduce", (("op", "sum"),), (((1024,), "<f4"),))
    guard = rc._guard
    if guard is not None:
        def check() -> None:
            guard.check(key, 60.0)

        small = np.ones(1, np.float32)
        fns = [check, lambda: world.Allreduce(MPI.IN_PLACE, small, MPI.SUM), world.Barrier]
        iters = choose_iters(world, fns, args.budget)
        check_t, tiny_t, barrier_t = timed(world, fns, iters)
        say(f"\nagreement check: {check_t * 1e6:.1f} us per call "
            f"(raw 4-byte Allreduce {tiny_t * 1e6:.1f} us, raw Barrier {barrier_t * 1e6:.1f} us)")
    rc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
