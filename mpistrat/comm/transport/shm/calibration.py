"""Start-up measurements of the shared-memory all-reduce, each taken once per rank set.

Two decisions of ``ShmAllreduceBackend`` are measured rather than guessed,
because the same code is faster or slower than raw MPI depending on the
machine and on how the ranks share its cores:

* ``measure_threshold``: the smallest bucket size from which the window path
  beats raw ``Allreduce`` (its ``min_bytes``);
* ``measure_chunks``: whether long single arrays go in ``AUTO_CHUNK_BYTES``
  chunks or in one pass (its ``chunk_bytes``).

Both alternate the ways they compare, each timed after a barrier, keep the
slowest rank's time per repetition (the first repetition warms up and is
dropped), decide on rank 0 and broadcast, so every rank takes the same path.
Results are cached per process in ``THRESHOLDS`` and ``CHUNK_DECISIONS`` by
world ranks, layout, sync kind and ``max_bytes``: one measurement per rank
set, not one per backend.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
from mpi4py import MPI

if TYPE_CHECKING:
    from mpistrat.comm.transport.shm.allreduce import ShmAllreduceBackend

__all__ = [
    "AUTO_CHUNK_BYTES",
    "CHUNK_MEASURE_MIN",
    "CHUNK_DECISIONS",
    "THRESHOLDS",
    "measure_chunks",
    "measure_threshold",
    "time_alternating",
]

CALIBRATION_SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
THRESHOLD_MARGIN = 0.8  # the window path must take at most this fraction of raw time to be chosen

# The chunk size ``auto`` measures and uses. With the pushed reduce-scatter (shm_allreduce), 1 MiB
# chunks beat 2 MiB and one pass at 4 and 16 MiB, 2 and 4 ranks, in both of this VM's modes (2 ranks,
# 16 MiB: 2.3 ms in 1 MiB chunks, 2.5 in 2 MiB chunks, 4.8 in one pass; 4 MiB: 0.50, 0.57, 0.83 ms).
AUTO_CHUNK_BYTES = 1 << 20
CHUNK_MEASURE_MIN = 4 << 20  # the first array this long decides (four chunks or more)
CHUNK_MEASURE_MAX = 16 << 20  # the longest array the chunk measurement reduces
CHUNK_REPS = 5
CHUNK_MARGIN = 0.95  # chunks must take at most this fraction of one pass's time to be used

THRESHOLDS: dict[tuple, int] = {}
CHUNK_DECISIONS: dict[tuple, int] = {}


def time_alternating(
    comm: MPI.Comm,
    ways: Sequence[Callable[[], object]],
    reps: int,
    prepare: Sequence[Callable[[], object] | None] | None = None,
) -> np.ndarray:
    """Seconds per call of each way, shape ``(len(ways), reps)``, the slowest rank's (collective).

    The ways alternate within each repetition, each timed alone after a
    barrier; ``prepare[i]`` (untimed) runs before way ``i``'s barrier. One
    extra repetition first warms up and is dropped.
    """
    prepare = prepare or [None] * len(ways)
    times = np.zeros((len(ways), reps + 1))
    for rep in range(reps + 1):
        for i, way in enumerate(ways):
            if prepare[i] is not None:
                prepare[i]()
            comm.Barrier()
            t0 = time.perf_counter()
            way()
            times[i, rep] = time.perf_counter() - t0
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times[:, 1:]


def once_per_rank_set(backend: "ShmAllreduceBackend", cache: dict[tuple, int], measure: Callable[[], int]) -> int:
    """``measure()``'s agreed result, cached for the backend's world ranks and layout (collective)."""
    lay = backend.layout
    assert lay is not None
    mine, whole = lay.comm.Get_group(), MPI.COMM_WORLD.Get_group()
    world = mine.Translate_ranks(list(range(lay.comm.Get_size())), whole)
    mine.Free()
    whole.Free()
    key = (tuple(world), lay.num_nodes, lay.local_size, backend.owners, backend.sync_kind, backend.max_bytes)
    cached = cache.get(key)
    if lay.comm.allreduce(cached is not None, op=MPI.LAND):
        return int(lay.comm.bcast(cached, root=0))
    cache[key] = value = measure()
    return value


def _decide_on_rank_zero(backend: "ShmAllreduceBackend", decide: Callable[[MPI.Comm], int]) -> int:
    """``decide(comm)`` on a private duplicate of the backend's communicator, rank 0's answer for all."""
    assert backend.layout is not None
    comm = backend.layout.comm.Dup()
    try:
        return int(comm.bcast(decide(comm), root=0))
    finally:
        comm.Free()


def measure_threshold(backend: "ShmAllreduceBackend") -> int:
    """The smallest measured size from which the window path beats raw ``Allreduce`` (collective).

    A path's time is the lower quartile over repetitions of the slowest rank
    (robust to other processes stealing the cores), and the window path must
    take at most ``THRESHOLD_MARGIN`` of the raw time at that size and every
    larger one. Records ``(bytes, raw s, window s)`` in ``backend.calibration``.
    """

    def decide(comm: MPI.Comm) -> int:
        results = []
        for nbytes in (n for n in CALIBRATION_SIZES if n <= backend.max_bytes):
            count = nbytes // 4
            reps = 31 if nbytes <= (64 << 10) else 9 if nbytes <= (1 << 20) else 4
            private = np.ones(count, np.float32)
            times = time_alternating(
                comm,
                [
                    lambda: comm.Allreduce(MPI.IN_PLACE, private, op=MPI.SUM),
                    lambda: backend.allreduce_packed(count, np.float32, "sum"),
                ],
                reps,
                prepare=[None, lambda: backend.pack_buffer(count, np.float32)],
            )
            raw, shm = np.percentile(times, 25, axis=1)
            results.append((nbytes, float(raw), float(shm)))
        backend.calibration = results
        threshold = backend.max_bytes + 1
        for nbytes, raw, shm in reversed(results):
            if shm >= raw * THRESHOLD_MARGIN:
                break
            threshold = nbytes
        return threshold

    return once_per_rank_set(backend, THRESHOLDS, lambda: _decide_on_rank_zero(backend, decide))


def measure_chunks(backend: "ShmAllreduceBackend", count: int, dtype: np.dtype) -> int:
    """``AUTO_CHUNK_BYTES`` if reducing ``count`` items of ``dtype`` (at most ``CHUNK_MEASURE_MAX``
    bytes of them) in such chunks beats one pass, else 0 (collective).

    Measured at the size that triggered it, so the window grows no further
    than that array needs anyway. A way's time is the median over repetitions
    of the slowest rank (not a quantile below it: on a machine where
    synchronisation is sometimes slow, chunks pay for it many times over).
    Records ``(bytes, one pass s, chunked s)`` in ``backend.chunk_calibration``.
    """

    def decide(comm: MPI.Comm) -> int:
        n = min(count, CHUNK_MEASURE_MAX // dtype.itemsize)
        source = np.ones(n, dtype)
        out = np.empty_like(source)
        ways = [
            lambda chunk=chunk: backend.reduce_in_chunks(source, out, "sum", chunk)
            for chunk in (0, AUTO_CHUNK_BYTES // dtype.itemsize)
        ]
        one_pass, chunked = np.median(time_alternating(comm, ways, CHUNK_REPS), axis=1)
        backend.chunk_calibration = [(n * dtype.itemsize, float(one_pass), float(chunked))]
        return AUTO_CHUNK_BYTES if chunked <= one_pass * CHUNK_MARGIN else 0

    return once_per_rank_set(backend, CHUNK_DECISIONS, lambda: _decide_on_rank_zero(backend, decide))
