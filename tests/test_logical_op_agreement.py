"""The agreement check covers the logical reduce op: ranks asking MEAN and SUM raise on every rank (2 and 4 ranks).

MEAN moves between ranks as a sum divided afterwards, so a check of the wire op alone would let one rank
average what another sums. Every path that reduces across ranks is covered: ``all_reduce`` inside
``strategy.run`` (a call never made before, and one repeated after its plan was cached),
``strategy.reduce`` and a variable's aggregation; and ``RankCommunicator.allreduce``'s ``divisor``
itself (MEAN over different counts, a bad divisor on one rank).
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError, RankCommunicator
from mpistrat.experimental import CommunicationOptions

AGG = ms.VariableAggregation
# One array on each path of a single node: below the window's threshold, the one-synchronisation
# window, the reduce-scatter (the plan's check folded into the transport's first synchronisation).
SIZES = [3, 4096, 100_000]


def _others(rank: int, size: int) -> str:
    rest = [r for r in range(size) if r != rank]
    return ("rank " if len(rest) == 1 else "ranks ") + ", ".join(map(str, rest))


def _expect_mean_sum_mismatch(info: pytest.ExceptionInfo, size: int) -> None:
    text = str(info.value)
    assert text.startswith("Mismatched allreduce"), text
    assert f"rank 0 sent op=mean, divisor={size}" in text, text
    assert f"{_others(0, size)} sent op=sum" in text, text


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("planned", [False, True], ids=["first-call", "repeated-call"])
def test_mean_against_sum_in_all_reduce_raises_on_every_rank(comm, count, planned):
    s = ms.MultiWorkerMirroredStrategy()
    x = np.full(count, comm.rank + 1.0, np.float32)
    get = ms.get_replica_context
    if planned:  # both calls planned on every rank: the mismatch meets a repeated call's folded check
        for op in ("mean", "sum", "mean", "sum"):
            s.run(lambda: get().all_reduce(op, x))
    op = "mean" if comm.rank == 0 else "sum"
    with pytest.raises(CollectiveMismatchError) as info:
        s.run(lambda: get().all_reduce(op, x))
    _expect_mean_sum_mismatch(info, comm.size)
    # Nothing was combined or left half-done: the next call is right.
    total = s.run(lambda: get().all_reduce("sum", x))
    mean = s.run(lambda: get().all_reduce("mean", x))
    expected = comm.size * (comm.size + 1) / 2
    assert np.all(total == expected) and np.allclose(mean, expected / comm.size)
    assert np.all(x == comm.rank + 1.0), "the input is untouched"
    s.extended._communicator.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [1, 4096])
def test_mean_against_sum_in_strategy_reduce_raises_on_every_rank(comm, count):
    s = ms.MultiWorkerMirroredStrategy()
    value = np.full(count, float(comm.rank), np.float64)
    op = "MEAN" if comm.rank == 0 else "SUM"
    with pytest.raises(CollectiveMismatchError) as info:
        s.reduce(op, value, axis=None)
    _expect_mean_sum_mismatch(info, comm.size)
    assert np.allclose(s.reduce("MEAN", value, axis=None), (comm.size - 1) / 2)
    s.extended._communicator.close()


@pytest.mark.mpi(min_size=2)
def test_mean_against_sum_aggregation_of_a_variable_raises_on_every_rank(comm):
    s = ms.MultiWorkerMirroredStrategy()
    with s.scope():
        v = ms.Variable(np.zeros(5, np.float32), aggregation=AGG.MEAN if comm.rank == 0 else AGG.SUM)
    with pytest.raises(CollectiveMismatchError) as info:
        s.run(lambda: v.assign(np.full(5, comm.rank + 1.0, np.float32)))
    _expect_mean_sum_mismatch(info, comm.size)
    assert np.all(v.numpy() == 0), "no rank assigned a value combined from a mismatched call"
    with s.scope():
        w = ms.Variable(np.zeros(5, np.float32), aggregation=AGG.MEAN)
    s.run(lambda: w.assign(np.full(5, comm.rank + 1.0, np.float32)))
    assert np.allclose(w.numpy(), (comm.size + 1) / 2)
    s.extended._communicator.close()


@pytest.mark.mpi(min_size=2)
def test_divisor_is_part_of_the_call_and_checked_on_every_rank(comm):
    rc = RankCommunicator(comm)
    try:
        x = np.ones(8, np.float32)
        # MEAN over different counts: the divisors are named.
        with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce divisor.*rank 0 sent op=mean, divisor=1"):
            rc.allreduce([x], "sum", divisor=1 if comm.rank == 0 else 2)
        # A divisor MEAN cannot have, on one rank: the error travels in the check, every rank raises naming it.
        bad = comm.rank == comm.size - 1
        with pytest.raises((ValueError, CollectiveMismatchError), match="op must be 'sum'"):
            rc.allreduce([x], "max" if bad else "sum", divisor=2)
        with pytest.raises((ValueError, CollectiveMismatchError), match="positive int"):
            rc.allreduce([x], "sum", divisor=0 if bad else 2)
        # The same logical call on every rank, the divisor given as any integer type: agreed, a plain sum.
        out = rc.allreduce([x], "sum", divisor=np.int64(comm.size) if comm.rank else comm.size)
        assert np.all(out[0] == comm.size)
    finally:
        rc.close()


@pytest.mark.mpi(min_size=2)
def test_mean_against_sum_across_pretend_nodes_raises_on_every_rank(comm, monkeypatch):
    """Across nodes the check is a round of its own over MPI (``MPISTRAT_AGREEMENT=mpi`` here): the same error."""
    monkeypatch.setenv("MPISTRAT_AGREEMENT", "mpi")
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", "2")
    s = ms.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(implementation="SHM"))
    x = np.full(5000, 1.0, np.float32)
    get = ms.get_replica_context
    for op in ("mean", "sum"):
        s.run(lambda: get().all_reduce(op, x))
    op = "mean" if comm.rank == 0 else "sum"
    with pytest.raises(CollectiveMismatchError) as info:
        s.run(lambda: get().all_reduce(op, x))
    _expect_mean_sum_mismatch(info, comm.size)
    assert np.all(s.run(lambda: get().all_reduce("sum", x)) == comm.size)
    s.extended._communicator.close()
    MPI.COMM_WORLD.Barrier()
