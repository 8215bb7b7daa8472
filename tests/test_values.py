"""ReduceOp, PerReplica, Mirrored and nested structures."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import nest
from mpistrat.distribute.regroup import regroup, select_replica


@pytest.mark.parametrize("text", ["sum", "SUM", "Sum", " mean ", "MIN", "max"])
def test_reduce_op_from_string(text):
    assert ms.ReduceOp.from_string(text) is ms.ReduceOp[text.strip().upper()]


def test_reduce_op_rejects_unknown():
    with pytest.raises(ValueError, match="Unknown reduce op 'avg'"):
        ms.ReduceOp.from_string("avg")
    with pytest.raises(ValueError):
        ms.ReduceOp.from_string(3)


def test_reduce_op_from_variable_aggregation():
    assert ms.ReduceOp.from_variable_aggregation(ms.VariableAggregation.SUM) is ms.ReduceOp.SUM
    assert ms.ReduceOp.from_variable_aggregation(ms.VariableAggregation.MEAN) is ms.ReduceOp.MEAN
    with pytest.raises(ValueError, match="Could not convert"):
        ms.ReduceOp.from_variable_aggregation(ms.VariableAggregation.NONE)


def test_per_replica_and_mirrored_hold_values():
    p = ms.PerReplica([1, 2])
    m = ms.Mirrored([np.zeros(2), np.zeros(2)])
    assert p.values == (1, 2) and len(m.values) == 2
    assert isinstance(p, ms.DistributedValues) and isinstance(m, ms.DistributedValues)
    assert "PerReplica" in repr(p) and "0: 1" in repr(p)
    with pytest.raises(ValueError):
        ms.PerReplica([])


def test_per_replica_where_single_value_needed():
    """TF converts a PerReplica only inside a replica context, to that replica's value; anywhere else it raises
    ValueError "It looks like you are using a PerReplica object while not inside a replica context"
    (values.py _per_replica_to_tensor; values_test.py PerReplicaTest.testUsePerReplicaInvalidContextGivesError)."""
    p = ms.PerReplica([np.ones(2), np.zeros(2)])
    with pytest.raises(ValueError, match="using a PerReplica object while not inside a replica context"):
        np.asarray(p)
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        with pytest.raises(ValueError, match="not inside a replica context"):
            np.asarray(p)
    seen = s.experimental_local_results(s.run(lambda: np.asarray(p).tolist()))
    assert seen == ([1.0, 1.0], [0.0, 0.0])
    with pytest.raises(TypeError, match="ambiguous"):
        bool(p)


def test_nest_roundtrip_and_order():
    s = {"b": [1, (2, 3)], "a": 4}
    assert nest.flatten(s) == [4, 1, 2, 3]
    assert nest.pack_sequence_as(s, [40, 10, 20, 30]) == {"b": [10, (20, 30)], "a": 40}
    assert nest.map_structure(lambda x, y: x + y, [1, (2,)], [10, (20,)]) == [11, (22,)]
    with pytest.raises(ValueError, match="same nested structure"):
        nest.assert_same_structure([1, 2], [1, (2,)])
    with pytest.raises(ValueError, match="more leaves"):
        nest.pack_sequence_as([1], [1, 2])


def test_regroup_and_select_replica():
    shared = object()
    grouped = regroup([{"x": 1, "s": shared}, {"x": 2, "s": shared}])
    assert isinstance(grouped["x"], ms.PerReplica) and grouped["x"].values == (1, 2)
    assert grouped["s"] is shared
    assert select_replica(1, grouped) == {"x": 2, "s": shared}
    with pytest.raises(ValueError, match="different structures"):
        regroup([[1], (1,)])


def test_contains_distributed_finds_a_distributed_value_anywhere():
    from mpistrat.distribute.regroup import contains_distributed

    pr = ms.PerReplica((np.zeros(1), np.ones(1)))
    plain = [np.zeros(2) for _ in range(20)]
    assert not contains_distributed((plain, {"a": plain, "b": (1.0, None)}))
    assert contains_distributed((pr,))
    assert contains_distributed(plain + [pr])  # long sequence, last item
    assert contains_distributed(plain + [[np.zeros(1), {"x": [pr]}]])  # nested under a long sequence
    assert contains_distributed({"k": plain[:3] + [(pr,)]})
    assert not contains_distributed(plain + [[np.zeros(1), {"x": [3]}]])


def test_flatten_and_pack_of_long_flat_and_nested_sequences():
    from mpistrat import nest

    flat = [np.zeros(1) for _ in range(30)]
    assert nest.flatten(flat) == flat and nest.flatten(tuple(flat)) == flat
    nested = flat[:10] + [(flat[10], {"b": flat[12], "a": flat[11]})] + flat[13:]
    assert [id(x) for x in nest.flatten(nested)] == [id(x) for x in flat]
    packed = nest.pack_sequence_as(nested, list(range(30)))
    assert packed[10] == (10, {"b": 12, "a": 11}) and packed[:10] == list(range(10)) and packed[11:] == list(range(13, 30))
    assert nest.pack_sequence_as(np.zeros(1), [7]) == 7
    with pytest.raises(ValueError):
        nest.pack_sequence_as(np.zeros(1), [7, 8])
