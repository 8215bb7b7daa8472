"""An error one rank meets before its all-reduce (converting or reducing its own input) raises on every rank.

Raising on that rank alone would leave the peers waiting in the collective, or, if the
program catches the error and goes on, pair that rank's next all-reduce with the peers'
current one and combine the wrong steps. Through the agreement, every rank raises the same
mismatch naming the error, and the next step is combined correctly.
"""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.comm.errors import CollectiveMismatchError

GOOD = np.full(2, 1.0, np.float32)
BAD = np.array(["a", "b"])


@pytest.fixture
def strategy(comm):
    return ms.MultiWorkerMirroredStrategy()


def _next_step_is_in_step(strategy, comm):
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", np.full(2, 100.0, np.float32)))
    np.testing.assert_array_equal(out, np.full(2, 100.0 * comm.size, np.float32))


CALLS = {
    "all_reduce": lambda x: ms.get_replica_context().all_reduce("SUM", x),
    "all_reduce of a list": lambda x: ms.get_replica_context().all_reduce("SUM", [GOOD, x]),
    "all_reduce MEAN": lambda x: ms.get_replica_context().all_reduce("MEAN", x),
    "async all_reduce": lambda x: ms.get_replica_context().experimental_all_reduce_async("SUM", x).result(),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", list(CALLS))
def test_a_bad_value_on_one_rank_raises_on_every_rank(strategy, comm, call):
    value = BAD if comm.rank == comm.size - 1 else GOOD
    with pytest.raises(CollectiveMismatchError, match="not numeric"):
        strategy.run(CALLS[call], args=(value,))
    _next_step_is_in_step(strategy, comm)


@pytest.mark.mpi(min_size=2)
def test_a_bad_value_in_reduce_to_on_one_rank_raises_on_every_rank(strategy, comm):
    value = BAD if comm.rank == 0 else GOOD
    with pytest.raises(CollectiveMismatchError, match="not numeric"):
        strategy.extended.reduce_to("SUM", value, strategy.extended.worker_devices)
    _next_step_is_in_step(strategy, comm)


def test_one_rank_raises_the_error_itself():
    strategy = ms.MultiWorkerMirroredStrategy()
    if strategy.num_replicas_in_sync != 1:
        pytest.skip("one worker only")
    with pytest.raises(TypeError, match="not numeric"):
        strategy.run(CALLS["all_reduce"], args=(BAD,))


BAD_2D = np.array([["a", "b"], ["c", "d"]])

# Cross-replica calls whose collective follows a conversion or a check on each rank's own value.
CROSS_REPLICA = {
    "reduce along axis 0": lambda s, v: s.reduce("SUM", s.run(lambda: v), axis=0),
    "reduce MEAN along axis 0": lambda s, v: s.reduce("MEAN", s.run(lambda: v), axis=0),
    "reduce of None along an axis": lambda s, v: s.reduce("SUM", s.run(lambda: None if v is BAD_2D else v), axis=0),
    "gather": lambda s, v: s.gather(s.run(lambda: v), axis=0),
    "gather of a scalar": lambda s, v: s.gather(s.run(lambda: np.float32(1) if v is BAD_2D else v), axis=0),
    "Variable": lambda s, v: ms.Variable(v),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", list(CROSS_REPLICA))
def test_a_bad_value_before_a_cross_replica_collective_raises_on_every_rank(strategy, comm, call):
    # Before: the rank with the bad value raised alone and its peers waited in the collective
    # until the timeout (seen with gather, reduce along an axis and Variable creation).
    value = BAD_2D if comm.rank == comm.size - 1 else np.ones((2, 2), np.float32)
    with strategy.scope():
        with pytest.raises(CollectiveMismatchError, match="not numeric|at least one dimension"):
            CROSS_REPLICA[call](strategy, value)
    _next_step_is_in_step(strategy, comm)
