"""Partitioners and ShardedVariable: TF's shard arithmetic and API (issue 25).

Each test names the TensorFlow code it checks (tensorflow/python/distribute/sharded_variable.py,
parameter_server_strategy_v2.py, tensorflow/python/ops/partitioned_variables.py).
"""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.distribute.partitioners import num_shards_for, shard_offsets, shard_sizes
from mpistrat.distribute.sharded_variable import ShardedVariable, create_sharded_variable

P = ms.experimental.partitioners


def test_module_path_and_names():
    # TF: tf.distribute.experimental.partitioners.{Partitioner, FixedShardsPartitioner, MinSizePartitioner,
    # MaxSizePartitioner} (sharded_variable.py tf_export names).
    from mpistrat.experimental import partitioners

    assert partitioners is P
    for name in ("Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"):
        assert issubclass(getattr(P, name), P.Partitioner)
    with pytest.raises(NotImplementedError):
        P.Partitioner()((4,), np.float32)


def test_fixed_shards_docstring_examples():
    # TF: sharded_variable.py FixedShardsPartitioner docstring: num_shards=2 on [10, 3] -> [2, 1]; never more shards
    # than rows (min(num_shards, shape[axis])).
    assert P.FixedShardsPartitioner(num_shards=2)((10, 3), np.float32) == [2, 1]
    assert P.FixedShardsPartitioner(num_shards=5)((3, 2), np.float32) == [3, 1]
    assert P.FixedShardsPartitioner(num_shards=5)((13,), np.float32) == [5]


def test_min_size_docstring_examples():
    # TF: sharded_variable.py MinSizePartitioner docstring: min_shard_bytes=4 on [6, 1] float32 -> [2, 1] with
    # max_shards=2, [6, 1] with max_shards=10 (partitioned_variables.min_max_variable_partitioner).
    assert P.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert P.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [6, 1]
    # Defaults: 256 KiB per shard, one shard at most.
    assert P.MinSizePartitioner()((1 << 20, 4), np.float32) == [1, 1]
    # ceil(total_bytes / min_shard_bytes): 100 float64 rows of 8 bytes = 800 bytes over 300 -> 3 shards.
    assert P.MinSizePartitioner(min_shard_bytes=300, max_shards=10)((100,), np.float64) == [3]
    # Strings count bytes_per_string per element: 10 elements x 16 bytes = 160 over 40 -> 4.
    assert P.MinSizePartitioner(min_shard_bytes=40, max_shards=10)((10,), np.str_) == [4]
    assert P.MinSizePartitioner(min_shard_bytes=40, max_shards=10, bytes_per_string=4)((10,), object) == [1]


def test_max_size_docstring_examples():
    # TF: sharded_variable.py MaxSizePartitioner docstring: max_shard_bytes=4 on [6, 1] float32 -> [6, 1]; with
    # max_shards=2 -> [2, 1]; max_shard_bytes=1024 -> [1, 1] (partitioned_variables.variable_axis_size_partitioner).
    assert P.MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32) == [6, 1]
    assert P.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert P.MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32) == [1, 1]
    # Rows of 3 float32 = 12 bytes; 30 bytes hold floor(30/12) = 2 rows; 13 rows -> ceil(13/2) = 7 shards.
    assert P.MaxSizePartitioner(max_shard_bytes=30)((13, 3), np.float32) == [7, 1]
    # A row larger than max_shard_bytes still gets a shard of its own (at least one row per shard).
    assert P.MaxSizePartitioner(max_shard_bytes=1)((5, 8), np.float64) == [5, 1]


def test_partitioner_argument_errors():
    # TF: MinSizePartitioner / MaxSizePartitioner __init__ raise ValueError for non-positive arguments, and
    # min_max_variable_partitioner for an axis the shape lacks.
    with pytest.raises(ValueError, match="min_shard_bytes"):
        P.MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match="max_shards"):
        P.MinSizePartitioner(max_shards=0)
    with pytest.raises(ValueError, match="bytes_per_string"):
        P.MinSizePartitioner(bytes_per_string=0)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        P.MaxSizePartitioner(max_shard_bytes=0)
    with pytest.raises(ValueError, match="max_shards"):
        P.MaxSizePartitioner(max_shard_bytes=4, max_shards=-1)
    with pytest.raises(ValueError, match="Cannot partition variable along axis 1"):
        P.MinSizePartitioner()((4,), np.float32, axis=1)


def test_row_split_is_tfs_div_split():
    # TF: parameter_server_strategy_v2.py ParameterServerStrategyV2._create_variable, "div" partition strategy: the
    # first rows % shards shards get one row more ("num_partitions=4, shape[0]=10, partitions: [3, 3, 2, 2],
    # offsets: [0, 3, 6, 8, 10]"). The issue's case: 13 rows over 5 shards.
    assert shard_sizes(13, 5) == [3, 3, 3, 2, 2]
    assert shard_offsets(10, 4) == [0, 3, 6, 8, 10]
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(6, 6) == [1] * 6
    assert shard_sizes(7, 1) == [7]


def test_partitioner_answer_validation():
    # TF: ParameterServerStrategyV2._create_variable: "variable_partitioner must return a list/tuple whose elements
    # are 1 besides the first element (non-zero)"; the shard count is min(partitions[0], shape[0]).
    assert num_shards_for([5, 1], 13) == 5
    assert num_shards_for([20, 1], 13) == 13
    for bad in ([], [0, 1], [2, 2], None):
        with pytest.raises(ValueError, match="variable_partitioner must return"):
            num_shards_for(bad, 13)


def _sharded():
    return ShardedVariable([ms.Variable(np.arange(6, dtype=np.float32).reshape(3, 2)),
                            ms.Variable(np.arange(6, 10, dtype=np.float32).reshape(2, 2))], name="emb")


def test_sharded_variable_shape_dtype_iteration_and_reads():
    # TF: sharded_variable.py ShardedVariableMixin.__init__ (shape: rows added up), variables, __iter__, name; the
    # value is the shards concatenated along axis 0.
    sv = _sharded()
    assert sv.shape == (5, 2) and sv.dtype == np.float32 and sv.name == "emb"
    assert [v.shape for v in sv] == [(3, 2), (2, 2)] and list(sv) == sv.variables
    expected = np.arange(10, dtype=np.float32).reshape(5, 2)
    assert np.array_equal(sv.numpy(), expected)
    assert np.array_equal(sv.value(), expected) and np.array_equal(sv.read_value(), expected)
    assert np.array_equal(np.asarray(sv), expected)
    assert np.array_equal(sv[1:4], expected[1:4]) and np.array_equal(sv + 1, expected + 1)


def test_sharded_variable_assign_splits_along_axis_0():
    # TF: ShardedVariableMixin.assign / assign_add / assign_sub slice the value at each shard's offset
    # (array_ops.slice(value, self._var_offsets[i], v.shape)) and update each shard with its rows.
    sv = _sharded()
    new = np.arange(10, 20, dtype=np.float32).reshape(5, 2)
    assert sv.assign(new) is sv
    assert np.array_equal(sv.variables[0].numpy(), new[:3]) and np.array_equal(sv.variables[1].numpy(), new[3:])
    sv.assign_add(np.ones((5, 2), np.float32))
    sv.assign_sub(np.full((5, 2), 3, np.float32))
    assert np.array_equal(sv.numpy(), new - 2)
    with pytest.raises(ValueError, match="full shape"):
        sv.assign(np.zeros((4, 2), np.float32))
    assert np.array_equal(sv.numpy(), new - 2)


def test_sharded_variable_construction_errors():
    # TF: ShardedVariableMixin.__init__: TypeError for a non-list or non-variables, ValueError for mixed dtypes and
    # for shapes that differ beyond the first axis.
    with pytest.raises(TypeError, match="non-empty list"):
        ShardedVariable([])
    with pytest.raises(TypeError, match="non-empty list"):
        ShardedVariable([np.zeros(3)])
    with pytest.raises(ValueError, match="same dtype"):
        ShardedVariable([ms.Variable(np.zeros(2, np.float32)), ms.Variable(np.zeros(2, np.float64))])
    with pytest.raises(ValueError, match="same shapes except for the first axis"):
        ShardedVariable([ms.Variable(np.zeros((2, 3), np.float32)), ms.Variable(np.zeros((2, 4), np.float32))])


def test_create_sharded_variable_13_rows_over_5_shards():
    # TF: ParameterServerStrategyV2._create_variable with FixedShardsPartitioner(5): 13 rows become shards of
    # [3, 3, 3, 2, 2] rows named "<name>/part_<i>", holding the initial value's rows in order; one shard or a scalar
    # gives a plain variable.
    init = np.arange(26, dtype=np.float32).reshape(13, 2)
    sv = create_sharded_variable(init, P.FixedShardsPartitioner(5), name="w")
    assert isinstance(sv, ShardedVariable)
    assert [v.shape[0] for v in sv] == [3, 3, 3, 2, 2]
    assert [v.name for v in sv] == [f"w/part_{i}" for i in range(5)]
    assert np.array_equal(sv.numpy(), init)
    assert np.array_equal(sv.variables[3].numpy(), init[9:11])
    plain = create_sharded_variable(lambda: np.ones(4, np.float32), P.FixedShardsPartitioner(1))
    assert not isinstance(plain, ShardedVariable) and plain.shape == (4,)
    assert not isinstance(create_sharded_variable(np.float32(3), P.FixedShardsPartitioner(4)), ShardedVariable)
    big = create_sharded_variable(np.zeros((6, 1), np.float32), P.MaxSizePartitioner(max_shard_bytes=4, max_shards=2))
    assert [v.shape for v in big] == [(3, 1), (3, 1)]


def test_sharded_variable_checkpoint_round_trip(tmp_path):
    # TF: ShardedVariableMixin saves its shards as slices of one full variable (its _saving_variable), so a
    # checkpoint holds the full value; restoring splits it over the shards again.
    init = np.arange(13, dtype=np.float32).reshape(13, 1)
    sv = create_sharded_variable(init, P.FixedShardsPartitioner(5), name="w")
    ckpt = ms.Checkpoint(w=sv)
    path = ckpt.write(str(tmp_path / "ck"))
    sv.assign(np.zeros((13, 1), np.float32))
    ckpt.restore(path)
    assert np.array_equal(sv.numpy(), init) and np.array_equal(sv.variables[4].numpy(), init[11:])
    # Restoring into another number of shards (TF restores a full-shape save into any slicing).
    other = create_sharded_variable(np.zeros((13, 1), np.float32), P.FixedShardsPartitioner(3), name="w")
    ms.Checkpoint(w=other).restore(path)
    assert [v.shape[0] for v in other] == [5, 4, 4] and np.array_equal(other.numpy(), init)
