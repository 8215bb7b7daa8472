"""Variables as TF 2.21 has them: created inside ``strategy.run``, deep-copied, constrained, trainable ON_READ.

Each test states TensorFlow's behaviour and where TF documents or tests it;
the TF cases were also run side by side with TF 2.21 (2 logical CPUs).
MPI cases run under ``mpiexec -n 2`` and ``-n 4`` (``--only-mpi``).
"""

import copy

import numpy as np
import pytest

import mpistrat as ms

from helpers import copies, finishes, make, multi_worker, rid

AGG = ms.VariableAggregation
SYNC = ms.VariableSynchronization


# ---------------------------------------------------------------------------------------------
# Variables created inside strategy.run / call_for_each_replica. TF: the first replica creates the
# variable and the other replicas get the same distributed variable (shared_variable_creator.make_fn,
# used by mirrored_run._call_for_each_replica); tested in mirrored_variable_test.py,
# MirroredVariableCreationTest.testSingleVariable / testMultipleVariables / testSyncOnReadVariable /
# testVariableWithSameCanonicalNameAcrossThreads / testNonMatchingVariableCreation.
@pytest.mark.parametrize("n", [1, 2, 4])
def test_variable_created_in_run_is_one_mirrored_variable(n):
    s = make(n)
    seen = []

    def step():
        v = ms.Variable(lambda: np.float32(1.0 + rid()), name="foo")  # only replica 0's initial value is used
        seen.append(v)
        return v

    v = s.run(step)
    assert isinstance(v, ms.MirroredVariable) and v.name == "foo" and v.distribute_strategy is s
    assert all(x is v for x in seen) and len(seen) == n
    assert copies(v) == [1.0] * n
    assert [c.device for c in v.values] == list(s.extended.worker_devices)
    assert s.extended.variable_created_in_scope(v)


def test_variables_created_in_call_for_each_replica_inside_scope():
    # mirrored_variable_test.py, testMultipleVariables and testWithVariableAndVariableScope: several
    # variables, ON_READ ones become SyncOnReadVariable, each with its aggregation.
    s = make(2)

    def model_fn():
        vs = [ms.Variable(1.0, name=f"foo{i}") for i in range(5)]
        ms.get_replica_context().merge_call(lambda _: None)
        on_read = ms.Variable(1.0, name="var2", synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        mean = ms.Variable(1.0, name="var3", synchronization=SYNC.ON_WRITE, aggregation=AGG.MEAN)
        return vs, on_read, mean

    with s.scope():
        vs, on_read, mean = s.extended.call_for_each_replica(model_fn)
    assert [v.name for v in vs] == [f"foo{i}" for i in range(5)]
    assert all(isinstance(v, ms.MirroredVariable) for v in vs)
    assert isinstance(on_read, ms.SyncOnReadVariable) and on_read.aggregation is AGG.SUM
    assert not on_read.trainable  # ON_READ defaults to non-trainable
    assert isinstance(mean, ms.MirroredVariable) and mean.aggregation is AGG.MEAN


def test_sync_on_read_variable_created_in_run_updates_per_replica():
    # mirrored_variable_test.py, testSyncOnReadVariable: the same wrapper in every replica, each replica
    # writes its own copy, a cross-replica read aggregates.
    s = make(2)
    wrappers = {}

    def model_fn():
        v_sum = ms.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        v_sum.assign_add(2.0 + rid())
        wrappers[rid()] = v_sum
        return v_sum

    v = s.run(model_fn)
    assert wrappers[0] is wrappers[1] is v
    assert copies(v) == [3.0, 4.0]
    assert float(s.extended.read_var(v)) == 7.0


def test_variable_names_match_without_uniquifying_suffixes():
    # mirrored_variable_test.py, testVariableWithSameCanonicalNameAcrossThreads: "foo_0" and "foo_1" are one
    # variable, named after the first replica's.
    s = make(2)
    v = s.run(lambda: ms.Variable(1.0, name=f"foo_{rid()}"))
    assert isinstance(v, ms.MirroredVariable) and v.name == "foo_0"


def test_mismatching_variable_creation_raises_on_every_replica():
    # mirrored_variable_test.py, testNonMatchingVariableCreation: RuntimeError; TF's text is
    # "Tried to create variable bar with mismatching name on device 1".
    s = make(2)
    names = ms.PerReplica(("foo", "bar"))
    with s.scope():
        with pytest.raises(RuntimeError, match="Tried to create variable bar with mismatching name on device 1"):
            s.extended.call_for_each_replica(lambda name: ms.Variable(1.0, name=name), args=(names,))
    with pytest.raises(RuntimeError, match="mismatching shape on device 1"):
        s.run(lambda: ms.Variable(np.zeros(2 + rid()), name="w"))


def test_variable_created_by_one_replica_only_raises_instead_of_hanging():
    s = make(2)
    done, box = finishes(lambda: s.run(lambda: ms.Variable(1.0) if rid() == 0 else None))
    assert done, "a variable created by replica 0 alone hung the step"
    assert isinstance(box.get("error"), RuntimeError) and "create_variable" in str(box["error"]), box
    # the strategy still runs steps afterwards
    assert isinstance(s.run(lambda: ms.Variable(2.0)), ms.MirroredVariable)


def test_variable_created_in_run_is_updated_like_one_made_in_scope():
    s = make(2)
    v = s.run(lambda: ms.Variable(0.0, aggregation=AGG.SUM))
    s.run(lambda: v.assign_add(np.float32(rid() + 1)))
    assert copies(v) == [3.0, 3.0]


def test_unnamed_mismatching_variable_is_named_so_in_the_error():
    # TF's text names the variable's name argument ("Tried to create variable None with mismatching name
    # on device 1" for an unnamed one, shared_variable_creator.make_fn's reuse_variable); mpistrat says
    # "an unnamed variable" instead of "variable None".
    s = make(2)
    with pytest.raises(RuntimeError, match="Tried to create an unnamed variable with mismatching shape on device 1"):
        s.run(lambda: ms.Variable(np.zeros(1 + rid())))


# A callable initial value inside strategy.run. TF's shared creator (shared_variable_creator.make_fn, used by
# mirrored_run._call_for_each_replica) makes the variable in the first replica, which alone calls the
# initializer, in its replica context; the other replicas never call theirs. TF 2.21 side by side (2 logical
# CPUs): the initializer runs once, with replica_id_in_sync_group 0; an all_reduce or merge_call inside it
# raises RuntimeError ("Tried to create variable None with mismatching name on device 1": the first replica
# waits in the collective while the second looks the variable up); a variable created inside it works.
def test_initializer_runs_once_in_the_first_replica():
    s = make(2)
    calls = []

    def step():
        v = ms.Variable(lambda: calls.append(rid()) or np.float32(5.0))
        return v.read_value()

    out = s.run(step)
    assert calls == [0] and [float(x) for x in s.experimental_local_results(out)] == [5.0, 5.0]


@pytest.mark.parametrize("collective", ["all_reduce", "merge_call", "all_gather"])
def test_collective_inside_an_initializer_raises_instead_of_hanging(collective):
    s = make(2)
    calls = {
        "all_reduce": lambda ctx: ctx.all_reduce("SUM", np.float32(1.0)),
        "merge_call": lambda ctx: ctx.merge_call(lambda strategy: np.float32(1.0)),
        "all_gather": lambda ctx: ctx.all_gather(np.ones(1, np.float32), axis=0)[0],
    }
    done, box = finishes(lambda: s.run(lambda: ms.Variable(lambda: calls[collective](ms.get_replica_context()))))
    assert done, f"a {collective} inside a variable's initializer hung the step"
    error = box.get("error")
    assert isinstance(error, RuntimeError), box
    assert f"{collective} was called from a variable's initial_value inside strategy.run" in str(error)
    assert copies(s.run(lambda: ms.Variable(2.0))) == [2.0, 2.0]  # the strategy runs steps afterwards


def test_collective_inside_an_initializer_works_with_one_replica():
    # TF 2.21, MirroredStrategy on one device: the all_reduce inside the initializer gives 1.0.
    s = make(1)
    v = s.run(lambda: ms.Variable(lambda: ms.get_replica_context().all_reduce("SUM", np.float32(1.0))))
    assert float(v.numpy()) == 1.0


@pytest.mark.parametrize("n", [1, 2, 4])
def test_variable_created_inside_an_initializer(n):
    # TF 2.21 gives the first replica the outer variable (2.0) and the second the inner one (1.0), found by
    # name in the shared store; here every replica gets the outer one (porting.md lists the difference).
    s = make(n)
    inner = []

    def step():
        def init():
            inner.append(ms.Variable(1.0, name="inner"))
            return inner[-1].read_value() * 2

        v = ms.Variable(init, name="outer")
        return v, v.read_value()

    done, box = finishes(lambda: s.run(step))
    assert done, "a variable created inside another's initializer hung the step"
    v, value = box["result"]
    assert [float(x) for x in s.experimental_local_results(value)] == [2.0] * n
    assert v.name == "outer" and copies(v) == [2.0] * n
    assert len(inner) == 1 and inner[0].name == "inner" and copies(inner[0]) == [1.0] * n


def test_python_int_initial_values_beyond_int32_are_int64():
    # tf.Variable converts its initial value with tf.convert_to_tensor: Python ints are int32, or int64 past
    # int32's range (TF 2.21 side by side: tf.Variable(2**40).dtype is int64), never wrapped around.
    assert ms.Variable(7).dtype == np.int32 and ms.Variable(2.0).dtype == np.float32
    big = ms.Variable(2**40)
    assert big.dtype == np.int64 and int(big.numpy()) == 2**40
    assert ms.Variable([1, 2**31]).numpy().tolist() == [1, 2**31]
    with pytest.raises(ValueError, match="out-of-range integer"):
        ms.Variable(2**64)


def test_variable_created_in_run_under_one_device_strategy_is_plain():
    s = ms.OneDeviceStrategy("/cpu:0")
    v = s.run(lambda: ms.Variable(1.0))
    assert type(v) is ms.Variable and float(v.numpy()) == 1.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local", [1, 2], ids=["1local", "2local"])
def test_variable_created_in_run_under_multi_worker_takes_the_chiefs_value(local):
    # As a variable made in the scope: the chief's initial value on every worker
    # (collective_all_reduce_strategy._get_variable_creator_initial_value broadcasts it).
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    s = multi_worker(local)
    v = s.run(lambda: ms.Variable(np.full(3, float(rank * 10 + rid()), np.float32), name="w"))
    assert isinstance(v, ms.MirroredVariable)
    assert copies(v) == [[0.0, 0.0, 0.0]] * local
    s.run(lambda: v.assign_add(np.ones(3, np.float32)))  # aggregation NONE: every replica adds the same
    assert copies(v) == [[1.0, 1.0, 1.0]] * local


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("local", [1, 2], ids=["1local", "2local"])
def test_initializers_across_workers(local):
    # Each worker's first replica calls the initializer (TF: the first replica of each worker creates the
    # variable, collective_all_reduce_strategy._get_variable_creator_initial_value broadcasts the chief's).
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.rank
    s = multi_worker(local)

    def nested():
        return ms.Variable(lambda: ms.Variable(np.float32(rank + 1.0)).read_value() * 2, name="outer")

    done, box = finishes(lambda: s.run(nested), timeout=30.0)
    assert done and "result" in box, box
    assert copies(box["result"]) == [2.0] * local  # the chief's value on every worker

    def reduced():
        return ms.Variable(lambda: ms.get_replica_context().all_reduce("SUM", np.float32(1.0)))

    if local == 1:  # nobody local to meet: the reduction spans the workers
        assert copies(s.run(reduced)) == [float(MPI.COMM_WORLD.size)]
    else:
        with pytest.raises(RuntimeError, match="all_reduce was called from a variable's initial_value"):
            s.run(reduced)
    assert float(s.reduce("sum", s.run(lambda: np.float32(1.0)), axis=None)) == s.num_replicas_in_sync


@pytest.mark.mpi(min_size=2)
def test_mismatching_shapes_across_workers_raise_on_every_rank():
    from mpi4py import MPI

    from mpistrat.comm import CollectiveMismatchError

    rank = MPI.COMM_WORLD.rank
    s = ms.MultiWorkerMirroredStrategy()
    with pytest.raises(CollectiveMismatchError, match=r"Mismatched broadcast shapes.*rank 0 sent \[\(2,\)"):
        s.run(lambda: ms.Variable(np.zeros(2 + rank), name="w"))
    assert float(s.reduce("sum", s.run(lambda: np.float64(1.0)), axis=None)) == MPI.COMM_WORLD.size


# ---------------------------------------------------------------------------------------------
# copy.deepcopy of a variable. TF: a new variable of the same class, aggregation and strategy, each
# copy on the same device with the same values and its own storage (values.py
# DistributedVariable.__deepcopy__; ResourceVariable.__deepcopy__), allowed inside the variable's
# strategy or with none in scope; tested in distributed_variable_test.py, DistributedVariableTest.testDeepCopy.
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("sync", [SYNC.ON_WRITE, SYNC.ON_READ])
@pytest.mark.parametrize("agg", [AGG.MEAN, AGG.SUM, AGG.ONLY_FIRST_REPLICA])
def test_deepcopy_of_distributed_variable(n, sync, agg):
    s = make(n)
    with s.scope():
        v = ms.Variable(np.arange(3.0, dtype=np.float32), synchronization=sync, aggregation=agg, name="v")
        in_scope = copy.deepcopy(v)
    out_of_scope = copy.deepcopy(v)

    def assert_is_deep_copy(v1, v2):
        assert type(v2) is type(v1) and v2.aggregation is v1.aggregation and v2.synchronization is v1.synchronization
        assert v2.distribute_strategy is v1.distribute_strategy and v2.name == v1.name
        assert len(v2.values) == len(v1.values)
        for a, b in zip(v1.values, v2.values):
            assert a.device == b.device and a is not b and a.value() is not b.value()
            assert a.numpy().tolist() == b.numpy().tolist()

    for c in (in_scope, out_of_scope):
        s.run(assert_is_deep_copy, args=(v, c))
        with s.scope():
            c.assign(np.full(3, 7.0 * n, np.float32))  # independent storage: the original keeps its values
    assert copies(v) == [[0.0, 1.0, 2.0]] * n


def test_deepcopy_of_plain_variable_and_inside_another_strategy():
    v = ms.Variable(np.ones(2, np.float32), name="p", trainable=False)
    c = copy.deepcopy(v)
    assert type(c) is ms.Variable and c.name == "p" and not c.trainable and c.device == v.device
    c.assign([5.0, 6.0])
    assert v.numpy().tolist() == [1.0, 1.0] and c.numpy().tolist() == [5.0, 6.0]
    a, b = make(2), make(2)
    with a.scope():
        m = ms.Variable(1.0)
    with b.scope():  # TF: enter_or_assert_strategy
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            copy.deepcopy(m)


def test_deepcopy_keeps_shared_references_and_works_in_replica_context():
    s = make(2)
    with s.scope():
        v = ms.Variable(1.0)
    pair = copy.deepcopy([v, v])
    assert pair[0] is pair[1] and pair[0] is not v  # deepcopy's memo
    # TF 2.21: each replica deep-copies, so run returns one copy per replica.
    out = s.run(lambda: copy.deepcopy(v))
    firsts = s.experimental_local_results(out)
    assert len(firsts) == 2 and all(isinstance(x, ms.MirroredVariable) and x is not v for x in firsts)


@pytest.mark.mpi(min_size=2)
def test_deepcopy_under_multi_worker():
    from mpi4py import MPI

    s = ms.MultiWorkerMirroredStrategy()
    with s.scope():
        v = ms.Variable(np.full(2, float(MPI.COMM_WORLD.rank), np.float32))  # the chief's value: zeros
    c = copy.deepcopy(v)
    assert type(c) is ms.MirroredVariable and c.distribute_strategy is s and copies(c) == [[0.0, 0.0]]
    c.assign([1.0, 2.0])
    assert copies(v) == [[0.0, 0.0]]


# ---------------------------------------------------------------------------------------------
# constraint: TF stores it and exposes it (tf.Variable docstring, variables.py: "An optional projection
# function to be applied to the variable after being updated by an `Optimizer`"); assign does not apply
# it; a non-callable raises ValueError "Argument `constraint` must be None or a callable"; a distributed
# variable's constraint is its primary's (values.py DistributedVariable.constraint). Keras applies it
# after the update (keras/src/optimizers/base_optimizer.py, apply: "Apply variable constraints after
# applying gradients").
def test_constraint_is_stored_not_applied_by_assign():
    clip = lambda x: np.clip(x, 0.0, 0.5)  # noqa: E731
    v = ms.Variable(1.0, constraint=clip)
    v.assign(3.0)
    assert v.constraint is clip and float(v.numpy()) == 3.0
    assert ms.Variable(1.0).constraint is None
    with pytest.raises(ValueError, match="Argument `constraint` must be None or a callable"):
        ms.Variable(1.0, constraint=3)
    s = make(2)
    with s.scope():
        m = ms.Variable(1.0, constraint=abs)
        with pytest.raises(ValueError, match="Argument `constraint` must be None or a callable"):
            ms.Variable(1.0, constraint=3)
    assert m.constraint is abs and all(c.constraint is abs for c in m.values)
    assert copy.deepcopy(m).constraint is abs


@pytest.mark.parametrize("n", [1, 2])
def test_optimizer_applies_the_constraint_after_the_update(n):
    s = make(n)
    with s.scope():
        w = ms.Variable(np.array([0.2, 0.9], np.float32), constraint=lambda x: np.clip(x, 0.0, 1.0))
        opt = ms.optimizers.SGD(learning_rate=1.0)

    def step():
        opt.apply_gradients([(np.array([0.5, -0.5], np.float32), w)])

    s.run(step)  # summed gradient over n replicas: w - n * g, then clipped into [0, 1]
    assert copies(w) == [[0.0, 1.0]] * n


# ---------------------------------------------------------------------------------------------
# trainable=True with synchronization=ON_READ: TF 2.21 accepts it under every strategy (checked with the
# default, OneDevice, Mirrored with 1 and 2 devices and MultiWorkerMirrored strategies: the variable is
# trainable); trainable left unset defaults to False for ON_READ (tf.Variable docstring, `trainable`:
# "defaults to True, unless synchronization is set to ON_READ").
@pytest.mark.parametrize("make_strategy", [lambda: None, lambda: ms.OneDeviceStrategy("/cpu:0"),
                                           lambda: make(1), lambda: make(2)],
                         ids=["default", "one_device", "mirrored1", "mirrored2"])
def test_trainable_on_read_is_accepted(make_strategy):
    strategy = make_strategy() or ms.get_strategy()
    with strategy.scope():
        on = ms.Variable(1.0, trainable=True, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
        default = ms.Variable(1.0, synchronization=SYNC.ON_READ, aggregation=AGG.SUM)
    assert on.trainable and not default.trainable
    assert on.synchronization is SYNC.ON_READ


# ---------------------------------------------------------------------------------------------
# The default strategy's scope. TF: its variable creator requires the default strategy to be current,
# so a variable created under another strategy inside it raises "Mixing different tf.distribute.Strategy
# objects" (distribute_lib._DefaultDistributionContext, _require_strategy_scope_strategy); entering it
# inside another strategy's scope raises "Must not nest tf.distribute.Strategy scopes." (TF 2.21 side by side).
def test_default_scope_rejects_variables_of_another_strategy():
    s = make(2)
    default = ms.get_strategy()
    with default.scope():
        assert isinstance(ms.Variable(1.0), ms.Variable)  # under the default strategy itself: fine
        with s.scope():
            with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
                ms.Variable(1.0)
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            s.run(lambda: ms.Variable(1.0))
        ms.experimental_set_strategy(s)
        try:
            with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
                ms.Variable(1.0)
        finally:
            ms.experimental_set_strategy(None)
    with s.scope():  # outside the default scope, creation works again
        assert isinstance(ms.Variable(1.0), ms.MirroredVariable)
        with pytest.raises(RuntimeError, match="Must not nest tf.distribute.Strategy scopes"):
            with default.scope():
                pass
