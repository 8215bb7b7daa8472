"""All-reduce benchmark: mpistrat against raw mpi4py, in the same run.

    mpiexec -n 2 python benchmarks/allreduce.py
    mpiexec -n 4 python benchmarks/allreduce.py [--max-size 64M] [--budget 0.6] [--implementation AUTO]
        [--columns strategy,window] [--plot busbw.png]
    mpiexec -n 2 python benchmarks/allreduce.py --columns strategy,deterministic --max-size 16M

Prints, for float32 buffers of 4 KiB..64 MiB, the time per all-reduce, algbw
and busbw (nccl-tests convention: algbw = bytes / time, busbw = algbw *
2(n-1)/n) of every measured function, and each one's busbw ratio to raw
``Allreduce(IN_PLACE)`` (the reference, always measured):

* ``strategy``: ``get_replica_context().all_reduce("sum", buf)`` inside
  ``MultiWorkerMirroredStrategy.run`` (what a training step calls; the
  result is a new array, the input is untouched);
* ``rankcomm``: the ``RankCommunicator.allreduce([buf], "sum")`` call the
  strategy makes, without the strategy around it;
* ``inplace``: the same with ``inplace=True``;
* ``deterministic``: the ``strategy`` call with
  ``options=CommunicationOptions(deterministic=True)``; with the ``strategy``
  column too, ``det/def`` is the median over iterations of its time over the
  ``strategy`` call's in the same iteration (its cost over the default path);
* ``window``: the node shared-memory window path on data already packed
  into the window (as fusion packs a bucket), forced on at every size; the
  ``auto`` column is the path the size threshold picks (window or raw MPI)
  and its ratio.

Then 100 arrays of 4 KiB: 100 raw calls against one fused ``all_reduce`` of
the list inside ``strategy.run`` and one fused ``RankCommunicator`` call;
then the cost of the agreement check alone.

Timing: warm-up first; then every iteration starts with a barrier, each rank
times the call, the slowest rank's time counts, and the median over
iterations is reported. The measured functions run interleaved on the same
buffers, in a new random order every iteration (see samples), so they see the same
machine state. Each ratio is given twice: ``ratio`` from the medians, and
``pair``, the median of the per-iteration ratios of calls made back to back
(robust to a machine that changes speed during the run; see paired_ratio).

To add a column, add a function ``setup(ctx, buf) -> callable`` to
:data:`MEASURED`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import mpistrat as ms
from mpistrat.comm import CommunicationOptions, RankCommunicator
from mpistrat.comm.transport.shm.allreduce import ShmTransport


@dataclass
class Context:
    """What a measured function may use."""

    world: MPI.Comm
    rc: RankCommunicator  # the strategy's communicator
    strategy: ms.MultiWorkerMirroredStrategy
    window: ShmTransport | None  # forced on at every size; None when not measured


def raw_allreduce(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """Raw mpi4py ``Allreduce(IN_PLACE)`` (the reference)."""
    comm = ctx.world
    return lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)


def strategy_all_reduce(ctx: Context, buf: Any) -> Callable[[], Any]:
    """``strategy.run`` of a step calling ``get_replica_context().all_reduce("sum", buf)``."""
    run = ctx.strategy.run
    get = ms.get_replica_context

    def step() -> Any:
        return get().all_reduce("sum", buf)

    return lambda: run(step)


DETERMINISTIC = CommunicationOptions(deterministic=True)


def strategy_deterministic(ctx: Context, buf: Any) -> Callable[[], Any]:
    """The ``strategy`` column with ``options=CommunicationOptions(deterministic=True)`` (the same bits for
    any layout: an all-reduce MAX of int16 exponents, then an all-reduce SUM of int64, comm/deterministic.py)."""
    run = ctx.strategy.run
    get = ms.get_replica_context

    def step() -> Any:
        return get().all_reduce("sum", buf, options=DETERMINISTIC)

    return lambda: run(step)


def rank_communicator(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """``RankCommunicator.allreduce([buf], "sum")`` (checked; result in a new array)."""
    rc = ctx.rc
    return lambda: rc.allreduce([buf], "sum")


def rank_communicator_inplace(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """``RankCommunicator.allreduce([buf], "sum", inplace=True)``."""
    rc = ctx.rc
    return lambda: rc.allreduce([buf], "sum", inplace=True)


def window_packed(ctx: Context, buf: np.ndarray) -> Callable[[], None]:
    """The shared-window reduce-scatter on a bucket already packed into the window (result left there).

    The window holds zeros (pre-faulted), so repeated sums stay zero and no
    copy is needed inside the timing: this is the reduction fusion pays for
    after packing.
    """
    backend = ctx.window
    assert backend is not None
    count, dtype = buf.size, buf.dtype

    def reduce_packed() -> None:
        backend.pack_buffer(count, dtype)
        backend.allreduce_packed(count, dtype, "sum")

    return reduce_packed


# name -> (column title, setup); "raw" is the reference for the ratios.
MEASURED: dict[str, tuple[str, Callable[[Context, np.ndarray], Callable[[], Any]]]] = {
    "raw": ("raw mpi4py", raw_allreduce),
    "strategy": ("strategy all_reduce", strategy_all_reduce),
    "rankcomm": ("RankCommunicator", rank_communicator),
    "inplace": ("RankComm inplace", rank_communicator_inplace),
    "window": ("shm window", window_packed),
    "deterministic": ("deterministic=True", strategy_deterministic),
}
DEFAULT_COLUMNS = "strategy,window"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def timed(world: MPI.Comm, fns: list[Callable[[], Any]], iters: int) -> list[float]:
    """Median (over iterations) of the slowest rank's time of each function, interleaved (see samples)."""
    times = samples(world, fns, iters)
    return [statistics.median(times[:, j]) for j in range(len(fns))]


def paired_ratio(times: np.ndarray, j: int) -> float:
    """Median over iterations of ``time of function 0 / time of function j`` in the same iteration.

    Each pair ran back to back, so it compares the two in the same machine
    state; a machine that switches speed during the run (this VM does, by 3x
    and more) moves the median of each column, but much less the paired ratio.
    """
    return float(np.median(times[:, 0] / times[:, j]))


SAMPLE_ORDER_SEED = 20261123  # the same on every rank, so every rank calls the collectives in one order


def samples(world: MPI.Comm, fns: list[Callable[[], Any]], iters: int) -> np.ndarray:
    """``[iteration, function]``: the slowest rank's time of each call, the functions interleaved.

    What ran just before a call changes its time a lot here: right after raw
    MPI the caches are full of MPI's buffers (10-25% slower at 1 MiB), and
    with three or more functions the 1 MiB and 4 MiB times of one function
    moved by up to 3x with its predecessor. So no call follows a call of the
    same function (each finds the caches full of another's buffers, as in a
    training step), and each iteration runs the functions in a new random
    order (the same on every rank: a fixed seed), so each function follows
    every other one about equally often. With two functions this is alternation.
    """
    times = np.zeros((iters, len(fns)))
    rng = np.random.default_rng(SAMPLE_ORDER_SEED)
    last = -1
    for i in range(iters):
        order = rng.permutation(len(fns))
        while len(fns) > 1 and order[0] == last:
            order = rng.permutation(len(fns))
        last = order[-1]
        for j in order:
            fn = fns[j]
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times[i, j] = time.perf_counter() - t0
    world.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return times


def choose_iters(world: MPI.Comm, fns: list[Callable[[], Any]], budget: float) -> int:
    """Warm up, then pick an iteration count so one measurement takes about ``budget`` seconds."""
    for fn in fns:
        fn()
    est = timed(world, fns, 3)
    per_iter = sum(est) + 20e-6 * len(fns)
    return int(min(500, max(5, budget / per_iter)))


def busbw(nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    alg = nbytes / seconds / 1e9
    return alg, alg * 2 * (n - 1) / n


def describe_transports(rc: RankCommunicator) -> list[str]:
    return [b.name + (f"(min_bytes={b.min_bytes}, chunk_bytes={'auto' if b.chunk_bytes is None else b.chunk_bytes}, "
                      f"sync={b.sync_kind}, nodes={b.layout.num_nodes})"
                      if isinstance(b, ShmTransport) else "")
            for b in rc.transports]


def size_table(ctx: Context, names: list[str], args: argparse.Namespace,
               say: Callable[..., None]) -> list[tuple[int, list[float]]]:
    """One row per size: time, algbw, busbw of each column and its ratio to raw; returns (size, medians) per row."""
    world, n = ctx.world, ctx.world.Get_size()
    shm = next((b for b in ctx.rc.transports if isinstance(b, ShmTransport)), None)
    auto = "window" in names
    header = f"{'size':>9} {'iters':>5}"
    units = f"{'':>9} {'':>5}"
    for name in names:
        title = MEASURED[name][0]
        header += f" | {title:>19} {'algbw':>6} {'busbw':>6}" + (f" {'ratio':>5} {'pair':>5}" if name != "raw" else "")
        units += f" | {'(us)':>19} {'GB/s':>6} {'GB/s':>6}" + (" " * 12 if name != "raw" else "")
    if auto:
        header += f" | {'auto':>6} {'ratio':>5}"
    versus = "strategy" in names and "deterministic" in names
    if versus:
        header += f" | {'det/def':>7}"
    say(header)
    say(units)
    rows = []
    size = parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        buf = np.zeros(size // 4, dtype=np.float32)  # zeros: repeated in-place sums stay finite
        fns = [MEASURED[name][1](ctx, buf) for name in names]
        iters = choose_iters(world, fns, args.budget)
        times = samples(world, fns, iters)
        medians = [statistics.median(times[:, j]) for j in range(len(fns))]
        line = f"{human(size):>9} {iters:>5}"
        ref = busbw(size, medians[0], n)[1]
        for j, (name, t) in enumerate(zip(names, medians)):
            alg, bus = busbw(size, t, n)
            line += f" | {t * 1e6:>19.1f} {alg:>6.2f} {bus:>6.2f}"
            if name != "raw":
                line += f" {bus / ref:>5.2f} {paired_ratio(times, j):>5.2f}"
        if auto:
            use = shm is not None and shm.enabled(size, np.dtype(np.float32), "sum")
            t = medians[names.index("window")] if use else medians[0]
            line += f" | {'window' if use else 'mpi':>6} {medians[0] / t:>5.2f}"
        if versus:
            det, default = names.index("deterministic"), names.index("strategy")
            line += f" | {float(np.median(times[:, det] / times[:, default])):>7.2f}"
        say(line, flush=True)
        rows.append((size, medians))
        size *= 4
    return rows


def fused_table(ctx: Context, args: argparse.Namespace, say: Callable[..., None]) -> None:
    """``count`` arrays of 4 KiB: raw calls one by one against one fused call."""
    world, rc = ctx.world, ctx.rc
    count = args.fused_count
    arrays = [np.zeros(1024, dtype=np.float32) for _ in range(count)]

    def raw_many() -> None:
        for a in arrays:
            world.Allreduce(MPI.IN_PLACE, a, MPI.SUM)

    fns = [raw_many, strategy_all_reduce(ctx, arrays), lambda: rc.allreduce(arrays, "sum"),
           lambda: rc.allreduce(arrays, "sum", inplace=True)]
    iters = choose_iters(world, fns, 2 * args.budget)
    times = samples(world, fns, iters)
    raw_t = statistics.median(times[:, 0])
    say(f"\n{count} x 4 KiB float32 ({iters} iterations; speed-up = ratio of medians, paired: see paired_ratio):")
    say(f"  {count} raw Allreduce(IN_PLACE) calls:        {raw_t * 1e3:8.3f} ms")
    labels = ["one fused all_reduce in strategy.run:   ", "one fused RankCommunicator call:        ",
              "same, inplace=True:                     "]
    for j, label in enumerate(labels, start=1):
        t = statistics.median(times[:, j])
        say(f"  {label} {t * 1e3:8.3f} ms  ({raw_t / t:.1f}x faster, paired {paired_ratio(times, j):.1f}x)")


def check_cost(ctx: Context, args: argparse.Namespace, say: Callable[..., None]) -> None:
    """The agreement check alone (one tiny non-blocking collective) next to raw tiny collectives."""
    world, guard = ctx.world, ctx.rc._guard
    if guard is None:
        return
    key = ("allreduce", (("op", "sum"),), (((1024,), "<f4"),))
    small = np.ones(1, np.float32)
    fns = [lambda: guard.check(key, 60.0), lambda: world.Allreduce(MPI.IN_PLACE, small, MPI.SUM), world.Barrier]
    iters = choose_iters(world, fns, args.budget)
    check_t, tiny_t, barrier_t = timed(world, fns, iters)
    say(f"\nagreement check: {check_t * 1e6:.1f} us per call "
        f"(raw 4-byte Allreduce {tiny_t * 1e6:.1f} us, raw Barrier {barrier_t * 1e6:.1f} us)")


def plot_busbw(path: str, rows: list[tuple[int, list[float]]], names: list[str], n: int) -> None:
    """A PNG of every column's busbw against the size (``--plot``; matplotlib)."""
    from plotting import line_plot

    sizes = [size for size, _ in rows]
    series = {MEASURED[name][0]: (sizes, [busbw(size, medians[j], n)[1] for size, medians in rows])
              for j, name in enumerate(names)}
    line_plot(path, series, title=f"allreduce.py: float32 all-reduce, {n} ranks (median of the slowest rank)",
              xlabel="bytes per rank", ylabel="busbw (GB/s)", logx=True, xticks=sizes,
              xticklabels=[human(size) for size in sizes])


def plot_available(world: MPI.Comm) -> None:
    """Raise SystemExit on every rank, before measuring, if ``--plot`` cannot work on rank 0."""
    from plotting import PlotUnavailable, pyplot

    error = None
    if world.Get_rank() == 0:
        try:
            pyplot()
        except PlotUnavailable as exc:
            error = str(exc)
    error = world.bcast(error, root=0)
    if error:
        raise SystemExit(f"allreduce.py: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="64M")
    parser.add_argument("--budget", type=float, default=0.6, help="seconds per size (all functions together)")
    parser.add_argument("--implementation", default="AUTO", help="CommunicationImplementation of the strategy")
    parser.add_argument("--columns", default=DEFAULT_COLUMNS,
                        help=f"comma-separated, from {','.join(k for k in MEASURED if k != 'raw')} (raw always)")
    parser.add_argument("--fused-count", type=int, default=100)
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of busbw against size per column (matplotlib)")
    args = parser.parse_args(argv)
    names = ["raw"] + [c.strip() for c in args.columns.split(",") if c.strip() and c.strip() != "raw"]
    unknown = [c for c in names if c not in MEASURED]
    if unknown:
        parser.error(f"unknown column(s) {unknown}; choose from {list(MEASURED)}")
    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    if args.plot:
        plot_available(world)
    options = CommunicationOptions(implementation=args.implementation)
    strategy = ms.MultiWorkerMirroredStrategy(communication_options=options)
    rc = strategy.extended._communicator
    window = None
    if "window" in names:
        window = ShmTransport(world, min_bytes=0, max_bytes=max(parse_size(args.max_size), 1 << 20))
        # The column times the engine: the reduce-scatter at every size, its result left in the window.
        window.direct_max_bytes = -1
    ctx = Context(world, rc, strategy, window)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# mpistrat all-reduce benchmark: {n} ranks, float32, {MPI.Get_library_version().splitlines()[0]}")
    say(f"# strategy's RankCommunicator transports: {describe_transports(rc)}; implementation={args.implementation}")
    say("# time = median over iterations of the slowest rank; busbw = algbw * 2(n-1)/n; ratio = busbw / raw busbw;"
        " pair = median over iterations of raw time / this time, measured back to back")
    rows = size_table(ctx, names, args, say)
    if args.plot and rank == 0:
        plot_busbw(args.plot, rows, names, n)
        say(f"# wrote {args.plot}")
    shm = next((b for b in rc.transports if isinstance(b, ShmTransport)), None)
    if shm is not None and shm.chunk_calibration:
        nbytes, chunk, one_pass, chunked = shm.chunk_calibration[0]
        say(f"# automatic chunks: {human(nbytes)} in one pass {one_pass * 1e3:.2f} ms, in "
            f"{human(chunk)} chunks {chunked * 1e3:.2f} ms -> chunk_bytes={shm.chunk_bytes}")
    fused_table(ctx, args, say)
    check_cost(ctx, args, say)
    if window is not None:
        window.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
