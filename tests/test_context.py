"""The distribution context: default strategy, scopes and their nesting rules."""

import threading

import numpy as np
import pytest

import mpistrat as ms


def test_default_context():
    assert not ms.has_strategy()
    assert not ms.in_cross_replica_context()
    default = ms.get_strategy()
    assert default.num_replicas_in_sync == 1
    ctx = ms.get_replica_context()
    assert ctx is not None and ctx.replica_id_in_sync_group == 0 and ctx.strategy is default
    assert ms.get_cross_replica_context() is None
    # The default replica context's collectives are identities, merge_call runs in cross-replica context.
    assert ctx.all_reduce("sum", 3.0) == 3.0
    assert ctx.merge_call(lambda s, x: (ms.in_cross_replica_context(), x + 1), args=(1,)) == (True, 2)


def test_scope_enters_cross_replica_context():
    s = ms.OneDeviceStrategy("/cpu:0")
    with s.scope() as entered:
        assert entered is s
        assert ms.has_strategy() and ms.get_strategy() is s
        assert ms.in_cross_replica_context()
        assert ms.get_replica_context() is None
        assert ms.get_cross_replica_context() is s
    assert not ms.has_strategy()


def test_reentering_same_scope_is_allowed():
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with s.scope():
        with s.scope():
            assert ms.get_strategy() is s
        assert ms.get_strategy() is s
    assert not ms.has_strategy()


def test_mixing_strategies_raises_tf_message():
    a, b = ms.OneDeviceStrategy("/cpu:0"), ms.OneDeviceStrategy("/cpu:1")
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            with b.scope():
                pass
        assert ms.get_strategy() is a


def test_default_strategy_scope_nested_raises():
    s = ms.OneDeviceStrategy("/cpu:0")
    default = ms.get_strategy()
    with default.scope():
        assert not ms.has_strategy()
    with s.scope():
        with pytest.raises(RuntimeError, match="Must not nest tf.distribute.Strategy scopes."):
            with default.scope():
                pass


def test_scope_inside_run_raises():
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])

    def fn():
        with s.scope():
            pass

    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(fn)


@pytest.mark.parametrize("num_devices", [1, 2])
def test_run_restores_the_context_after_the_step_raises(num_devices):
    # One replica runs in the calling thread on the caller's context stack: an error must not leave
    # the step's frame (or the strategy's scope) on it.
    s = ms.MirroredStrategy([f"/cpu:{i}" for i in range(num_devices)])

    def fn():
        assert ms.get_strategy() is s and not ms.in_cross_replica_context()
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        s.run(fn)
    assert not ms.has_strategy() and ms.get_replica_context().replica_id_in_sync_group == 0
    with s.scope():
        with pytest.raises(KeyError, match="boom"):
            s.run(fn)
        assert ms.get_strategy() is s and ms.in_cross_replica_context()
    assert not ms.has_strategy()
    ids = s.experimental_local_results(s.run(lambda: ms.get_replica_context().replica_id_in_sync_group))
    assert ids == tuple(range(num_devices))


def test_scope_inside_run_of_one_replica_raises():
    s = ms.MirroredStrategy(["/cpu:0"])

    def fn():
        with s.scope():
            pass

    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(fn)
    with pytest.raises(RuntimeError, match="Mixing different"):
        ms.MirroredStrategy(["/cpu:0"]).run(lambda: s.run(lambda: None))
    assert not ms.has_strategy()


def test_run_of_one_replica_follows_the_nesting_rules_everywhere():
    # One CPU replica runs its step without entering the strategy's scope first (Strategy.run's short
    # path): it must accept and refuse exactly what entering the scope accepts and refuses.
    s, other = ms.MirroredStrategy(["/cpu:0"]), ms.MirroredStrategy(["/cpu:0"])
    in_step = lambda: (ms.get_strategy() is s, ms.in_cross_replica_context(), ms.get_replica_context().strategy is s)
    assert s.run(in_step) == (True, False, True)
    with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
        s.run(lambda: s.run(lambda: None))
    with other.scope():
        with pytest.raises(RuntimeError, match="Mixing different"):
            s.run(in_step)
        assert ms.get_strategy() is other and ms.in_cross_replica_context()
    try:
        ms.experimental_set_strategy(s)
        assert s.run(in_step) == (True, False, True)
        with pytest.raises(RuntimeError, match="Mixing different"):
            other.run(lambda: None)
    finally:
        ms.experimental_set_strategy(None)
    with s.scope():
        assert s.run(in_step) == (True, False, True)
        assert ms.get_strategy() is s and ms.in_cross_replica_context()
    assert not ms.has_strategy()


def test_context_of_a_lone_replica_kept_from_a_step_is_refused_outside_steps():
    s = ms.MirroredStrategy(["/cpu:0"])
    kept = s.run(ms.get_replica_context)
    with pytest.raises(RuntimeError, match="Mismatching tf.distribute.Strategy objects"):
        kept.all_reduce("sum", np.ones(2))
    with s.scope(), pytest.raises(RuntimeError, match="Need to be inside"):
        kept.merge_call(lambda strategy: None)
    # In a later step of the same replica it is that replica's context, and works.
    assert s.run(lambda: kept.all_reduce("sum", np.ones(2)) * 0 + kept.replica_id_in_sync_group).tolist() == [0, 0]


def test_contexts_inside_run():
    s = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    seen = s.run(lambda: (ms.has_strategy(), ms.in_cross_replica_context(), ms.get_strategy() is s,
                          ms.get_replica_context().replica_id_in_sync_group))
    assert [tuple(x if not isinstance(x, ms.PerReplica) else x.values[i] for x in seen) for i in range(2)] == [
        (True, False, True, 0), (True, False, True, 1)]


def test_experimental_set_strategy_is_global():
    s = ms.OneDeviceStrategy("/cpu:0")
    try:
        ms.experimental_set_strategy(s)
        assert ms.get_strategy() is s and ms.in_cross_replica_context()
        seen = []
        t = threading.Thread(target=lambda: seen.append(ms.get_strategy() is s))
        t.start(); t.join()
        assert seen == [True]
        with s.scope():  # entering its scope again is fine
            assert ms.get_strategy() is s
    finally:
        ms.experimental_set_strategy(None)
    assert not ms.has_strategy()


def test_experimental_set_strategy_inside_scope_raises():
    s = ms.OneDeviceStrategy("/cpu:0")
    with s.scope():
        with pytest.raises(RuntimeError, match="Must not be called inside"):
            ms.experimental_set_strategy(s)


def test_scopes_are_per_thread():
    s = ms.OneDeviceStrategy("/cpu:0")
    seen = []
    with s.scope():
        t = threading.Thread(target=lambda: seen.append(ms.has_strategy()))
        t.start(); t.join()
    assert seen == [False]


def test_default_strategy_reduce_and_run():
    default = ms.get_strategy()
    assert default.run(lambda x: x + 1, args=(1,)) == 2
    assert np.array_equal(default.reduce("sum", np.arange(3), axis=None), np.arange(3))
    assert default.experimental_local_results(5) == (5,)
