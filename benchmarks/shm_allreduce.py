"""Shared-window all-reduce vs raw mpi4py ``Allreduce(IN_PLACE)``, same processes, same run.

Usage (keep the venv's ``mpiexec`` first on PATH)::

    mpiexec -n 2 python benchmarks/shm_allreduce.py
    mpiexec -n 4 python benchmarks/shm_allreduce.py --sync counter
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296 mpiexec -n 2 python benchmarks/shm_allreduce.py
    MPISTRAT_PRETEND_NODES=2 mpiexec -n 4 python benchmarks/shm_allreduce.py   # hierarchical path

For float32 buckets of 4 KiB to 64 MiB it times, per iteration, one raw
``Allreduce(IN_PLACE)`` on a private buffer and one ``allreduce_packed`` of
the ``ShmTransport`` on data already packed into the window (as fusion
packs it); the data is copied in before each timed call, outside the timing,
for both. A time is the median over iterations of the slowest rank. busbw
follows nccl-tests: ``algbw * 2 (n-1) / n`` with ``algbw = bytes / time``.
"auto" is the path the backend's size thresholds pick (``enabled``), and its
ratio is what a caller gets. "exact" checks the window result against the raw
result bit for bit on integer-valued float32 data (order-independent sums).

Knobs (see ``mpistrat/comm/transport/shm/allreduce.py``): ``MPISTRAT_SHM_MIN_BYTES``
(default: 16K), ``MPISTRAT_SHM_MAX_BYTES`` (64M),
``MPISTRAT_SHM_BLOCK_BYTES`` (an eighth of L2), ``--sync`` (barrier|counter),
``MPISTRAT_PRETEND_NODES``. For the plain MPI path
above 32 MiB set ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967296``:
without it glibc maps, faults and unmaps MPICH's message-sized scratch buffer
on every call.

Results on the 2-core development VM (PyPI MPICH 5.0.2, 2026-11-22, 06:09-06:10
UTC, shared with other jobs: load average 6 during these runs), two runs per
row, busbw ratio shm/raw per size::

    ranks malloc   4K    16K   64K   256K  1M    4M    16M   64M
    2     unset    0.38  0.52  0.65  1.16  2.00  2.16  2.37  6.65  (auto: MPI below 1M)
    2     unset    1.07  2.05  2.87  3.65  3.94  3.09  3.45  6.18
    2     set      1.11  2.39  2.85  3.70  3.92  4.47  3.03  3.62
    2     set      1.22  2.35  2.88  6.48  4.91  3.28  3.52  3.79
    4     unset    1.01  1.51  1.96  2.21  2.77  2.44  2.39  5.27
    4     unset    1.11  1.57  2.31  2.89  2.88  1.23  2.68  5.21
    4     set      1.01  1.38  1.96  2.24  2.48  2.75  2.46  3.95
    4     set      1.02  1.44  1.94  2.56  2.94  2.89  2.77  4.02
    4, 2 pretend   1.05  0.78  1.31  0.97  1.74  1.38  1.61  1.98  (hierarchical)

Every result was exact. The start-up calibration (23-310 ms; once 1.2 s at
the busiest) chose min_bytes 16 KiB in every single-node run but the first,
where other jobs slowed the window path at small sizes and it chose 1 MiB;
"auto" (what a caller gets) was never below 1.00 on one node. One full table
(2 ranks, malloc knobs set)::

    bytes    raw us raw busbw    shm us shm busbw shm/raw auto auto/raw exact
     4096       5.2      0.79       4.7      0.88    1.11  mpi     1.00   yes
    16384      11.8      1.39       4.9      3.32    2.39  shm     2.39   yes
    65536      19.9      3.30       7.0      9.41    2.85  shm     2.85   yes
   262144      51.6      5.08      13.9     18.81    3.70  shm     3.70   yes
  1048576     221.8      4.73      56.5     18.54    3.92  shm     3.92   yes
  4194304     870.7      4.82     194.7     21.55    4.47  shm     4.47   yes
 16777216    3806.4      4.41    1256.5     13.35    3.03  shm     3.03   yes
 67108864   20014.0      3.35    5534.7     12.13    3.62  shm     3.62   yes

and 4 ranks, malloc knobs set::

     4096      38.3      0.16      38.0      0.16    1.01  mpi     1.00   yes
    16384      56.3      0.44      40.9      0.60    1.38  shm     1.38   yes
    65536      92.0      1.07      46.9      2.10    1.96  shm     1.96   yes
   262144     210.6      1.87      93.9      4.19    2.24  shm     2.24   yes
  1048576     704.0      2.23     283.9      5.54    2.48  shm     2.48   yes
  4194304    3113.6      2.02    1133.9      5.55    2.75  shm     2.75   yes
 16777216   15471.5      1.63    6292.5      4.00    2.46  shm     2.46   yes
 67108864   90844.1      1.11   23015.3      4.37    3.95  shm     3.95   yes
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from mpistrat.comm.transport.shm.allreduce import ShmTransport
from mpistrat.config import parse_bytes

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
    p.add_argument("--sync", default=None, help="barrier | counter (default: counter)")
    p.add_argument("--pretend-nodes", type=int, default=None)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    n = comm.size
    sizes = [parse_bytes(s, "--sizes") for s in args.sizes.split(",")] if args.sizes else SIZES
    t0 = time.perf_counter()
    backend = ShmTransport(comm, pretend_nodes=args.pretend_nodes, sync=args.sync, max_bytes=max(sizes))
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
            result = backend.allreduce_packed(count, np.float32, "sum")
            d = time.perf_counter()
            if it == 0:
                exact = np.array_equal(result, private)
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
        del result, buf
    backend.close()


if __name__ == "__main__":
    main()
