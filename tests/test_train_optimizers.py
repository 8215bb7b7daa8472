"""SGD (momentum, Nesterov) and Adam: update rules against reference loops, replicas, ranks, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.optimizers import SGD, Adam, get

from helpers import DLPackOnly

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([0.1, 0.3, -0.2]), np.array([-1.5, 0.0, 0.7])]
W0 = np.array([1.0, 2.0, -3.0])


def _run(optimizer, grads=GRADS):
    var = ms.Variable(W0.copy(), dtype="float64", name="w")
    for g in grads:
        optimizer.apply_gradients([(g, var)])
    return var.numpy()


def test_sgd_plain():
    np.testing.assert_allclose(_run(SGD(0.1)), W0 - 0.1 * sum(GRADS))


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_matches_reference(nesterov):
    lr, mu = 0.1, 0.9
    w, v = W0.copy(), np.zeros(3)
    for g in GRADS:
        v = mu * v - lr * g
        w = w + (mu * v - lr * g if nesterov else v)
    np.testing.assert_allclose(_run(SGD(lr, momentum=mu, nesterov=nesterov)), w, rtol=1e-14)


def test_adam_matches_reference_and_first_step_is_lr_sign():
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-7
    w, m, v = W0.copy(), np.zeros(3), np.zeros(3)
    for t, g in enumerate(GRADS, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        w = w - lr * m_hat / (np.sqrt(v_hat) + eps / math.sqrt(1 - b2 ** t))  # Keras: epsilon on sqrt(v), not sqrt(v_hat)
    opt = Adam(lr, b1, b2, eps)
    np.testing.assert_allclose(_run(opt), w, rtol=1e-12)
    assert int(opt.iterations.numpy()) == 3
    one = _run(Adam(lr), GRADS[:1])
    np.testing.assert_allclose(one, W0 - lr * np.sign(GRADS[0]), atol=1e-6)


def test_slots_and_variables_listing():
    opt = SGD(0.1, momentum=0.5)
    var = ms.Variable(W0.copy(), name="w")
    opt.apply_gradients([(GRADS[0], var)])
    slot = opt.get_slot(var, "momentum")
    np.testing.assert_allclose(slot.numpy(), -0.1 * GRADS[0], rtol=1e-6)
    assert [v.name for v in opt.variables] == ["SGD/iterations", "SGD/w/momentum"]
    with pytest.raises(KeyError, match="no slot 'm'"):
        opt.get_slot(var, "m")


def test_mirrored_replicas_aggregate_and_stay_identical():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        var = ms.Variable(W0.copy(), dtype="float64", name="w")
        opt = Adam(0.01)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: GRADS[ctx.replica_id_in_sync_group])

    def step(g):
        opt.apply_gradients([(g, var)])  # sums the replicas' gradients (one all-reduce) by default

    strategy.run(step, args=(per_replica,))
    strategy.run(step, args=(per_replica,))
    a, b = (c.numpy() for c in var.values)
    np.testing.assert_array_equal(a, b)
    expected = _run(Adam(0.01), [GRADS[0] + GRADS[1]] * 2)
    np.testing.assert_allclose(a, expected, rtol=1e-12)
    assert isinstance(opt.get_slot(var, "m"), ms.MirroredVariable)
    m0, m1 = (c.numpy() for c in opt.get_slot(var, "m").values)
    np.testing.assert_array_equal(m0, m1)
    with strategy.scope():
        assert int(opt.iterations.numpy()) == 2
        opt.apply_gradients([(GRADS[2], var)])  # cross-replica context: the gradient as given
    assert int(opt.iterations.numpy()) == 3


def test_pre_aggregated_gradients_are_not_summed_again():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        var = ms.Variable(W0.copy(), dtype="float64")
        opt = SGD(1.0)
    strategy.run(lambda: opt.apply_gradients([(np.ones(3), var)], experimental_aggregate_gradients=False))
    np.testing.assert_allclose(var.numpy(), W0 - 1.0)


def test_errors():
    var = ms.Variable(W0.copy())
    for bad in (0, -1, float("nan"), "x"):
        with pytest.raises(ValueError, match="learning_rate"):
            SGD(bad)
    with pytest.raises(ValueError, match="momentum"):
        SGD(0.1, momentum=1.0)
    with pytest.raises(ValueError, match="beta_1"):
        Adam(0.1, beta_1=1.0)
    with pytest.raises(ValueError, match=r"shape \(2,\) does not match variable .* \(3,\)"):
        SGD(0.1).apply_gradients([(np.ones(2), var)])
    with pytest.raises(TypeError, match="variable position"):
        SGD(0.1).apply_gradients([(np.ones(3), np.ones(3))])
    with pytest.raises(ValueError, match="no gradients"):
        SGD(0.1).apply_gradients([(None, var)])
    with pytest.raises(ValueError, match="Unknown optimizer 'rmsprop'"):
        get("rmsprop", 0.1)
    with pytest.raises(RuntimeError, match="not built"):
        SGD(0.1).iterations
    assert isinstance(get("SGD", 0.1), SGD) and get("sgd", 0.1).momentum == 0.9 and isinstance(get("adam", 0.1), Adam)


@pytest.mark.mpi(min_size=2)
def test_multi_worker_sums_over_ranks(comm):
    strategy = ms.MultiWorkerMirroredStrategy()
    rank, size = comm.Get_rank(), comm.Get_size()
    with strategy.scope():
        var = ms.Variable(np.zeros(3), dtype="float64", name="w")
        opt = SGD(0.5, momentum=0.9)
    strategy.run(lambda: opt.apply_gradients([(np.full(3, rank + 1.0), var)]))
    total = size * (size + 1) / 2
    np.testing.assert_allclose(var.numpy(), -0.5 * total)
    values = comm.allgather(var.numpy())
    assert all(np.array_equal(v, values[0]) for v in values)


def test_foreign_and_big_endian_gradients_are_converted_once():
    """Gradients enter through the one boundary conversion (tf.convert_to_tensor in Keras's apply_gradients)."""

    strategy = ms.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        a = ms.Variable(np.ones(3, np.float32), name="a")
        b = ms.Variable(np.ones(3, np.float32), name="b")
        opt = ms.optimizers.SGD(learning_rate=0.5)
    opt.apply_gradients([(DLPackOnly(np.full(3, 2.0, np.float32)), a), (np.full(3, 4.0, ">f4"), b)])
    np.testing.assert_array_equal(a.numpy(), np.zeros(3, np.float32))
    np.testing.assert_array_equal(b.numpy(), np.full(3, -1.0, np.float32))
    with pytest.raises(TypeError, match="gradient of a"):
        opt.apply_gradients([(np.array(["x", "y", "z"]), a)])


def test_update_each_updates_every_copy_under_its_replica_as_update_does():
    """``extended._update_each`` (an optimizer's step): each copy gets its own component of a distributed
    value, a plain value as it is, under the frame of its copy; every copy of a variable, then the next."""
    from mpistrat.distribute import context

    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        a = ms.Variable(np.zeros(2), name="a")
        b = ms.Variable(np.zeros(2), name="b")
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, 10.0 + ctx.replica_id_in_sync_group))
    seen = []

    def fn(copy, value, j):
        seen.append((j, copy.device, context.local_replica_id_of(strategy), float(value[0])))
        copy.assign_add(value)

    with strategy.scope():
        strategy.extended._update_each([a, b], fn, [per_replica, np.ones(2)])
    devices = [c.device for c in a.values]
    assert seen == [(0, devices[0], 0, 10.0), (0, devices[1], 1, 11.0),
                    (1, devices[0], 0, 1.0), (1, devices[1], 1, 1.0)]
    assert [c.numpy().tolist() for c in a.values] == [[10.0, 10.0], [11.0, 11.0]]
    assert [c.numpy().tolist() for c in b.values] == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(RuntimeError, match="cross-replica context"):
        strategy.run(lambda: strategy.extended._update_each([a], fn, [np.ones(2)]))


def test_update_each_sends_other_variables_through_update():
    """A plain variable (the default strategy, central storage) is updated by ``extended.update``, which a
    strategy may override."""
    plain = ms.Variable(np.zeros(2))
    ms.get_strategy().extended._update_each([plain], lambda copy, value, j: copy.assign_add(value + j), [np.ones(2)])
    assert plain.numpy().tolist() == [1.0, 1.0]
    strategy = ms.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        central = ms.Variable(np.zeros(2))
        opt = SGD(1.0)
    strategy.run(lambda: opt.apply_gradients([(np.ones(2), central)]))  # summed over the two replicas
    assert central.numpy().tolist() == [-2.0, -2.0]


def test_an_optimizer_step_leaves_a_held_value_alone_and_constrains_only_its_variable():
    """The in-place update applies only where nobody holds the variable's array: a value read before the
    step is a snapshot. A constraint projects its own variable only."""
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        free = ms.Variable(np.ones(3, np.float32), name="free")
        held = ms.Variable(np.ones(3, np.float32), name="held")
        clipped = ms.Variable(np.ones(3, np.float32), name="clipped", constraint=lambda x: np.clip(x, 0.5, 2.0))
        opt = SGD(1.0)
    snapshot = held.value()
    grads = [np.full(3, 0.25, np.float32), np.full(3, 0.5, np.float32), np.full(3, 2.0, np.float32)]

    def step():
        opt.apply_gradients(zip(grads, [free, held, clipped]), experimental_aggregate_gradients=False)

    strategy.run(step)
    assert snapshot.tolist() == [1.0] * 3
    assert free.numpy().tolist() == [0.75] * 3 and held.numpy().tolist() == [0.5] * 3
    assert clipped.numpy().tolist() == [0.5] * 3  # 1 - 2 = -1, clipped into [0.5, 2]
    assert int(opt.iterations.numpy()) == 1


def test_a_failing_update_leaves_every_variables_copies_equal():
    """As ``extended.update`` variable by variable: the variables before the failing one are updated on every
    copy, the rest on none (a mirrored variable's copies never differ)."""
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        a = ms.Variable(np.ones(2, np.float32), name="a")
        b = ms.Variable(np.ones(2, np.float32), name="b")
        c = ms.Variable(np.ones(2, np.float32), name="c")
        opt = SGD(1.0)
    with strategy.scope(), pytest.raises(TypeError, match="variable 'b'"):
        opt.apply_gradients([(np.ones(2, np.float32), a), (np.ones(2, np.complex64) * 1j, b),
                             (np.ones(2, np.float32), c)])
    assert [c_.numpy().tolist() for c_ in a.values] == [[0.0, 0.0]] * 2
    assert [c_.numpy().tolist() for c_ in b.values] == [[1.0, 1.0]] * 2
    assert [c_.numpy().tolist() for c_ in c.values] == [[1.0, 1.0]] * 2


@pytest.mark.parametrize("optimizer", [SGD(0.5), Adam(0.5)], ids=["sgd", "adam"])
def test_a_variable_of_another_strategy_is_refused_before_any_copy_changes(optimizer):
    """Mirrored variables updated with no strategy in scope (the default strategy, one replica): a clear error
    naming both strategies, and every copy, slot and the step count as they were (it used to raise IndexError
    after updating the first copy)."""
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        first = ms.Variable(np.ones(3, np.float32), name="first")
        mirrored = ms.Variable(np.ones(3, np.float32), name="mirrored")
        opt = type(optimizer)(0.5)
        opt.apply_gradients([(np.ones(3, np.float32), first), (np.ones(3, np.float32), mirrored)])  # slots made
    before = {name: [c.numpy().copy() for c in v.values] for name, v in (("first", first), ("mirrored", mirrored))}
    slots = [c.numpy().copy() for s in opt.variables[1:] for c in s.values]
    with pytest.raises(ValueError, match=r"MirroredVariable 'first' has 2 copies \(made under <MirroredStrategy.*"
                                         r"updated under <_DefaultDistributionStrategy>.*nothing was updated"):
        opt.apply_gradients([(np.ones(3, np.float32), first), (np.ones(3, np.float32), mirrored)])
    for name, v in (("first", first), ("mirrored", mirrored)):
        assert all(np.array_equal(c.numpy(), b) for c, b in zip(v.values, before[name])), name
    assert all(np.array_equal(c.numpy(), b) for c, b in zip((c for s in opt.variables[1:] for c in s.values), slots))
    assert int(opt.iterations.numpy()) == 1
    with pytest.raises(ValueError, match="has 2 copies"):
        ms.get_strategy().extended.update(mirrored, lambda copy: copy.assign_add(np.ones(3, np.float32)))
    assert all(np.array_equal(c.numpy(), b) for c, b in zip(mirrored.values, before["mirrored"]))


def test_constraints_project_after_every_update_as_keras():
    """A variable given twice is updated twice, then projected once (Keras 3 applies the constraints after
    applying every gradient): 1 - 2 + 1 = 0, clipped into [0.5, 2]."""
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        v = ms.Variable(np.ones(3, np.float32), name="v", constraint=lambda x: np.clip(x, 0.5, 2.0))
        opt = SGD(1.0)
    with strategy.scope():
        opt.apply_gradients([(np.full(3, 2.0, np.float32), v), (np.full(3, -1.0, np.float32), v)])
    assert [c.numpy().tolist() for c in v.values] == [[0.5] * 3] * 2
