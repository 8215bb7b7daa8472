"""The shared-memory transport's one start-up measurement: whether long arrays go in chunks.

Chunking never changes the order in which a reduction sums the ranks' values, so results do not
depend on the measurement; only its speed does.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

__all__ = [
    "CHUNK_MEASURE_MIN",
    "CHUNKS_MEASURED",
    "CHUNK_DECISIONS",
    "measure_chunks",
    "time_alternating",
]

CHUNK_MEASURE_MIN = 4 << 20  # the first array this long decides
CHUNK_MEASURE_MAX = 16 << 20  # the longest array the chunk measurement reduces, unless four chunks are longer
CHUNKS_MEASURED = 4  # the least number of chunks the measurement's array is cut into
CHUNK_REPS = 5
CHUNK_MARGIN = 0.95  # chunks must take at most this fraction of one pass's time to be used

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


def measure_chunks(
    comm: MPI.Comm, key: tuple, reduce_in_chunks: Callable[[np.ndarray, np.ndarray, int], None], count: int,
    dtype: np.dtype, chunk_bytes: int, max_bytes: int,
) -> tuple[int, list[tuple[int, int, float, float]]]:
    """``chunk_bytes`` (the same on every rank) if reducing ``count`` items of ``dtype`` (at most
    ``CHUNK_MEASURE_MAX`` bytes of them, at least ``CHUNKS_MEASURED`` chunks' worth, at most
    ``max_bytes``, the longest array the transport takes) in such chunks beats one pass, else 0; and
    the measurement ``(bytes, chunk_bytes, one pass s, chunked s)`` (collective over ``comm``; cached
    under ``key``, empty then; nothing is timed where two chunks would not fit in ``max_bytes``).

    ``MPISTRAT_SHM_CHUNK_BYTES=auto`` leaves this choice to this function: at the first array of at
    least ``CHUNK_MEASURE_MIN`` bytes, chunks of ``chunk_bytes`` (the transport passes the node's
    chunk, ``config.node_chunk_bytes``) are timed against one pass
    (alternating, each after a barrier, the slowest rank's time per repetition, the first repetition
    dropped: :func:`time_alternating`), decided on rank 0 and broadcast, so every rank cuts the same
    chunks. The result is cached per process by rank set, so it is measured once.

    ``reduce_in_chunks(source, out, chunk_items)`` reduces ``source`` into ``out`` (0: one pass).
    Measured at the size that triggered it, so the window grows no further than that array
    needs anyway, unless that is fewer than ``CHUNKS_MEASURED`` chunks. A way's time is the median
    over repetitions of the slowest rank (not a quantile below it: where synchronisation is sometimes
    slow, chunks pay for it many times over).
    """
    cached = CHUNK_DECISIONS.get(key)
    if comm.allreduce(cached is not None, op=MPI.LAND):
        return int(comm.bcast(cached, root=0)), []
    itemsize = dtype.itemsize
    n = min(max(min(count, CHUNK_MEASURE_MAX // itemsize), CHUNKS_MEASURED * chunk_bytes // itemsize),
            max_bytes // itemsize)
    if n < 2 * (chunk_bytes // itemsize):  # the same on every rank: no chunks to time
        CHUNK_DECISIONS[key] = 0
        return 0, []
    private = comm.Dup()  # the measurement's barriers and reductions never meet another call's
    try:
        source = np.ones(n, dtype)
        out = np.empty_like(source)
        ways = [
            lambda chunk=chunk: reduce_in_chunks(source, out, chunk)
            for chunk in (0, chunk_bytes // dtype.itemsize)
        ]
        one_pass, chunked = np.median(time_alternating(private, ways, CHUNK_REPS), axis=1)
        decision = chunk_bytes if chunked <= one_pass * CHUNK_MARGIN else 0
        decision = int(private.bcast(decision, root=0))
    finally:
        private.Free()
    CHUNK_DECISIONS[key] = decision
    return decision, [(n * dtype.itemsize, chunk_bytes, float(one_pass), float(chunked))]
