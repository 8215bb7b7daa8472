"""ReduceOp, PerReplica, Mirrored and nested structures."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import nest
from mpistrat.regroup import regroup, select_replica


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


def test_distributed_value_where_single_value_needed_raises():
    p = ms.PerReplica([np.ones(2), np.zeros(2)])
    with pytest.raises(TypeError, match="cannot be used where a single value is needed"):
        np.asarray(p)
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
