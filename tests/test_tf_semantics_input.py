"""Distributed input as tf.distribute has it (issue 22): element structure, where ``next`` may run, defaults.

Each test names the TensorFlow 2.21 source that states the behaviour (TF's
``tensorflow/python/distribute/`` unless said otherwise); the expected values
were checked against TF 2.21 run side by side (MirroredStrategy over two
logical CPUs). MPI cases run under ``mpiexec -n 2`` and ``-n 4``.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.data import InputPipelineError, InvalidArgumentError, OutOfRangeError, TensorSpec
from mpistrat.data.distribute import DistributedDatasetsFromFunction
from mpistrat.data.optional import Optional
from mpistrat.data.spec import PerReplicaSpec
from mpistrat.distribute.input_options import InputOptions, InputReplicationMode, InputWorkerInfo

NEXT_IN_REPLICA_FN = ("next(iterator) should be called from outside of replica_fn. e.g. "
                      "strategy.run(replica_fn, args=(next(iterator),))")
Pair = collections.namedtuple("Pair", "a b")
I64, F32 = np.dtype(np.int64), np.dtype(np.float32)


def mirrored(n=2):
    return ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)])


def one_replica_strategies():
    return [ms.OneDeviceStrategy("/cpu:0"), ms.MirroredStrategy(["/cpu:0"]),
            ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0"])]


def pairs(n=8, batch=4):
    """(features, labels): features row i is [2i, 2i + 1] (float32), label i is i."""
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    return ms.data.Dataset.from_tensor_slices((x, np.arange(n))).batch(batch)


def local(value):
    return [np.asarray(v).tolist() for v in value.values]


# -- 1. elements keep their structure -------------------------------------------------------------

def test_tuple_elements_yield_a_tuple_of_per_replica_leaves():
    """TF yields the element's structure with one PerReplica per leaf (input_lib.py ``_create_per_replica``:
    "Returns: a structure of PerReplica", via ``distribute_utils.regroup``; input_lib_test.py
    ``DistributedIteratorSingleWorkerTest.testTupleDataset`` expects ``[(i, i**2), (i+1, (i+1)**2)]`` per step)."""
    strategy = mirrored()
    steps = []
    for x, y in strategy.experimental_distribute_dataset(pairs()):  # "cannot unpack non-iterable" before
        assert isinstance(x, ms.PerReplica) and isinstance(y, ms.PerReplica)
        steps.append((local(x), local(y)))
    # TF 2.21, two logical CPUs: step 0 is x = ([[0, 1], [2, 3]], [[4, 5], [6, 7]]), y = ([0, 1], [2, 3])
    assert steps == [([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], [[0, 1], [2, 3]]),
                     ([[[8, 9], [10, 11]], [[12, 13], [14, 15]]], [[4, 5], [6, 7]])]


def test_dict_namedtuple_and_nested_elements_keep_their_types():
    """TF: ``dist_element["f"]`` and ``dist_element.a`` are PerReplica (same source as above; the dict and
    namedtuple cases printed by TF 2.21 side by side)."""
    strategy = mirrored()
    ds = ms.data.Dataset.from_tensor_slices({"f": np.arange(4), "g": {"h": np.arange(4.0)}}).batch(4)
    (batch,) = list(strategy.experimental_distribute_dataset(ds))
    assert type(batch) is dict and type(batch["g"]) is dict
    assert local(batch["f"]) == [[0, 1], [2, 3]] and local(batch["g"]["h"]) == [[0.0, 1.0], [2.0, 3.0]]
    ds = ms.data.Dataset.from_tensor_slices(Pair(np.arange(4), (np.arange(4.0), {"k": np.arange(4) * 10}))).batch(4)
    (batch,) = list(strategy.experimental_distribute_dataset(ds))
    assert type(batch) is Pair and type(batch.b) is tuple
    assert local(batch.a) == [[0, 1], [2, 3]] and local(batch.b[1]["k"]) == [[0, 10], [20, 30]]


def test_strategy_run_gives_each_replica_its_components():
    """TF's replica function gets each replica's component of every PerReplica leaf (values.select_replica,
    distribute_lib.py ``Strategy.run``: "args ... will be unwrapped per replica")."""
    strategy = mirrored()
    seen = {}

    def step(x, y):
        rid = ms.get_replica_context().replica_id_in_sync_group
        assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
        seen[rid] = (x[:, 0].tolist(), y.tolist())
        return x.sum() + y.sum()

    total = 0
    for x, y in strategy.experimental_distribute_dataset(pairs(8, 4)):
        total += int(strategy.reduce(ms.ReduceOp.SUM, strategy.run(step, args=(x, y)), axis=None))
    assert seen == {0: ([8, 10], [4, 5]), 1: ([12, 14], [6, 7])}  # the last step's
    assert total == sum(4 * i + 1 + i for i in range(8))  # row i: features 2i, 2i + 1 and label i

    def on_dict(batch):
        return batch["f"] * 0 + ms.get_replica_context().replica_id_in_sync_group

    ds = ms.data.Dataset.from_tensor_slices({"f": np.arange(4)}).batch(4)
    out = strategy.run(on_dict, args=(next(iter(strategy.experimental_distribute_dataset(ds))),))
    assert local(out) == [[0, 0], [1, 1]]


def test_one_local_replica_yields_the_plain_structure():
    """TF: with one device, no PerReplica wrapping (input_lib.py ``_always_wrap`` is False, so ``regroup`` of one
    value returns it as is; ``_create_distributed_tensor_spec`` returns the spec as is)."""
    for strategy in one_replica_strategies():
        dist = strategy.experimental_distribute_dataset(pairs(8, 4))
        steps = list(dist)
        assert all(type(s) is tuple and all(isinstance(v, np.ndarray) for v in s) for s in steps)
        assert [s[1].tolist() for s in steps] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert dist.element_spec == (TensorSpec((None, 2), F32), TensorSpec((None,), I64))


def test_element_spec_has_per_replica_spec_leaves():
    """TF 2.21 printed ``(PerReplicaSpec(TensorSpec((None, 2), float32), ...), PerReplicaSpec(...))`` for the
    tuple, a dict and a namedtuple of PerReplicaSpec for the others (input_lib.py
    ``_create_distributed_tensor_spec`` maps ``PerReplicaSpec`` over every leaf)."""
    strategy = mirrored()

    def two(spec):
        return PerReplicaSpec((spec, spec))

    dist = strategy.experimental_distribute_dataset(pairs())
    expected = (two(TensorSpec((None, 2), F32)), two(TensorSpec((None,), I64)))
    assert dist.element_spec == expected and iter(dist).element_spec == expected
    ds = ms.data.Dataset.from_tensor_slices(Pair(np.arange(4), {"h": np.arange(4.0)})).batch(4)
    spec = strategy.experimental_distribute_dataset(ds).element_spec
    assert spec == Pair(two(TensorSpec((None,), I64)), {"h": two(TensorSpec((None,), np.dtype(np.float64)))})
    assert type(spec) is Pair


def test_datasets_from_function_keep_the_structure_per_worker_and_per_replica():
    """TF 2.21: ``distribute_datasets_from_function`` yields the same structure of PerReplica leaves and its
    ``element_spec`` is the dataset's spec with a PerReplicaSpec per leaf (input_lib.py
    ``DistributedDatasetsFromFunction.element_spec``); with PER_WORKER one dataset feeds both replicas, the
    second gets an empty batch once it ends."""
    strategy = mirrored()
    dist = strategy.distribute_datasets_from_function(lambda ctx: ms.data.Dataset.from_tensor_slices(
        Pair(np.arange(4), np.arange(4.0))).batch(4))
    assert dist.element_spec == Pair(PerReplicaSpec((TensorSpec((None,), I64),) * 2),
                                     PerReplicaSpec((TensorSpec((None,), np.dtype(np.float64)),) * 2))
    (step,) = list(dist)
    assert type(step) is Pair and local(step.a) == [[0, 1, 2, 3], []] and step.b.values[1].shape == (0,)
    per_replica = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: ms.data.Dataset.from_tensor_slices((np.arange(2) + 10 * ctx.input_pipeline_id,
                                                        np.arange(2))).batch(2), per_replica)
    (x, y) = next(iter(dist))
    assert local(x) == [[0, 1], [10, 11]] and local(y) == [[0, 1], [0, 1]]


def test_datasets_from_function_with_different_structures_per_replica_fail_clearly():
    """Replicas whose datasets yield different structures cannot be regrouped (TF: ``regroup`` asserts the same
    structure); here it is an input pipeline failure, raised on every rank like a read error."""
    def fn(ctx):
        if ctx.input_pipeline_id == 0:
            return ms.data.Dataset.from_tensor_slices((np.arange(2), np.arange(2))).batch(2)
        return ms.data.Dataset.from_tensor_slices({"x": np.arange(2)}).batch(2)

    dist = DistributedDatasetsFromFunction(fn, InputWorkerInfo.single(("/cpu:0", "/cpu:1")), InputOptions(
        experimental_replication_mode=InputReplicationMode.PER_REPLICA))
    with pytest.raises(InputPipelineError, match=r"different structures: local replica 0: \(\.,\.\), local replica 1:"):
        next(iter(dist))


def test_get_next_as_optional_holds_the_structure():
    """TF: ``get_next_as_optional`` is ``Optional.from_value`` of the same structure of PerReplica (input_lib.py
    ``DistributedIterator.get_next_as_optional``), its spec read off the value (TF 2.21 printed PerReplicaSpec
    leaves); at the end it is ``Optional.empty(element_spec)``."""
    strategy = mirrored()
    it = iter(strategy.experimental_distribute_dataset(pairs(4, 4)))
    opt = it.get_next_as_optional()
    assert opt.has_value()
    x, y = opt.get_value()
    assert local(y) == [[0, 1], [2, 3]]
    assert opt.element_spec == (PerReplicaSpec((TensorSpec((2, 2), F32),) * 2), PerReplicaSpec((TensorSpec((2,), I64),) * 2))
    end = it.get_next_as_optional()
    assert not end.has_value() and end.element_spec == it.element_spec


def test_reduce_folds_the_structured_steps():
    """TF 2.21: ``dist.reduce(0, lambda s, x: s + strategy.reduce("SUM", x[0], axis=0))`` over
    ``(range(8), range(8)).batch(4)`` on two replicas gives 28; ``reduce_fn`` gets the tuple (input_lib.py
    ``DistributedDataset.reduce`` folds the iterator's elements)."""
    strategy = mirrored()
    dist = strategy.experimental_distribute_dataset(
        ms.data.Dataset.from_tensor_slices((np.arange(8), np.arange(8))).batch(4))
    assert int(dist.reduce(0, lambda s, x: s + strategy.reduce("SUM", x[0], axis=0))) == 28
    assert dist.reduce(0, lambda s, x: s + (type(x) is tuple)) == 2


# -- 2. next(iterator) inside the replica function -------------------------------------------------

@pytest.mark.parametrize("method", ["next", "get_next", "get_next_as_optional"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_next_inside_the_replica_function_raises_and_takes_nothing(method, replicas):
    """TF: input_lib.py ``DistributedIterator.get_next`` raises ``ValueError("next(iterator) should be called from
    outside of replica_fn. e.g. strategy.run(replica_fn, args=(next(iterator),))")`` when a replica context is
    current (TF 2.21 run: the same for OneDeviceStrategy, and nothing was consumed). TF does not check
    ``get_next_as_optional``; here it raises too, since each replica thread would take a step of its own."""
    strategy = mirrored(replicas) if replicas > 1 else ms.OneDeviceStrategy("/cpu:0")
    it = iter(strategy.experimental_distribute_dataset(ms.data.Dataset.range(8).batch(2)))
    take = {"next": next, "get_next": lambda i: i.get_next(),
            "get_next_as_optional": lambda i: i.get_next_as_optional()}[method]
    with pytest.raises(ValueError) as info:
        strategy.run(lambda: take(it))
    assert str(info.value) == NEXT_IN_REPLICA_FN
    first = next(it)  # nothing was consumed
    assert (local(first) if replicas > 1 else [first.tolist()]) == ([[0], [1]] if replicas > 1 else [[0, 1]])
    with strategy.scope():  # cross-replica context: allowed
        assert len(list(it)) == 3


def test_next_inside_a_merge_fn_is_cross_replica_and_allowed():
    """TF: ``merge_call``'s function runs in cross-replica context, where ``get_replica_context()`` is None,
    so ``get_next``'s check passes (distribute_lib.py ``ReplicaContext.merge_call``)."""
    strategy = mirrored()
    it = iter(strategy.experimental_distribute_dataset(ms.data.Dataset.range(4).batch(2)))

    def replica_fn():
        return ms.get_replica_context().merge_call(lambda s: local(next(it)))

    assert strategy.experimental_local_results(strategy.run(replica_fn))[0] == [[0], [1]]


# -- 3. one replica passes unbatched elements through ------------------------------------------------

def test_one_replica_passes_unbatched_elements_through():
    """TF 2.21: OneDeviceStrategy and one-device MirroredStrategy iterate ``Dataset.range(3)`` as the scalars
    0, 1, 2 with ``element_spec`` ``TensorSpec(shape=(), dtype=int64)`` (input_util.py only rebatches for
    several replicas). With two replicas a batch is needed (TF fails there with an IndexError; here a clear
    error)."""
    for strategy in one_replica_strategies():
        dist = strategy.experimental_distribute_dataset(ms.data.Dataset.range(3))
        assert [int(x) for x in dist] == [0, 1, 2] and all(np.ndim(x) == 0 for x in dist)
        assert dist.element_spec == TensorSpec((), I64)
        dist = strategy.experimental_distribute_dataset(
            ms.data.Dataset.from_tensor_slices((np.arange(2), [b"a", b"b"])))
        assert [(int(a), b) for a, b in dist] == [(0, b"a"), (1, b"b")]
    dist = mirrored().experimental_distribute_dataset(ms.data.Dataset.range(3))
    with pytest.raises(InputPipelineError, match=r"call \.batch"):
        list(dist)
    with pytest.raises(ValueError, match=r"must be batches when there are several replicas"):
        dist.element_spec


# -- 4.-6. options, OneDevice PER_REPLICA, Optional ----------------------------------------------------

def test_input_options_fetch_to_device_defaults_to_true():
    """TF: distribute_lib.py ``InputOptions.__new__`` turns ``experimental_fetch_to_device=None`` into True
    ("Default behavior is same as setting it to True"); its repr (TF 2.21) names every field."""
    assert InputOptions().experimental_fetch_to_device is True
    assert InputOptions(None).experimental_fetch_to_device is True
    assert InputOptions(experimental_fetch_to_device=False).experimental_fetch_to_device is False
    assert repr(InputOptions()) == (
        "InputOptions(experimental_fetch_to_device=True, experimental_replication_mode=<InputReplicationMode"
        ".PER_WORKER: 'PER_WORKER'>, experimental_place_dataset_on_device=False, "
        "experimental_per_replica_buffer_size=1)")
    # on CPU devices the placement is a no-op: the arrays handed out are the dataset's own (no copy)
    source = np.arange(6).reshape(3, 2)
    for fetch in (True, False):
        options = InputOptions(experimental_fetch_to_device=fetch, experimental_per_replica_buffer_size=0)
        (batch,) = list(ms.OneDeviceStrategy("/cpu:0").experimental_distribute_dataset(
            ms.data.Dataset.from_tensors(source), options))
        assert np.shares_memory(batch, source)


def test_fetch_to_device_none_stored_by_replace_reads_as_false():
    """TF: only ``InputOptions.__new__`` maps None to True; a None stored by ``_replace`` stays None (TF 2.21 repr)
    and the strategies read it as False (mirrored_strategy.py ``if not options.experimental_fetch_to_device``;
    input_util.py's PER_REPLICA check ``options.experimental_fetch_to_device and ...``): TF 2.21 side by side,
    PER_REPLICA with ``experimental_place_dataset_on_device`` raises for True and runs for False and None."""
    base = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA,
                        experimental_place_dataset_on_device=True)
    stored = base._replace(experimental_fetch_to_device=None)
    assert stored.experimental_fetch_to_device is None
    strategy = mirrored()
    make_dataset = lambda ctx: ms.data.Dataset.range(4).batch(2)  # noqa: E731
    with pytest.raises(ValueError, match="can not be set to True when experimental_fetch_to_device is True"):
        strategy.distribute_datasets_from_function(make_dataset, base._replace(experimental_fetch_to_device=True))
    for options in (stored, base._replace(experimental_fetch_to_device=False)):
        steps = [local(x) for x in strategy.distribute_datasets_from_function(make_dataset, options)]
        assert steps == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]


def test_one_device_strategy_rejects_per_replica_datasets_from_function():
    """TF: one_device_strategy.py ``_distribute_datasets_from_function`` raises NotImplementedError
    "InputReplicationMode.PER_REPLICA is only supported in `experimental_distribute_datasets_from_function`
    of tf.distribute.MirroredStrategy" (checked in TF 2.21)."""
    strategy = ms.OneDeviceStrategy("/cpu:0")
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    message = ("InputReplicationMode.PER_REPLICA is only supported in `experimental_distribute_datasets_from_function` "
               "of tf.distribute.MirroredStrategy")
    for method in (strategy.distribute_datasets_from_function, strategy.experimental_distribute_datasets_from_function):
        with pytest.raises(NotImplementedError) as info:
            method(lambda ctx: ms.data.Dataset.range(4).batch(2), options)
        assert str(info.value) == message
    assert [x.tolist() for x in strategy.distribute_datasets_from_function(
        lambda ctx: ms.data.Dataset.range(4).batch(2))] == [[0, 1], [2, 3]]
    with pytest.raises(NotImplementedError, match="PER_REPLICA is only supported in `distribute_datasets_from_function`"):
        strategy.experimental_distribute_dataset(ms.data.Dataset.range(4).batch(2), options)


def test_empty_optional_get_value_raises_invalid_argument_error():
    """TF: ``tf.experimental.Optional.get_value`` docstring: "Raises: tf.errors.InvalidArgumentError: if this
    has no value" (TF 2.21 message: "The given optional does not have a value.")."""
    assert ms.data.InvalidArgumentError is InvalidArgumentError
    empty = Optional.empty(TensorSpec((), I64))
    with pytest.raises(InvalidArgumentError, match=r"^The given optional does not have a value\.$"):
        empty.get_value()
    assert not issubclass(InvalidArgumentError, OutOfRangeError) and empty.element_spec == TensorSpec((), I64)
    full = Optional.from_value((np.arange(3), np.float32(1.0)))
    assert full.element_spec == (TensorSpec((3,), I64), TensorSpec((), F32)) and full.get_value()[0].tolist() == [0, 1, 2]


# -- Python numbers in datasets -------------------------------------------------------------------------

@pytest.mark.parametrize("value, dtype", [
    ([1.0, 2.0], np.float32), ([1, 2], np.int32), ([[1, 2], [3, 4]], np.int32), ([[1.0, 2], [3, 4]], np.float32),
    ([True, False], np.bool_), ([2**40, 1], np.int64), ([2**31 - 1], np.int32), ([2**31], np.int64),
    ([-2**31 - 1], np.int64), ([1 + 2j], np.complex128), ([1, 2.5], np.float32), ([np.float64(1), 2.0], np.float64),
    ([1, np.float64(2)], np.float32), ([np.int64(1), np.int64(2)], np.int32), ([np.float16(1)], np.float16),
    ([np.array([1.0]), [2.0]], np.float64), (np.array([1.0, 2.0]), np.float64),
])
def test_python_numbers_in_from_tensor_slices_get_tf_dtypes(value, dtype):
    """TF: ``from_tensor_slices`` converts its components with ``tf.convert_to_tensor`` (structure.py
    ``normalize_element``), which gives Python floats float32 and ints int32 (int64 past int32's range), a list the
    dtype of its first leaf when that is a NumPy float; each case printed by TF 2.21 side by side."""
    assert ms.data.Dataset.from_tensor_slices(value).element_spec.dtype == np.dtype(dtype)


def test_python_numbers_in_from_tensors_map_and_optional_get_tf_dtypes():
    """TF 2.21 side by side: ``from_tensors(1)`` is int32, ``from_tensors(1.0)`` float32, ``from_tensors(2**40)``
    int64, ``from_tensors([])`` float32 of shape (0,), NumPy scalars keep their dtype, a ``map`` returning 1.0
    yields float32, ``Optional.from_value(1.0)`` holds a float32 (optional_ops.py ``from_value`` normalizes the
    value, structure.py ``normalize_element``); integers past int64 raise ValueError ("Can't convert Python
    sequence with out-of-range integer to Tensor")."""
    D = ms.data.Dataset
    specs = [D.from_tensors(v).element_spec for v in (1, 1.0, True, 2**40, np.float64(1), np.int64(1), 1j)]
    assert [s.dtype for s in specs] == [np.dtype(d) for d in (np.int32, np.float32, np.bool_, np.int64, np.float64,
                                                                np.int64, np.complex128)]
    assert D.from_tensors([]).element_spec == TensorSpec((0,), F32)
    assert D.from_tensors((1, 2.0)).element_spec == (TensorSpec((), np.dtype(np.int32)), TensorSpec((), F32))
    mapped = D.range(2).map(lambda x: 1.0)
    assert mapped.element_spec == TensorSpec((), F32) and all(x.dtype == F32 for x in mapped)
    one = Optional.from_value(1.0)
    assert one.element_spec == TensorSpec((), F32) and one.get_value().dtype == F32
    pair = Optional.from_value((1, [1.0, 2.0]))
    assert pair.element_spec == (TensorSpec((), np.dtype(np.int32)), TensorSpec((2,), F32))
    assert Optional.from_value(np.float64(1)).element_spec == TensorSpec((), np.dtype(np.float64))
    for value in (2**63, [2**64], [-2**63 - 1]):
        with pytest.raises(ValueError, match="out-of-range integer"):
            D.from_tensors(value)


# -- MPI: the same at 2 and 4 ranks ----------------------------------------------------------------------

def _global_pairs(comm, steps=3, per_replica=2, local_replicas=1):
    """Pairs whose global batch gives every replica ``per_replica`` rows per step (DATA sharding)."""
    n = steps * per_replica * comm.size * local_replicas
    options = ms.data.Options()
    options.experimental_distribute.auto_shard_policy = ms.data.AutoShardPolicy.DATA
    return pairs(n, per_replica * comm.size * local_replicas).with_options(options), n


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local_replicas", [1, 2])
def test_mpi_tuple_elements_and_run_per_replica(comm, local_replicas):
    """As ``test_tuple_elements_yield_a_tuple_of_per_replica_leaves`` across ranks: ``for x, y in dist`` and
    ``strategy.run(step, args=(x, y))``; every label is seen once, by the replica its features went to."""
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(local_replicas)])
    ds, n = _global_pairs(comm, local_replicas=local_replicas)
    dist = strategy.experimental_distribute_dataset(ds)
    labels = []
    for x, y in dist:
        if local_replicas == 1:
            assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
        else:
            assert isinstance(x, ms.PerReplica) and isinstance(y, ms.PerReplica)

        def step(x, y):
            assert np.array_equal(x[:, 0], 2.0 * y)  # features and labels of the same rows
            return y.copy()

        labels.extend(int(v) for part in strategy.experimental_local_results(strategy.run(step, args=(x, y)))
                      for v in part)
    everything = sorted(v for vs in comm.allgather(labels) for v in vs)
    assert everything == list(range(n))
    two = local_replicas > 1
    spec = dist.element_spec
    assert spec == ((PerReplicaSpec((TensorSpec((None, 2), F32),) * 2), PerReplicaSpec((TensorSpec((None,), I64),) * 2))
                    if two else (TensorSpec((None, 2), F32), TensorSpec((None,), I64)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local_replicas", [1, 2])
def test_mpi_next_inside_the_replica_function_raises_everywhere_and_takes_nothing(comm, local_replicas):
    """TF's ``get_next`` rule (input_lib.py ``DistributedIterator.get_next``) on every rank; the ranks' step
    agreement is untouched: the next step outside is the first, and every rank stops at the same step."""
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(local_replicas)])
    ds, n = _global_pairs(comm, steps=3, per_replica=1, local_replicas=local_replicas)
    it = iter(strategy.experimental_distribute_dataset(ds))
    for take in (next, lambda i: i.get_next(), lambda i: i.get_next_as_optional()):
        with pytest.raises(ValueError) as info:
            strategy.run(lambda: take(it))
        assert str(info.value) == NEXT_IN_REPLICA_FN
    _, y = next(it)
    first = [int(v) for part in strategy.experimental_local_results(y) for v in part]
    replica0 = comm.rank * local_replicas
    assert first == list(range(replica0, replica0 + local_replicas))
    rest = sum(1 for _ in it)
    assert comm.allgather(rest) == [2] * comm.size
    end = it.get_next_as_optional()
    assert not end.has_value() and len(end.element_spec) == 2


@pytest.mark.mpi(min_size=2)
def test_mpi_several_workers_need_batched_input_on_every_rank(comm):
    """With one replica per rank there are still several replicas in sync: the unbatched pass-through is for
    one replica in all (TF rebatches for several replicas); every rank gets the same clear error."""
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0"])
    with pytest.raises(InputPipelineError, match=r"call \.batch"):
        list(strategy.experimental_distribute_dataset(ms.data.Dataset.range(4 * comm.size)))


@pytest.mark.mpi(min_size=2)
def test_mpi_datasets_from_function_with_different_structures_fail_on_every_rank(comm):
    """A rank whose replicas' datasets differ in structure fails the pipeline on every rank, naming it."""
    from mpistrat.comm import RankCommunicator

    last = comm.size - 1

    def dataset_fn(ctx):
        odd = ctx.input_pipeline_id == 2 * last + 1  # the last rank's second replica
        ds = ms.data.Dataset.from_tensor_slices({"x": np.arange(2)} if odd else (np.arange(2), np.arange(2)))
        return ds.batch(1)

    rank_comm = RankCommunicator(comm)
    try:
        info = InputWorkerInfo(comm.size, comm.rank, ("/cpu:0", "/cpu:1"), 2 * comm.size, 2 * comm.rank, rank_comm)
        dist = DistributedDatasetsFromFunction(dataset_fn, info, InputOptions(
            experimental_replication_mode=InputReplicationMode.PER_REPLICA))
        with pytest.raises(InputPipelineError, match=rf"failed on rank\(s\) \[{last}\].*different structures"):
            list(dist)
    finally:
        rank_comm.close()
