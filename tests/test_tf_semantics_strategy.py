"""Strategy and value behaviours as TF 2.21 has them: nested reduce and local results, Mirrored as its value,
namedtuple regrouping, TF's strategy-mixing checks and texts, ``ms.nn`` and ``ms.experimental``'s alias,
deep copies of strategies and the synchronization a strategy's variables report.

Each test states TensorFlow's behaviour and where TF documents or tests it;
the cases were also run side by side with TF 2.21 (2 logical CPUs). MPI cases
run under ``mpiexec -n 2`` and ``-n 4`` (``--only-mpi``).
"""

import collections
import copy
import threading

import numpy as np
import pytest

import mpistrat as ms

from helpers import make, multi_worker, rid


# ---------------------------------------------------------------------------------------------
# Strategy.reduce of a nested structure. TF reduces each leaf with axis=None and keeps the structure
# (distribute_lib.Strategy.reduce -> extended._reduce -> reduce_to, which maps over the nest); a plain
# leaf follows the plain-value rules: SUM over several replicas raises "A non-DistributedValues value
# ... cannot be reduced with the given reduce op", MEAN gives it back (TF 2.21 side by side). With an
# axis, TF 2.21 fails on a nest inside its reduce_sum tf.function; mpistrat reduces each leaf there too.
@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_of_a_nested_structure(n):
    s = make(n)
    out = s.run(lambda: (np.ones(2) * rid(), {"b": np.arange(3.0) + rid()}))
    total = sum(range(n))
    got = s.reduce("sum", out, axis=None)
    assert isinstance(got, tuple) and isinstance(got[1], dict)
    assert got[0].tolist() == [total] * 2 and got[1]["b"].tolist() == [total, n + total, 2 * n + total]
    mean = s.reduce("mean", out, axis=None)
    assert mean[0].tolist() == [total / n] * 2
    along = s.reduce("sum", out, axis=0)
    assert float(along[0]) == 2 * total and float(along[1]["b"]) == 3 * n + 3 * total
    mean_along = s.reduce("mean", out, axis=0)
    assert float(mean_along[0]) == total / n and float(mean_along[1]["b"]) == 1.0 + total / n
    assert s.reduce("max", [out[0], out[0]], axis=None)[1].tolist() == [n - 1] * 2
    assert s.reduce("sum", (), axis=None) == ()


def test_reduce_of_a_nest_with_a_plain_leaf_follows_the_plain_value_rules():
    s = make(2)
    pr = s.run(lambda: np.float32(rid()))
    with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
        s.reduce("sum", (pr, np.float32(5.0)), axis=None)
    got = s.reduce("mean", (pr, np.float32(5.0)), axis=None)
    assert float(got[0]) == 0.5 and float(got[1]) == 5.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local", [1, 2], ids=["1local", "2local"])
def test_reduce_of_a_nested_structure_across_workers(local):
    from mpi4py import MPI

    size = MPI.COMM_WORLD.size
    s = multi_worker(local)
    n = s.num_replicas_in_sync
    out = s.run(lambda: {"a": np.full(1, float(rid())), "b": [np.full(2, 1.0), np.arange(rid() + 1.0)]})
    got = s.reduce("sum", out, axis=0)  # rows of different lengths per replica: fine along the axis
    assert float(got["a"]) == n * (n - 1) / 2 and float(got["b"][0]) == 2.0 * n
    assert float(got["b"][1]) == sum(sum(range(g + 1)) for g in range(n))
    full = s.reduce("sum", {"a": out["a"], "c": out["b"][0]}, axis=None)
    assert full["a"].tolist() == [n * (n - 1) / 2] and full["c"].tolist() == [float(n)] * 2
    assert n == size * local


# A rank reducing an empty nest still takes part in the reduction. TF: "all replicas need to participate in
# the all-reduce, otherwise this operation hangs ... they need to execute in the same order on all replicas"
# (distribute_lib.py, ReplicaContext.all_reduce); reduce of () gives () (TF 2.21 side by side). mpistrat
# checks the ranks' calls instead of hanging: one rank reducing nothing while another reduces a value raises
# a mismatch on every rank, and the next reduction is not paired with the wrong one.
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local", [1, 2], ids=["1local", "2local"])
def test_reduce_of_an_empty_nest_takes_part_across_workers(local):
    from mpi4py import MPI

    from mpistrat.comm import CollectiveMismatchError

    rank = MPI.COMM_WORLD.rank
    s = multi_worker(local)
    n = s.num_replicas_in_sync
    assert s.reduce("sum", (), axis=None) == () and s.reduce("sum", {}, axis=0) == {}  # every rank: agreed
    ones = s.run(lambda: np.float32(1.0))
    with pytest.raises(CollectiveMismatchError, match="array counts"):
        s.reduce("sum", () if rank == 0 else (ones,), axis=None)
    rows = s.run(lambda: np.ones(3, np.float32))
    with pytest.raises(CollectiveMismatchError, match="array counts"):
        s.reduce("mean", [] if rank == 1 else [rows], axis=0)
    tens = s.run(lambda: np.float32(10.0 * (rank + 1)))
    assert float(s.reduce("sum", tens, axis=None)) == 10.0 * local * sum(range(1, MPI.COMM_WORLD.size + 1))
    assert float(s.reduce("sum", ones, axis=None)) == n


# ---------------------------------------------------------------------------------------------
# experimental_local_results of a nested structure. TF: one structure per local replica, distributed
# leaves replaced by their component, plain leaves repeated, even with no distributed value inside;
# a plain (non-nested) value gives (value,) (distribute_lib.StrategyExtendedV2._local_results; tested in
# strategy_common_test.py, StrategyLocalResultTest.testLocalResultForNestedStructWithoutTensor).
def test_local_results_of_nested_structures():
    s = make(2)
    out = s.run(lambda: {"a": 1.0, "b": 2.0})  # the same objects on every replica: not distributed
    assert s.experimental_local_results(out) == ({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0})
    assert s.experimental_local_results((1.0, {"a": 2.0})) == ((1.0, {"a": 2.0}), (1.0, {"a": 2.0}))
    assert s.experimental_local_results([1.0, 2.0]) == ([1.0, 2.0], [1.0, 2.0])
    assert s.experimental_local_results(1.0) == (1.0,)
    pr = s.run(lambda: np.float64(rid()))
    assert s.experimental_local_results((pr, 3.0)) == ((0.0, 3.0), (1.0, 3.0))
    assert make(1).experimental_local_results((1.0, 2.0)) == ((1.0, 2.0),)
    assert ms.OneDeviceStrategy("/cpu:0").experimental_local_results((1.0, 2.0)) == ((1.0, 2.0),)


# ---------------------------------------------------------------------------------------------
# A Mirrored value stands for its value. TF's Mirrored is a DistributedDelegate (values.py): operators,
# indexing and attributes act on the current replica's component (the primary in cross-replica context,
# _get_cross_replica -> _get_on_device_or_primary), and it converts to a tensor/NumPy array as its
# primary (values.py _tensor_conversion_mirrored_val); tested in values_test.py,
# DistributedDelegateTest.testOperatorOverride. A PerReplica has no operators, and converts only inside a
# replica (values.py _per_replica_to_tensor).
def test_mirrored_value_is_usable_as_its_value_in_cross_replica_context():
    m = ms.Mirrored([np.array([1.0, 2.0]), np.array([1.0, 2.0])])
    assert (m + 1).tolist() == [2.0, 3.0] and (1 + m).tolist() == [2.0, 3.0]
    assert (-m).tolist() == [-1.0, -2.0] and (m * m).tolist() == [1.0, 4.0] and (m < 2).tolist() == [True, False]
    assert float(m[1]) == 2.0 and float(m @ np.ones(2)) == 3.0
    seven = ms.Mirrored((7, 7))
    assert pow(seven, 3) == 343 and pow(seven, 3, 10) == 3 and pow(2, seven) == 128 and ~seven == ~7
    assert np.asarray(m).tolist() == [1.0, 2.0] and np.add(m, 1.0).tolist() == [2.0, 3.0]
    assert m.shape == (2,) and m.dtype == np.float64
    arr = np.asarray(m)
    arr[0] = 9.0  # a copy, as a tensor's numpy(): the components stay as they are
    assert m.values[0].tolist() == [1.0, 2.0]
    with make(2).scope():
        assert (m + 1).tolist() == [2.0, 3.0]
    assert bool(ms.Mirrored([np.float64(0.0)] * 2)) is False
    p = ms.PerReplica([np.zeros(2), np.ones(2)])
    with pytest.raises(ValueError, match="not inside a replica context"):
        np.asarray(p)
    with pytest.raises(TypeError):
        p + 1  # noqa: B018


def test_mirrored_value_in_replica_context_is_the_replicas_component():
    s = make(2)
    m = ms.Mirrored([np.float64(10.0), np.float64(20.0)])
    out = s.run(lambda: m + rid())  # captured, not passed as an argument: each replica reads its own copy
    assert [float(x) for x in s.experimental_local_results(out)] == [10.0, 21.0]


def test_distributed_values_have_no_len():
    # TF's DistributedValues, Mirrored and PerReplica define no __len__ (values.py): TF 2.21 raises
    # "TypeError: object of type 'Mirrored' has no len()" (and the same for PerReplica), while indexing acts
    # on the value, so iterating a Mirrored walks the value's first axis.
    m = ms.Mirrored([np.array([1.0, 3.0, 5.0]), np.array([1.0, 3.0, 5.0])])
    with pytest.raises(TypeError, match="object of type 'Mirrored' has no len()"):
        len(m)
    with pytest.raises(TypeError, match="object of type 'PerReplica' has no len()"):
        len(ms.PerReplica([np.zeros(2), np.ones(2)]))
    assert [float(x) for x in m] == [1.0, 3.0, 5.0] and len(m.values) == 2


def test_variable_arithmetic_reads_a_mirrored_operand():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0)
    m = ms.Mirrored([np.float32(2.0), np.float32(2.0)])
    assert float(v + m) == 3.0 and float(m * v) == 2.0


# ---------------------------------------------------------------------------------------------
# Regrouping a namedtuple subclass rebuilds it with _make, never its own __new__ (distribute_utils.regroup:
# "This tuple is in fact a namedtuple! ... v0._make(regrouped_tuple)"; tested in distribute_utils_test.py,
# RegroupAndSelectDeviceTest.testNamedTuple with an EstimatorSpec whose __new__ adds a default field).
class _OneArg(collections.namedtuple("_OneArg", ["a", "b"])):
    def __new__(cls, a):
        return super().__new__(cls, a, a)


class _Spec(collections.namedtuple("_Spec", ["loss", "scaffold"])):
    made = 0

    def __new__(cls, loss, scaffold=None):
        cls.made += 1
        return super().__new__(cls, loss, scaffold if scaffold is not None else object())


def test_regroup_of_a_namedtuple_subclass_uses_make():
    s = make(2)
    out = s.run(lambda: _OneArg(np.float64(rid())))
    assert type(out) is _OneArg
    assert [float(x) for x in s.experimental_local_results(out.b)] == [0.0, 1.0]
    scaffold = object()
    before = _Spec.made
    spec = s.run(lambda: _Spec(np.float64(rid()), scaffold))
    assert _Spec.made - before == 2  # the replicas' own constructions only
    assert type(spec) is _Spec and spec.scaffold is scaffold
    assert [float(x) for x in s.experimental_local_results(spec.loss)] == [0.0, 1.0]


def test_nest_rebuilds_a_namedtuple_subclass_with_its_own_new():
    # tf.nest.map_structure and pack_sequence_as call the type (nest_util.py sequence_like:
    # "instance_type(*args)"), so a subclass's own __new__ runs there; only regroup uses _make. TF 2.21 side
    # by side: a __new__ taking one argument fails in tf.nest.map_structure with a TypeError.
    from mpistrat import nest

    before = _Spec.made
    spec = _Spec(np.float64(1.0), "scaffold")
    mapped = nest.map_structure(lambda x: x, spec)
    packed = nest.pack_sequence_as(spec, [np.float64(2.0), "other"])
    assert _Spec.made - before == 3 and type(mapped) is _Spec and packed == (2.0, "other")
    with pytest.raises(TypeError):
        nest.map_structure(lambda x: x, _OneArg(1.0))
    with pytest.raises(TypeError):
        nest.pack_sequence_as(_OneArg(1.0), [2.0, 3.0])


# ---------------------------------------------------------------------------------------------
# experimental_make_numpy_dataset checks the strategy in scope (TF: StrategyExtendedV1.
# experimental_make_numpy_dataset -> _require_cross_replica_or_default_context_extended): another
# strategy's scope or replica raises "Mixing different tf.distribute.Strategy objects", its own replica
# "Method requires being in cross-replica context"; the default strategy's inside another strategy's
# scope or run raises "Mixing ..." too (TF 2.21 side by side, tf.compat.v1.distribute strategies).
def test_make_numpy_dataset_checks_the_strategy_in_scope():
    s, s2 = make(2), make(2)
    default = ms.get_strategy()
    x = np.ones(4, np.float32)
    with s.scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            s2.experimental_make_numpy_dataset(x)
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            default.experimental_make_numpy_dataset(x)
        assert len(list(s.experimental_make_numpy_dataset(x))) == 4
    with pytest.raises(RuntimeError, match="Method requires being in cross-replica context"):
        s.run(lambda: s.experimental_make_numpy_dataset(x))
    with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
        s2.run(lambda: s.experimental_make_numpy_dataset(x))
    with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
        s.run(lambda: default.experimental_make_numpy_dataset(x))
    assert len(list(s.experimental_make_numpy_dataset(x))) == 4
    with default.scope():
        assert len(list(s.experimental_make_numpy_dataset(x))) == 4


# ---------------------------------------------------------------------------------------------
# run(fn, args=<not a list or tuple>): TF raises ValueError "positional args must be a list or tuple,
# got <class 'int'>" (distribute_lib.Strategy.run), for every strategy including the default one.
@pytest.mark.parametrize("args", [1, "ab", {"a": 1}, None, np.ones(2), iter([1])],
                         ids=["int", "str", "dict", "None", "ndarray", "iterator"])
@pytest.mark.parametrize("make_strategy", [lambda: ms.get_strategy(), lambda: ms.OneDeviceStrategy("/cpu:0"),
                                           lambda: make(1), lambda: make(2)],
                         ids=["default", "one_device", "mirrored1", "mirrored2"])
def test_run_args_must_be_a_list_or_tuple(args, make_strategy):
    strategy = make_strategy()
    with pytest.raises(ValueError) as info:
        strategy.run(lambda *a: 1, args=args)
    assert str(info.value) == f"positional args must be a list or tuple, got {type(args)}"


# ---------------------------------------------------------------------------------------------
# ms.experimental.MultiWorkerMirroredStrategy is tf.distribute.experimental.MultiWorkerMirroredStrategy
# (collective_all_reduce_strategy.py: _CollectiveAllReduceStrategyExperimental, exported as
# distribute.experimental.MultiWorkerMirroredStrategy).
def test_experimental_multi_worker_alias():
    import subprocess
    import sys

    assert ms.experimental.MultiWorkerMirroredStrategy is ms.MultiWorkerMirroredStrategy
    assert issubclass(ms.experimental.MultiWorkerMirroredStrategy, ms.Strategy)
    assert "MultiWorkerMirroredStrategy" in ms.experimental.__all__
    # importing the alias loads no MPI (only making a strategy does)
    code = "import sys, mpistrat as ms; ms.experimental.MultiWorkerMirroredStrategy; print('mpi4py.MPI' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60).stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# copy.deepcopy of a strategy. TF (distribute_lib.Strategy.__deepcopy__): a new strategy of the same class
# whose extended is a deep copy of the original's, pointing back to the new strategy; the cross-device ops
# are copied too. It is another strategy: entering its scope inside the original's raises "Mixing different
# tf.distribute.Strategy objects", and so does updating the original's distributed variable in its scope.
# copy.copy raises RuntimeError "Must only deepcopy DistributionStrategy." (Strategy.__copy__). TF 2.21 side by
# side (MirroredStrategy on 2 logical CPUs, OneDeviceStrategy).
@pytest.mark.parametrize("make_strategy", [lambda: make(2), lambda: make(1), lambda: ms.OneDeviceStrategy("/cpu:0")],
                         ids=["mirrored2", "mirrored1", "one_device"])
def test_deepcopy_of_a_strategy(make_strategy):
    s = make_strategy()
    with s.scope():
        v = ms.Variable(1.0)
    c = copy.deepcopy(s)
    assert type(c) is type(s) and c is not s and c.extended is not s.extended
    assert c.extended.worker_devices == s.extended.worker_devices and c.num_replicas_in_sync == s.num_replicas_in_sync
    with c.scope():
        assert ms.get_strategy() is c
        w = ms.Variable(2.0)
    assert c.extended.variable_created_in_scope(w) and not s.extended.variable_created_in_scope(w)
    n = c.num_replicas_in_sync
    assert list(c.experimental_local_results(c.run(rid))) == list(range(n))
    assert float(c.reduce("sum", c.run(lambda: np.float32(rid() + 1)), axis=None)) == n * (n + 1) / 2
    with s.scope(), pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
        with c.scope():
            pass
    if isinstance(v, ms.DistributedVariable):
        with c.scope(), pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            v.assign(2.0)
    assert list(s.experimental_local_results(s.run(rid))) == list(range(n))  # the original still runs
    with pytest.raises(RuntimeError, match="Must only deepcopy DistributionStrategy."):
        copy.copy(s)


def test_deepcopy_copies_the_cross_device_ops():
    """TF copies them (an explicit ReductionToOneDevice comes back as another one); NCCL communicators belong to
    one object, so a copied NcclAllReduce makes its own."""
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ms.ReductionToOneDevice(reduce_to_device="/cpu:1"))
    c = copy.deepcopy(s)
    ops = c.extended._cross_device_ops
    assert type(ops) is ms.ReductionToOneDevice and ops is not s.extended._cross_device_ops
    assert ops.reduce_to_device == s.extended._cross_device_ops.reduce_to_device
    assert float(c.reduce("mean", c.run(lambda: np.float32(rid())), axis=None)) == 0.5
    nccl = ms.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ms.NcclAllReduce(num_packs=2))
    nccl.extended._cross_device_ops._comms[(0, 1)] = threading.Lock()  # stands for NCCL communicators: no copy
    ops = copy.deepcopy(nccl).extended._cross_device_ops
    assert type(ops) is ms.NcclAllReduce and ops.num_packs == 2 and ops._comms == {}
    assert (0, 1) in nccl.extended._cross_device_ops._comms


def test_deepcopy_of_the_default_strategy_raises():
    """TF: RuntimeError "Should only create a single instance of _DefaultDistributionStrategy"
    (distribute_lib._DefaultDistributionStrategy.__deepcopy__)."""
    with pytest.raises(RuntimeError, match="Should only create a single instance of _DefaultDistributionStrategy"):
        copy.deepcopy(ms.get_strategy())


@pytest.mark.mpi(min_size=1)
def test_deepcopy_of_a_multi_worker_strategy_raises():
    """TF: ValueError "MultiWorkerMirroredStrategy cannot be deep copied in eager mode."
    (collective_all_reduce_strategy.CollectiveAllReduceExtended.__deepcopy__), at any number of workers."""
    s = ms.MultiWorkerMirroredStrategy()
    with pytest.raises(ValueError, match="MultiWorkerMirroredStrategy cannot be deep copied in eager mode."):
        copy.deepcopy(s)
    with pytest.raises(ValueError, match="spans MPI ranks and cannot be deep copied"):
        copy.deepcopy(s.extended)


# ---------------------------------------------------------------------------------------------
# What a variable made with the default synchronization (AUTO) reports. TF 2.21: a distributed variable
# (MirroredStrategy, on one device too, and MultiWorkerMirroredStrategy) reports ON_WRITE, the variable and
# each copy, also when made inside run (distribute_utils._validate_synchronization: "if synchronization ==
# VariableSynchronization.AUTO: return VariableSynchronization.ON_WRITE"); under OneDeviceStrategy and the
# default strategy a plain variable keeps AUTO. The aggregation is the one given (NONE by default); explicit
# ON_WRITE/ON_READ are kept. TF 2.21 side by side (2 logical CPUs).
@pytest.mark.parametrize("make_strategy, reported", [
    (lambda: ms.get_strategy(), ms.VariableSynchronization.AUTO),
    (lambda: ms.OneDeviceStrategy("/cpu:0"), ms.VariableSynchronization.AUTO),
    (lambda: make(1), ms.VariableSynchronization.ON_WRITE),
    (lambda: make(2), ms.VariableSynchronization.ON_WRITE),
], ids=["default", "one_device", "mirrored1", "mirrored2"])
def test_default_synchronization_reported(make_strategy, reported):
    _check_default_synchronization(make_strategy(), reported)


@pytest.mark.mpi(min_size=1)
def test_default_synchronization_reported_multi_worker():
    _check_default_synchronization(ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"]),
                                   ms.VariableSynchronization.ON_WRITE)


def _check_default_synchronization(strategy, reported):
    sync, agg = ms.VariableSynchronization, ms.VariableAggregation
    with strategy.scope():
        v = ms.Variable(1.0)
        summed = ms.Variable(1.0, aggregation=agg.SUM)
        on_write = ms.Variable(1.0, synchronization=sync.ON_WRITE)
        on_read = ms.Variable(1.0, synchronization=sync.ON_READ)
    in_run = strategy.run(lambda: ms.Variable(1.0))
    assert (v.synchronization, v.aggregation) == (reported, agg.NONE)
    assert (summed.synchronization, summed.aggregation) == (reported, agg.SUM)
    assert (in_run.synchronization, in_run.aggregation) == (reported, agg.NONE)
    assert on_write.synchronization is sync.ON_WRITE and on_read.synchronization is sync.ON_READ
    for var in (v, summed, in_run):
        assert [c.synchronization for c in strategy.experimental_local_results(var)] == \
            [reported] * len(strategy.extended.worker_devices)
