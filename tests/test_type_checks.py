"""Type checks (issue 24): reductions and variable assignments refuse what they cannot do exactly, on every rank.

A reduction within one process (local replicas) applies the dtype rule of the cross-rank all-reduce
(``ops.reduce_dtype_error``), so a program tested on a laptop fails as it would on the cluster. An
assignment refuses a change of kind (``arrays.kind_change_error``) instead of truncating floats into an
integer variable; under MultiWorkerMirroredStrategy every rank raises, and no rank is left waiting.
"""

import numpy as np
import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat.comm import CollectiveMismatchError, RankCommunicator

AGG = ms.VariableAggregation
SYNC = ms.VariableSynchronization
BOOL_REASON = "has dtype bool; supported are integer, float and complex dtypes"
KIND_REASON = "do not become"


def _three_cpus():
    return ms.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])


def _one_cpu():
    return ms.MirroredStrategy(["/cpu:0"])


def _one_device():
    return ms.OneDeviceStrategy("/cpu:0")


IN_PROCESS = {"mirrored_3cpu": _three_cpus, "mirrored_1cpu": _one_cpu, "one_device": _one_device}


def _per_replica(strategy, make):
    """A PerReplica with ``make(i)`` on local replica i."""
    return ms.PerReplica(tuple(make(i) for i in range(strategy.num_replicas_in_sync)))


# ---------------------------------------------------------------- reductions within one process


@pytest.fixture(params=list(IN_PROCESS))
def strategy(request):
    return IN_PROCESS[request.param]()


# TF 2.21 (tensorflow/python/distribute/cross_device_ops.py, ReductionToOneDevice ->
# cross_device_utils.aggregate_tensors_or_indexed_slices -> math_ops.add_n) raises for bool over several
# replicas: "Value for attr 'T' of bool is not in the list of allowed values" (AddN has no bool kernel),
# and its collective all-reduce takes none either (CollectiveReduceV2, core/ops/collective_ops.cc:
# T in {bfloat16, float, float16, float64, int32, int64}). With one replica TF returns the value
# unreduced (measured: MirroredStrategy(["/cpu:0"]).reduce(SUM, [True]) is [True]); mpistrat checks
# there too, because the same program on several ranks reduces and raises.
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
def test_bool_is_not_reduced(strategy, op):
    value = _per_replica(strategy, lambda i: np.array([True, False]))
    with pytest.raises(TypeError, match=f"{op} reduction: value #0 {BOOL_REASON}"):
        strategy.reduce(op, value, axis=None)
    with pytest.raises(TypeError, match=BOOL_REASON):
        strategy.run(lambda: ms.get_replica_context().all_reduce(op, np.array([True])))


def test_mean_of_a_python_bool_is_not_a_fraction(strategy):
    # Was 0.333 over three replicas (True summed as 1, divided by 3).
    with pytest.raises(TypeError, match=BOOL_REASON):
        strategy.reduce("MEAN", _per_replica(strategy, lambda i: True), axis=None)
    # A plain (non-distributed) value is placed unreduced in one process but reduced across ranks.
    with pytest.raises(TypeError, match=BOOL_REASON):
        strategy.reduce("MEAN", True, axis=None)


def test_the_rule_is_the_cross_rank_all_reduce_one():
    """The reason is word for word the multi-rank path's (Planner.invalid), here at one rank."""
    rc = RankCommunicator(MPI.COMM_SELF)
    try:
        with pytest.raises(TypeError) as cluster:
            rc.allreduce([np.array([True])], "sum")
        with pytest.raises(TypeError) as cluster_complex:
            rc.allreduce([np.array([1j])], "max")
    finally:
        rc.close()
    with pytest.raises(TypeError) as local:
        _three_cpus().reduce("SUM", ms.PerReplica((np.array([True]),) * 3), axis=None)
    with pytest.raises(TypeError) as local_complex:
        _three_cpus().reduce("MAX", ms.PerReplica((np.array([1j]),) * 3), axis=None)
    assert str(cluster.value) == f"allreduce: array #0 {BOOL_REASON}"
    assert str(local.value) == f"SUM reduction: value #0 {BOOL_REASON}"
    reason = "has dtype complex128: op 'max' is not defined for complex dtypes"
    assert str(cluster_complex.value) == f"allreduce: array #0 {reason}"
    assert str(local_complex.value) == f"MAX reduction: value #0 {reason}"


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_complex_min_max_is_refused_and_sum_is_not(strategy, op):
    value = _per_replica(strategy, lambda i: np.array([1 + 2j * i], np.complex64))
    with pytest.raises(TypeError, match=f"op '{op.lower()}' is not defined for complex dtypes"):
        strategy.reduce(op, value, axis=None)
    n = strategy.num_replicas_in_sync
    total = strategy.reduce("SUM", value, axis=None)
    assert total.dtype == np.complex64
    np.testing.assert_array_equal(total, np.array([n + 1j * n * (n - 1)], np.complex64))


# What the issue found: strings came back as the first replica's value, object arrays were multiplied,
# all_reduce(None) failed 17 frames deep. The boundary conversion (arrays.as_array) refuses them.
@pytest.mark.parametrize("make, shown", [
    (lambda i: f"x{i}", "has dtype <U2, which is not numeric"),
    (lambda i: np.array([1, "a"], dtype=object), "has dtype object, which is not numeric"),
    (lambda i: None, "NoneType None has dtype object, which is not numeric"),
], ids=["str", "object", "None"])
def test_non_numeric_values_are_refused(strategy, make, shown):
    with pytest.raises(TypeError, match=shown):
        strategy.reduce("SUM", _per_replica(strategy, make), axis=None)
    with pytest.raises(TypeError, match=shown):
        strategy.run(lambda: ms.get_replica_context().all_reduce("sum", make(0)))


# TF 2.21: AddN over float32 and float64 replicas raises ("cannot compute AddN as input #1(zero-based) was
# expected to be a float tensor but is a double tensor"); across ranks the agreement raises a mismatch.
# Here the second replica's float64 was cast to the first's float32 (an int after a float raised NumPy's
# casting error, a float after an int was reduced as the int's dtype).
@pytest.mark.parametrize("second", [np.float64, np.int32])
def test_replicas_with_different_dtypes_are_refused(second):
    value = ms.PerReplica((np.ones(2, np.float32), np.ones(2, second), np.ones(2, np.float32)))
    with pytest.raises(TypeError, match=f"value #0 has dtype float32 on local replica 0 and "
                                        f"{np.dtype(second)} on local replica 1"):
        _three_cpus().reduce("SUM", value, axis=None)

    def step():
        ctx = ms.get_replica_context()
        return ctx.all_reduce("SUM", np.ones(2, second if ctx.replica_id_in_sync_group == 2 else np.float32))

    with pytest.raises(TypeError, match="on local replica 2"):
        _three_cpus().run(step)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int64", "float16", "float32", "float64", "complex64"])
@pytest.mark.parametrize("op", ["SUM", "MIN", "MAX"])
def test_numeric_dtypes_still_reduce_exactly(strategy, dtype, op):
    if op != "SUM" and np.dtype(dtype).kind == "c":
        pytest.skip("refused above")
    parts = [np.array([1, 5, 3], dtype) + np.array(i, dtype) for i in range(strategy.num_replicas_in_sync)]
    out = strategy.reduce(op, ms.PerReplica(tuple(parts)), axis=None)
    expected = {"SUM": np.add, "MIN": np.minimum, "MAX": np.maximum}[op].reduce(np.stack(parts), axis=0)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, expected)


def test_mean_of_integers_is_a_float64_quotient():
    strategy = _three_cpus()  # (over one replica, _divide returns the integers unchanged)
    n = strategy.num_replicas_in_sync
    out = strategy.reduce("MEAN", _per_replica(strategy, lambda i: np.array([i, 1], np.int32)), axis=None)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, [(n - 1) / 2, 1.0])


# ---------------------------------------------------------------- variable assignment

# What TF 2.21 does for tf.Variable(init, dtype).assign(value) (ResourceVariable.assign in
# tensorflow/python/ops/resource_variable_ops.py converts with ops.convert_to_tensor(value,
# dtype=self.dtype); eager conversion, tensorflow/python/eager/pywrap_tensor.cc, casts only where
# IsCompatible(desired, inferred) holds: integers into integers, integers and floats into floats, any
# number into complex, and raises "TypeError: Cannot convert 1.7 to EagerTensor of dtype int32" for the
# rest). Measured with tensorflow-cpu 2.21.0:
#   [1.7, 2.9] into int32 -> TypeError ("Cannot convert [1.7, 2.9] to EagerTensor of dtype int32")
#   1j into float32 -> TypeError; 1 or 1.0 into bool -> TypeError ("Cannot convert 1 to EagerTensor of dtype bool")
#   np.float64 array into float32, Python float into float32/float16, Python int into int32/float32 -> cast
#   Python True into int32/float32 -> 1 (its converters read a bool as a Python int; into uint8 or
#   complex64, which have no converter of their own, TypeError); NumPy bools into any number -> cast
# TF casts NumPy arrays whatever their kind (np.array([1.7, 2.9]) into int32 gives [1, 2], NaN gives
# -2147483648, complex drops its imaginary part), the silent loss issue 24 reports: mpistrat applies
# the rule above to every value, NumPy arrays included.
REFUSED = {
    "floats list into int32": ("int32", [1.7, 2.9]),
    "float64 array into int32": ("int32", np.array([1.7, 2.9])),
    "NaN into int32": ("int32", np.array([np.nan, 1.0])),
    "Python float into int32": ("int32", 2.0),
    "float32 scalar into int64": ("int64", np.float32(1.5)),
    "float into uint8": ("uint8", [1.5, 2.0]),
    "complex array into float32": ("float32", np.array([1j, 2])),
    "Python complex into float32": ("float32", 1j),
    "complex into int32": ("int32", np.array([1 + 0j, 2 + 0j])),
    "Python int into bool": ("bool", [1, 0]),
    "int array into bool": ("bool", np.array([1, 0])),
    "float into bool": ("bool", [1.0, 0.0]),
}
ACCEPTED = {  # value, stored
    "float64 array into float32": ("float32", np.array([1.7, 2.9]), np.array([1.7, 2.9], np.float32)),
    "Python floats into float32": ("float32", [1.7, 2.9], np.array([1.7, 2.9], np.float32)),
    "float64 into float16": ("float16", np.array([0.1, 70000.0]), np.array([0.1, np.inf], np.float16)),
    "Python ints into int32": ("int32", [3, 4], np.array([3, 4], np.int32)),
    "int64 array into int32": ("int32", np.array([3, 4], np.int64), np.array([3, 4], np.int32)),
    "Python ints into float32": ("float32", [3, 4], np.array([3, 4], np.float32)),
    "int64 array into float32": ("float32", np.array([3, 4]), np.array([3, 4], np.float32)),
    "floats into complex64": ("complex64", [1.5, 2.0], np.array([1.5, 2.0], np.complex64)),
    "Python bools into int32": ("int32", [True, False], np.array([1, 0], np.int32)),
    "bool array into float32": ("float32", np.array([True, False]), np.array([1, 0], np.float32)),
    "bools into bool": ("bool", [False, True], np.array([False, True])),
}
INITIAL = {"int32": [1, 2], "int64": [1, 2], "uint8": [1, 2], "float32": [1.0, 2.0], "float16": [1.0, 2.0],
           "complex64": [1.0, 2.0], "bool": [True, True]}


def _kind_error(method, name, dtype, value_dtype):
    return rf"{method} to variable '{name}' of dtype {dtype}: the value has dtype {value_dtype}; .* {KIND_REASON}"


def _value_dtype(value):
    """How the error names the value's dtype: a Python number's type, else its NumPy dtype."""
    if isinstance(value, (bool, int, float, complex)) and not isinstance(value, np.generic):
        return f"Python {type(value).__name__}"
    return np.asarray(value).dtype


@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_change_of_kind_is_refused_and_the_variable_kept(case, method):
    dtype, value = REFUSED[case]
    v = ms.Variable(INITIAL[dtype], dtype=dtype, name="w")
    with pytest.raises(TypeError, match=_kind_error(method, "w", dtype, _value_dtype(value))):
        getattr(v, method)(value)
    np.testing.assert_array_equal(v.numpy(), np.array(INITIAL[dtype], dtype))


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_same_kind_and_widening_values_are_taken(case):
    dtype, value, stored = ACCEPTED[case]
    v = ms.Variable(INITIAL[dtype], dtype=dtype, name="w")
    with np.errstate(over="ignore"):
        v.assign(value)
    assert v.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(v.numpy(), stored)
    if dtype == "bool":
        return
    for method, sign in (("assign_add", 1), ("assign_sub", -1)):
        v = ms.Variable(np.zeros(2, dtype), name="w")
        with np.errstate(over="ignore"):
            getattr(v, method)(value)
        assert v.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(v.numpy(), sign * stored)


def test_the_issue_examples():
    v = ms.Variable([1, 2], dtype="int32", name="counts")
    with pytest.raises(TypeError, match="variable 'counts' of dtype int32: the value has dtype float64"):
        v.assign(np.array([1.7, 2.9]))
    with pytest.raises(TypeError, match="variable 'counts' of dtype int32: the value has dtype float64"):
        v.assign(np.array([np.nan, 1.0]))
    with pytest.raises(TypeError, match="assign_add to variable 'counts' of dtype int32: the value has dtype Python float"):
        v.assign_add(0.5)
    np.testing.assert_array_equal(v.numpy(), [1, 2])
    v.assign_add(np.array([1, 1], np.int64))  # same kind: taken
    np.testing.assert_array_equal(v.numpy(), [2, 3])


def test_another_variable_as_the_value():
    source = ms.Variable([1.5, 2.5], dtype="float32", name="src")
    target = ms.Variable([1, 2], dtype="int32", name="dst")
    with pytest.raises(TypeError, match="variable 'dst' of dtype int32: the value has dtype float32"):
        target.assign(source)
    doubles = ms.Variable([0.0, 0.0], dtype="float64", name="wide")
    doubles.assign(source)
    np.testing.assert_array_equal(doubles.numpy(), [1.5, 2.5])


def _int_variables(strategy):
    with strategy.scope():
        return {
            "mirrored NONE": ms.Variable([1, 2], dtype="int32", name="m_none"),
            "mirrored SUM": ms.Variable([1, 2], dtype="int32", name="m_sum", aggregation=AGG.SUM),
            "mirrored ONLY_FIRST_REPLICA": ms.Variable([1, 2], dtype="int32", name="m_first",
                                                       aggregation=AGG.ONLY_FIRST_REPLICA),
            "sync-on-read SUM": ms.Variable([3, 6], dtype="int32", name="r_sum", synchronization=SYNC.ON_READ,
                                            aggregation=AGG.SUM),
            "sync-on-read ONLY_FIRST_REPLICA": ms.Variable([1, 2], dtype="int32", name="r_first",
                                                           synchronization=SYNC.ON_READ,
                                                           aggregation=AGG.ONLY_FIRST_REPLICA),
        }


def _copies(var):
    """Each local copy's value (OneDeviceStrategy makes plain variables: one copy)."""
    return [c.numpy() for c in getattr(var, "values", (var,))]


@pytest.mark.parametrize("kind", ["mirrored NONE", "mirrored SUM", "mirrored ONLY_FIRST_REPLICA", "sync-on-read SUM",
                                  "sync-on-read ONLY_FIRST_REPLICA"])
@pytest.mark.parametrize("method", ["assign", "assign_add"])
def test_distributed_variables_refuse_a_change_of_kind(strategy, kind, method):
    var = _int_variables(strategy)[kind]
    before = _copies(var)
    if not (kind == "sync-on-read SUM" and method == "assign_add"):  # TF refuses that in cross-replica context
        with pytest.raises(TypeError, match=_kind_error(method, var.name, "int32", "float64")):
            getattr(var, method)(np.array([0.5, 1.5]))  # cross-replica context
    with pytest.raises(TypeError, match=_kind_error(method, var.name, "int32", "float64")):
        strategy.run(lambda: getattr(var, method)(np.array([0.5, 1.5])))
    assert all(np.array_equal(a, b) for a, b in zip(_copies(var), before))
    strategy.run(lambda: getattr(var, method)(np.array([2, 2])))  # the same kind goes on working


def test_one_replica_with_a_float_names_the_variable_not_the_reduction():
    strategy = _three_cpus()
    var = _int_variables(strategy)["mirrored SUM"]

    def step():
        replica = ms.get_replica_context().replica_id_in_sync_group
        var.assign_add(np.array([0.5, 0.5]) if replica == 1 else np.array([1, 1]))

    with pytest.raises(TypeError, match=_kind_error("assign_add", "m_sum", "int32", "float64")):
        strategy.run(step)
    assert all(np.array_equal(c, [1, 2]) for c in _copies(var))


def test_one_replica_with_a_string_raises_in_the_merge():
    strategy = _three_cpus()
    var = _int_variables(strategy)["mirrored SUM"]

    def step():
        replica = ms.get_replica_context().replica_id_in_sync_group
        var.assign_add(np.array(["a", "b"]) if replica == 2 else np.array([1, 1]))

    with pytest.raises(TypeError, match="assign_add to variable m_sum: array.* has dtype <U1, which is not numeric"):
        strategy.run(step)
    assert all(np.array_equal(c, [1, 2]) for c in _copies(var))
    strategy.run(lambda: var.assign_add(np.array([1, 1])))
    assert all(np.array_equal(c, [4, 5]) for c in _copies(var))


def test_a_mirrored_value_with_one_bad_copy_changes_no_copy():
    strategy = _three_cpus()
    var = _int_variables(strategy)["mirrored NONE"]
    value = ms.Mirrored((np.array([5, 6]), np.array([5, 6]), np.array([5.5, 6.0])))
    with pytest.raises(TypeError, match="variable 'm_none' of dtype int32: the value has dtype float64"):
        var.assign(value)  # the third copy's value fails: the first two must not have changed either
    assert all(np.array_equal(c, [1, 2]) for c in _copies(var))


# ---------------------------------------------------------------- several ranks


@pytest.fixture
def multi_worker():
    return ms.MultiWorkerMirroredStrategy()


def _next_step_is_in_step(strategy):
    """The next all-reduce pairs with the peers' (no rank is a call ahead or behind)."""
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", np.full(2, 3.0, np.float32)))
    for local in strategy.experimental_local_results(out):
        np.testing.assert_array_equal(local, np.full(2, 3.0 * strategy.num_replicas_in_sync, np.float32))


ALL_REDUCE = {
    "all_reduce": lambda s, x: s.run(lambda: ms.get_replica_context().all_reduce("SUM", x)),
    "all_reduce of a list": lambda s, x: s.run(lambda: ms.get_replica_context().all_reduce("SUM", [x, x])),
    "async all_reduce": lambda s, x: s.run(
        lambda: ms.get_replica_context().experimental_all_reduce_async("SUM", x).result()),
    "strategy.reduce": lambda s, x: s.reduce("SUM", x, axis=None),
    "strategy.reduce MEAN": lambda s, x: s.reduce("MEAN", x, axis=None),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", list(ALL_REDUCE))
@pytest.mark.parametrize("local", [1, 2])
def test_bool_everywhere_raises_the_same_type_error_on_every_rank(call, local):
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(local)])
    with pytest.raises(TypeError, match=BOOL_REASON):
        ALL_REDUCE[call](strategy, np.array([True, False]))
    _next_step_is_in_step(strategy)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", list(ALL_REDUCE))
def test_bool_on_one_rank_raises_on_every_rank(multi_worker, comm, call):
    for _ in range(3):  # a call repeated with its plan cached, as in training
        ALL_REDUCE[call](multi_worker, np.ones(2, np.float32))
    bad = comm.size - 1
    value = np.array([True, False]) if comm.rank == bad else np.ones(2, np.float32)
    # Every rank raises the agreement's mismatch, naming the bad rank's TypeError (tests/test_local_errors_agreed.py).
    with pytest.raises(CollectiveMismatchError, match=f"rank {bad} sent error=TypeError: .*{BOOL_REASON}"):
        ALL_REDUCE[call](multi_worker, value)
    _next_step_is_in_step(multi_worker)


@pytest.mark.mpi(min_size=2)
def test_complex_max_raises_on_every_rank(multi_worker, comm):
    with pytest.raises(TypeError, match="op 'max' is not defined for complex dtypes"):
        multi_worker.reduce("MAX", np.array([1j]), axis=None)
    np.testing.assert_array_equal(multi_worker.reduce("SUM", np.array([1j]), axis=None), [1j * comm.size])


def _mw_variables(strategy):
    with strategy.scope():
        return {
            "SUM": ms.Variable([1, 2], dtype="int32", name="mw_sum", aggregation=AGG.SUM),
            "ONLY_FIRST_REPLICA": ms.Variable([1, 2], dtype="int32", name="mw_first",
                                              aggregation=AGG.ONLY_FIRST_REPLICA),
            "NONE": ms.Variable([1, 2], dtype="int32", name="mw_none"),
        }


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("agg", ["SUM", "ONLY_FIRST_REPLICA", "NONE"])
@pytest.mark.parametrize("local", [1, 2])
def test_a_float_update_everywhere_raises_on_every_rank(agg, local):
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(local)])
    var = _mw_variables(strategy)[agg]
    with pytest.raises(TypeError, match=_kind_error("assign_add", var.name, "int32", "float64")):
        strategy.run(lambda: var.assign_add(np.array([0.5, 0.5])))
    with pytest.raises(TypeError, match=_kind_error("assign", var.name, "int32", "float64")):
        var.assign(np.array([0.5, 0.5]))  # cross-replica: no collective, each rank raises for its value
    assert all(np.array_equal(c, [1, 2]) for c in _copies(var))
    _next_step_is_in_step(strategy)


BAD_UPDATES = {  # value, what the error says
    "float": (np.array([0.5, 0.5]), "of dtype int32: the value has dtype float64; floating-point values do not become"),
    "string": (np.array(["a", "b"]), r"has dtype <U1, which is not numeric"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("agg", ["SUM", "ONLY_FIRST_REPLICA"])
@pytest.mark.parametrize("bad", [0, -1])
@pytest.mark.parametrize("update", list(BAD_UPDATES))
def test_a_bad_update_on_one_rank_raises_on_every_rank(multi_worker, comm, agg, bad, update):
    """The merge's collective would leave the peers waiting; its agreement tells them instead."""
    var = _mw_variables(multi_worker)[agg]
    for _ in range(3):  # good steps first: the reduction's plan is cached, as in training
        multi_worker.run(lambda: var.assign_add(np.array([1, 1], np.int32)))
    before = _copies(var)
    bad = bad % comm.size
    bad_value, says = BAD_UPDATES[update]
    value = bad_value if comm.rank == bad else np.array([1, 1], np.int32)
    with pytest.raises(CollectiveMismatchError, match=rf"rank {bad} sent error=TypeError: assign_add to variable "
                                                      rf"'?{var.name}'?.* {says}"):
        multi_worker.run(lambda: var.assign_add(value))
    assert all(np.array_equal(a, b) for a, b in zip(_copies(var), before))
    multi_worker.run(lambda: var.assign_add(np.array([1, 1], np.int32)))
    assert all(np.array_equal(c, before[0] + (comm.size if agg == "SUM" else 1)) for c in _copies(var))
    _next_step_is_in_step(multi_worker)
