"""Ranks and replicas reducing nests of different structure raise, instead of summing unrelated values.

Before, ``all_reduce(SUM, {"a": x})`` on one rank and ``{"b": y}`` on another summed x with y silently
(the check compared shapes and dtypes of the flat arrays only); the nesting, dict keys included, is
now part of what every rank and every local replica must agree on.
"""

import collections

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.comm.errors import CollectiveMismatchError

Pair = collections.namedtuple("Pair", "x y")
Other = collections.namedtuple("Other", "x y")


def _good_after(strategy, comm):
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", {"a": np.ones(2)}))
    np.testing.assert_array_equal(out["a"], np.full(2, float(comm.size)))


CASES = {
    "dict keys": lambda r: {"a": np.ones(2)} if r == 0 else {"b": np.ones(2)},
    "nesting": lambda r: [(np.ones(2), np.ones(2))] if r == 0 else [np.ones(2), np.ones(2)],
    "namedtuple type": lambda r: Pair(np.ones(2), np.ones(2)) if r == 0 else Other(np.ones(2), np.ones(2)),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("call", ["all_reduce", "async", "strategy.reduce"])
def test_ranks_with_different_structures_raise_on_every_rank(comm, case, call):
    strategy = ms.MultiWorkerMirroredStrategy()
    value = CASES[case](comm.rank)
    with pytest.raises(CollectiveMismatchError, match="structure"):
        if call == "all_reduce":
            strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", value))
        elif call == "async":
            strategy.run(lambda: ms.get_replica_context().experimental_all_reduce_async("SUM", value).result())
        else:
            strategy.reduce("SUM", strategy.run(lambda: value), axis=None)
    _good_after(strategy, comm)


@pytest.mark.mpi(min_size=2)
def test_equal_structures_reduce_as_before(comm):
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    n = 2 * comm.size
    value = {"w": [np.ones(3), np.ones((2, 2))], "b": Pair(np.ones(1), np.float32(2.0))}
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", value))
    for leaf_out, leaf_in in zip(ms.nest.flatten(strategy.experimental_local_results(out)[0]), ms.nest.flatten(value)):
        np.testing.assert_allclose(leaf_out, np.asarray(leaf_in) * n)
    total = strategy.reduce("MEAN", strategy.run(lambda: value), axis=None)
    assert isinstance(total["b"], Pair) and float(total["b"].y) == 2.0


def test_local_replicas_with_different_structures_raise():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def step():
        ctx = ms.get_replica_context()
        value = {"a": np.ones(2)} if ctx.replica_id_in_sync_group == 0 else {"b": np.ones(2)}
        return ctx.all_reduce("SUM", value)

    with pytest.raises(ValueError, match="different structures"):
        strategy.run(step)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("empty", [{}, [], ()])
def test_a_rank_reducing_an_empty_nest_raises_with_its_peers(comm, empty):
    # Found in review: the empty nest returned at once on its rank while the peers waited until the timeout.
    strategy = ms.MultiWorkerMirroredStrategy()
    value = empty if comm.rank == 0 else {"a": np.ones(2)}
    for call in ("all_reduce", "async"):
        with pytest.raises(CollectiveMismatchError):
            if call == "all_reduce":
                strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", value))
            else:
                strategy.run(lambda: ms.get_replica_context().experimental_all_reduce_async("SUM", value).result())
    everywhere = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", empty))
    assert everywhere == empty
    _good_after(strategy, comm)


def test_dicts_with_unsortable_keys_are_refused_as_tf_does():
    # Keys ordered by repr would order objects by memory address, differently on every rank (review).
    class Layer:
        pass

    with pytest.raises(TypeError, match="sortable keys"):
        ms.nest.flatten({Layer(): np.ones(1), Layer(): np.ones(1)})
    assert ms.nest.flatten({"b": 2, "a": 1}) == [1, 2]


@pytest.mark.mpi(min_size=2)
def test_a_flat_list_carries_no_structure_whatever_its_leaves_are(comm):
    # A flat list's count and order say all: [array] on one rank and [variable] (read as the replica's
    # copy) on another are the same call, as in TF, not a structure mismatch.
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        v = ms.Variable(np.ones(2))
    leaf = v if comm.rank == 1 else np.ones(2)
    for _ in range(3):  # the first call plans; the repeats take the lean path where there is one
        out = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", [leaf]))
        assert type(out) is list and len(out) == 1
        np.testing.assert_array_equal(out[0], np.full(2, float(comm.size)))
