"""GPU all-reduce benchmark: CuPy buffers through mpistrat against raw mpi4py on the same buffers, in the same run.

    mpiexec -n 2 python benchmarks/gpu_allreduce.py [--max-size 256M] [--budget 0.3]
    python benchmarks/gpu_allreduce.py            # one rank: the in-rank paths only

Columns, for float32 CuPy buffers of 4 KiB..256 MiB (every rank's buffer on its GPU; ranks share
the visible GPUs round-robin, so two ranks on a one-GPU node both use GPU 0):

* ``raw staged``: what a user writes by hand without CUDA-aware MPI (the reference): copy the
  buffer into a reused page-locked host buffer, ``Allreduce(IN_PLACE)`` there, copy it back;
* ``raw aware``: ``Allreduce(IN_PLACE)`` on the device buffer itself, only where the MPI library
  says it is CUDA-aware (``MPIX_Query_cuda_support``);
* ``strategy``: ``get_replica_context().all_reduce("sum", buf)`` inside
  ``MultiWorkerMirroredStrategy.run`` (a new CuPy result; the input untouched);
* ``rankcomm``: the ``RankCommunicator.allreduce([buf], "sum", inplace=True)`` call alone;
* ``in-rank``: ``MirroredStrategy`` over this rank's GPU (one replica: what one process pays
  around the reduction itself).

Every measured call ends with the current stream synchronised, so a time covers the work on the
GPU. Timing, interleaving, paired ratios and busbw (nccl-tests: algbw * 2(n-1)/n) are those of
``allreduce.py`` (its ``samples``), whose docstring gives the method.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import busbw, choose_iters, human, paired_ratio, parse_size, samples  # noqa: E402

import mpistrat as ms  # noqa: E402
from mpistrat.comm import RankCommunicator  # noqa: E402
from mpistrat.comm.transport.cuda import PinnedStaging, mpi_cuda_support  # noqa: E402


def _sync() -> None:
    import cupy  # noqa: PLC0415

    cupy.cuda.get_current_stream().synchronize()


def raw_staged(world: MPI.Comm, staging: PinnedStaging) -> Callable[[Any], Callable[[], None]]:
    def setup(buf: Any) -> Callable[[], None]:
        host = staging.get(buf.size, buf.dtype)

        def call() -> None:
            buf.get(out=host)
            world.Allreduce(MPI.IN_PLACE, host, MPI.SUM)
            buf.set(host)
            _sync()

        return call

    return setup


def raw_aware(world: MPI.Comm) -> Callable[[Any], Callable[[], None]]:
    def setup(buf: Any) -> Callable[[], None]:
        def call() -> None:
            _sync()
            world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)

        return call

    return setup


def in_strategy(strategy: ms.Strategy) -> Callable[[Any], Callable[[], None]]:
    def setup(buf: Any) -> Callable[[], None]:
        def step() -> Any:
            return ms.get_replica_context().all_reduce("sum", buf)

        def call() -> None:
            strategy.run(step)
            _sync()

        return call

    return setup


def rank_communicator(rc: Any) -> Callable[[Any], Callable[[], None]]:
    def setup(buf: Any) -> Callable[[], None]:
        def call() -> None:
            rc.allreduce([buf], "sum", inplace=True)
            _sync()

        return call

    return setup


def profile(world: MPI.Comm, strategy: ms.Strategy, device: str, size: int, say: Callable[..., None]) -> int:
    """cProfile of 500 ``strategy.run(all_reduce)`` calls of ``size`` bytes (after 50 unprofiled), by own time."""
    import cProfile  # noqa: PLC0415
    import io  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    import cupy  # noqa: PLC0415

    with cupy.cuda.Device(ms.devices.device_index(device)):
        call = in_strategy(strategy)(cupy.zeros(size // 4, cupy.float32))
        for _ in range(50):
            call()
        world.Barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            call()
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    say(f"# cProfile of 500 strategy all_reduce calls of {human(size)}, rank 0, sorted by own time")
    say(text.getvalue())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-size", default="4K")
    parser.add_argument("--max-size", default="256M")
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per size (default 0.3)")
    parser.add_argument("--profile", metavar="SIZE", default=None,
                        help="instead of the table: cProfile 500 strategy calls of SIZE on every rank, rank 0 prints")
    args = parser.parse_args(argv)
    import cupy  # noqa: PLC0415

    world = MPI.COMM_WORLD
    n, rank = world.Get_size(), world.Get_rank()
    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    mwms = ms.MultiWorkerMirroredStrategy()
    device = mwms.extended.worker_devices[0]
    mirrored = ms.MirroredStrategy([device])
    rc = RankCommunicator(world)
    aware = mpi_cuda_support()
    staging = PinnedStaging()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    say(f"# {n} rank(s); this rank's device {device}: {props['name'].decode()}; CuPy {cupy.__version__}, "
        f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}; MPI: {MPI.Get_library_version().splitlines()[0]}; "
        f"CUDA-aware MPI: {aware}")
    if args.profile:
        return profile(world, mwms, device, parse_size(args.profile), say)
    columns: list[tuple[str, Callable[[Any], Callable[[], None]]]] = [("raw staged", raw_staged(world, staging))]
    if aware:
        columns.append(("raw aware", raw_aware(world)))
    columns += [("strategy", in_strategy(mwms)), ("rankcomm", rank_communicator(rc))]
    if n == 1:
        columns.append(("in-rank", in_strategy(mirrored)))
    header = f"| {'size':>8} |" + "".join(f" {name:>11} us | busbw | ratio | pair |" for name, _ in columns)
    say(header)
    say("|" + "---|" * (1 + 4 * len(columns)))
    size = parse_size(args.min_size)
    while size <= parse_size(args.max_size):
        with cupy.cuda.Device(ms.devices.device_index(device)):
            buf = cupy.zeros(size // 4, cupy.float32)  # zeros: repeated sums stay finite
            fns = [setup(buf) for _, setup in columns]
            iters = choose_iters(world, fns, args.budget)
            times = samples(world, fns, iters)
        medians = [statistics.median(times[:, j]) for j in range(len(fns))]
        ref = medians[0]
        cells = []
        for j, t in enumerate(medians):
            bus = busbw(size, t, n)[1]
            cells.append(f" {t * 1e6:14.1f} | {bus:5.1f} | {ref / t:5.2f} | {paired_ratio(times, j):4.2f} |")
        say(f"| {human(size):>8} |" + "".join(cells))
        del buf, fns
        size *= 4
    say(f"# ratio = raw staged median / column median (>1: faster than the hand-staged mpi4py call); "
        f"pair = median of per-iteration ratios; busbw in GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
