"""MultiWorkerMirroredStrategy never hangs: timeouts and mismatches name the ranks (2 and 4 ranks)."""

import time

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError, CollectiveTimeoutError, CommunicatorBrokenError
from mpistrat.experimental import CommunicationOptions


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_per_call_timeout_in_strategy_run_names_the_missing_rank():
    comm = MPI.COMM_WORLD
    s = ms.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=60))
    late = comm.size - 1
    per_call = CommunicationOptions(timeout_seconds=1.0)  # overrides the strategy's 60 s

    def step():
        return ms.get_replica_context().all_reduce("sum", np.ones(3), options=per_call)

    if comm.rank == late:
        time.sleep(3.0)  # busy past the others' timeout
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        s.run(step)
    text = str(info.value)
    if comm.rank == late:
        assert info.value.abandoned_by == [r for r in range(comm.size) if r != late], text
    else:
        assert info.value.missing_ranks == [late], text
        assert f"rank {late} never arrived" in text and "timeout_seconds=1" in text, text
        assert time.monotonic() - start < 20  # the per-call 1 s, not the strategy's 60 s
    with pytest.raises(CommunicatorBrokenError):  # no half-done collective can follow
        s.run(step)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_strategy_timeout_option_applies_to_reduce():
    comm = MPI.COMM_WORLD
    s = ms.MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=1.0))
    if comm.rank == 0:
        time.sleep(3.0)
    with pytest.raises(CollectiveTimeoutError) as info:
        s.reduce("sum", np.float64(comm.rank), axis=None)
    if comm.rank != 0:
        assert info.value.missing_ranks == [0] and "rank 0 never arrived" in str(info.value)


@pytest.mark.mpi(min_size=2)
def test_mismatch_in_strategy_run_names_every_rank_and_what_it_sent():
    comm = MPI.COMM_WORLD
    s = ms.MultiWorkerMirroredStrategy()
    shape = 4 if comm.rank == 0 else 5
    others = "rank 1" if comm.size == 2 else "ranks " + ", ".join(str(r) for r in range(1, comm.size))
    with pytest.raises(CollectiveMismatchError) as info:
        s.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(shape)))
    text = str(info.value)
    assert text.startswith("Mismatched allreduce shapes"), text
    assert r"rank 0 sent [(4,), float64]" in text and f"{others} sent [(5,), float64]" in text, text
    dtype = np.float32 if comm.rank == comm.size - 1 else np.float64
    with pytest.raises(CollectiveMismatchError, match=rf"rank {comm.size - 1} sent \[\(3,\), float32\]"):
        s.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(3, dtype)))
    op = "max" if comm.rank == 1 else "sum"
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched allreduce op .*rank 1 sent op=max"):
        s.run(lambda: ms.get_replica_context().all_reduce(op, np.ones(3)))
    # still usable: nothing was left half-done
    assert float(s.run(lambda: ms.get_replica_context().all_reduce("sum", 1.0))) == comm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, value", [("MPISTRAT_NO_ABORT_HOOK", "maybe"), ("MPISTRAT_SHM_MAX_BYTES", "lots")])
def test_a_malformed_setting_on_one_rank_fails_the_strategy_on_every_rank(comm, monkeypatch, name, value):
    # Settings are checked when the strategy's communicator is made, on every rank at once; nothing
    # that reads a setting may raise on one rank before that (the abort hook is installed after it).
    import mpistrat as ms

    if comm.rank == comm.size - 1:
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        ms.MultiWorkerMirroredStrategy()
    if comm.rank == comm.size - 1:
        assert name in str(info.value)
    else:
        assert f"failed on rank(s) [{comm.size - 1}]" in str(info.value) and name in str(info.value)
