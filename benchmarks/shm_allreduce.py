"""Shared-window all-reduce vs raw mpi4py ``Allreduce(IN_PLACE)``, same processes, same run.

Usage (keep the venv's ``mpiexec`` first on PATH)::

    mpiexec -n 2 python benchmarks/shm_allreduce.py
    mpiexec -n 4 python benchmarks/shm_allreduce.py --sync counter
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296 mpiexec -n 2 python benchmarks/shm_allreduce.py
    MPISTRAT_PRETEND_NODES=2 mpiexec -n 4 python benchmarks/shm_allreduce.py   # hierarchical path

For float32 buckets of 4 KiB to 64 MiB it times, per iteration, one raw
``Allreduce(IN_PLACE)`` on a private buffer and one ``allreduce_packed`` of
the ``ShmAllreduceBackend`` on data already packed into the window (as fusion
packs it); the data is copied in before each timed call, outside the timing,
for both. A time is the median over iterations of the slowest rank. busbw
follows nccl-tests: ``algbw * 2 (n-1) / n`` with ``algbw = bytes / time``.
"auto" is the path the backend's size thresholds pick (``enabled``), and its
ratio is what a caller gets. "exact" checks the window result against the raw
result bit for bit on integer-valued float32 data (order-independent sums).

Knobs (see ``mpistrat/comm/shm_allreduce.py``): ``MPISTRAT_SHM_MIN_BYTES``
(default: measured at start-up), ``MPISTRAT_SHM_MAX_BYTES`` (64M),
``MPISTRAT_SHM_BLOCK_BYTES`` (256K), ``MPISTRAT_SHM_SYNC``
(barrier|counter|auto), ``MPISTRAT_PRETEND_NODES``. For the plain MPI path
above 32 MiB set ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296``:
without it glibc maps, faults and unmaps MPICH's message-sized scratch buffer
on every call.

Results on the 2-core development VM (PyPI MPICH 5.0.2, 2026-11-22, shared
with other jobs: load average 5-7 during these runs, so single numbers jump;
two runs per row, shm/raw per size from 4 KiB to 64 MiB)::

    ranks malloc   4K    16K   64K   256K  1M    4M    16M   64M
    2     unset    1.47  2.11  2.41  2.94  0.43* 2.22  2.53  4.20
    2     unset    1.39  1.93  2.24  2.77  3.05  1.00* 3.58  5.38
    2     set      1.43  1.96  2.17  2.72  5.46  6.58  2.89  3.49
    2     set      1.37  2.71  3.65  2.86  3.37  3.67  2.03  2.85
    4     unset    0.75  1.10  1.33  1.77  2.38  2.10  2.99  5.84
    4     unset    0.68  1.10  1.48  3.50  1.55  2.79  2.82  5.35
    4     set      0.59  1.10  1.24  1.92  2.34  2.54  3.23  4.10
    4     set      0.96  1.69  1.64  2.33  1.56  2.13  2.62  4.05
    4, 2 pretend   0.63  0.91  0.94  1.21  1.62  1.45  1.60  2.02   (hierarchical)

(* one-off slow medians in a run where other jobs took the cores; every
result was exact.) The start-up calibration picked min_bytes 16 KiB..1 MiB at
2 ranks and 64 KiB..1 MiB at 4 (once 4 MiB and 16 KiB when the machine was
busiest), so "auto" took plain MPI at 4 KiB, where raw MPICH wins at 4 ranks.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from mpistrat.comm.shm_allreduce import ShmAllreduceBackend, parse_bytes

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _iters(nbytes: int, scale: float) -> int:
    base = 200 if nbytes <= (64 << 10) else 60 if nbytes <= (1 << 20) else 20 if nbytes <= (16 << 20) else 8
    return max(3, int(base * scale))


def _median_of_slowest(comm: MPI.Comm, times: list[float]) -> float:
    t = np.array(times)
    comm.Allreduce(MPI.IN_PLACE, t, op=MPI.MAX)
    return float(np.median(t))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="comma-separated byte counts (K/M suffixes), default 4K..64M")
    p.add_argument("--iters-scale", type=float, default=1.0, help="scale the iteration counts")
    p.add_argument("--sync", default=None, help="barrier | counter | auto (default: MPISTRAT_SHM_SYNC or auto)")
    p.add_argument("--pretend-nodes", type=int, default=None)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n = comm.size
    sizes = [parse_bytes(s, "--sizes") for s in args.sizes.split(",")] if args.sizes else SIZES
    t0 = time.perf_counter()
    backend = ShmAllreduceBackend(comm, pretend_nodes=args.pretend_nodes, sync=args.sync, max_bytes=max(sizes))
    setup = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    lay = backend.layout
    if comm.rank == 0:
        malloc = "set" if os.environ.get("MALLOC_MMAP_MAX_") == "0" else "unset"
        print(
            f"# {n} ranks, {lay.num_nodes} node(s){' (pretend)' if lay.pretend else ''} x {lay.local_size} local, "
            f"sync={backend.sync_kind}, min_bytes={backend.min_bytes} (start-up {setup * 1e3:.0f} ms), "
            f"malloc knobs {malloc}, {MPI.Get_library_version().splitlines()[0]}"
        )
        print(
            f"{'bytes':>9} {'raw us':>9} {'raw busbw':>9} {'shm us':>9} {'shm busbw':>9} {'shm/raw':>7} "
            f"{'auto':>4} {'auto/raw':>8} {'exact':>5}"
        )
    for nbytes in sizes:
        count = nbytes // 4
        src = ((np.arange(count) + comm.rank) % 7 + 1).astype(np.float32)
        private = np.empty(count, np.float32)
        raw_t, shm_t = [], []
        exact = True
        for it in range(_iters(nbytes, args.iters_scale) + 1):
            private[:] = src
            comm.Barrier()
            a = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, private, op=MPI.SUM)
            b = time.perf_counter()
            buf = backend.pack_buffer(count, np.float32)
            buf[:] = src
            comm.Barrier()
            c = time.perf_counter()
            pieces = backend.allreduce_packed(count, np.float32, "sum")
            d = time.perf_counter()
            if it == 0:
                exact = all(np.array_equal(piece, private[s : s + piece.size]) for s, piece in pieces)
                continue  # warm-up
            raw_t.append(b - a)
            shm_t.append(d - c)
        raw = _median_of_slowest(comm, raw_t)
        shm = _median_of_slowest(comm, shm_t)
        exact = comm.allreduce(exact, op=MPI.LAND)
        use = backend.enabled(nbytes, np.float32, "sum")
        if comm.rank == 0:
            bus = 2 * (n - 1) / n * nbytes / 1e9
            auto = shm if use else raw
            print(
                f"{nbytes:>9} {raw * 1e6:>9.1f} {bus / raw:>9.2f} {shm * 1e6:>9.1f} {bus / shm:>9.2f} "
                f"{raw / shm:>7.2f} {'shm' if use else 'mpi':>4} {raw / auto:>8.2f} {'yes' if exact else 'NO':>5}",
                flush=True,
            )
        del pieces, buf
    backend.close()


if __name__ == "__main__":
    main()
