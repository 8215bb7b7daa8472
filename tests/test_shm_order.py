"""No timing decides the order in which values are summed: the same program gives the same bits on an idle
and a loaded machine (the window's chunks, whatever their size, and ``auto`` across three nodes or more)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI  # noqa: F401  (pytest-mpi's ranks)

from mpistrat.comm.transport.shm import calibration
from mpistrat.comm.transport.shm.allreduce import ShmTransport


def _data(count, rank, seed):
    return np.random.default_rng(seed * 1000 + rank).standard_normal(count).astype(np.float32)


@pytest.mark.mpi(min_size=3)
def test_automatic_chunks_are_not_measured_across_three_nodes_or_more(comm, monkeypatch):
    """Across three nodes the chunk cuts the slices MPI reduces between nodes, and MPI may choose its
    algorithm (the order of the sum) by message size: ``auto`` takes the default chunk there, so the
    bits never depend on a timing; and the chunks it measures elsewhere never change the bits."""
    monkeypatch.setenv("MPISTRAT_SHM_CHUNK_BYTES", "auto")
    monkeypatch.setattr(calibration, "CHUNK_DECISIONS", {})
    count = calibration.CHUNK_MEASURE_MIN // 4 + 1000
    x = _data(count, comm.rank, seed=3)
    b = ShmTransport(comm, pretend_nodes=3, min_bytes=0)
    try:
        out = np.empty_like(x)
        b.allreduce_array(x, out, "sum")
        assert b.chunk_bytes == b.default_chunk_bytes and b.chunk_calibration == []
        assert calibration.CHUNK_DECISIONS == {}, "nothing measured (the default may be none: ranks outnumber cores)"
        assert len({o.tobytes() for o in comm.allgather(out)}) == 1
    finally:
        b.close()
    results = []
    for chunk in (0, 64 << 10, 512 << 10, "auto"):  # one node: any chunk, the same bits
        b = ShmTransport(comm, min_bytes=0, chunk_bytes=chunk)
        try:
            out = np.empty_like(x)
            b.allreduce_array(x, out, "sum")
            results.append(out)
        finally:
            b.close()
    assert all(np.array_equal(results[0], r) for r in results[1:])
