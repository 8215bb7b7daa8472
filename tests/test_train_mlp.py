"""The example MLP: hand-written gradients against finite differences, empty batches, replicas."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.examples.mlp import MLP, softmax_cross_entropy_sum


def _loss(model: MLP, x: np.ndarray, y: np.ndarray) -> float:
    return float(model.loss_and_gradients(x, y)[0])


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    model = MLP([5, 7, 6, 4], seed=1, dtype="float64")
    x = rng.standard_normal((9, 5))
    y = rng.integers(0, 4, 9)
    _, _, grads = model.loss_and_gradients(x, y)
    eps = 1e-6
    for var, grad in zip(model.variables, grads):
        assert grad.shape == var.shape
        base = var.numpy().copy()
        for index in [tuple(rng.integers(0, s) for s in var.shape) for _ in range(4)]:
            bumped = base.copy()
            bumped[index] += eps
            var.assign(bumped)
            up = _loss(model, x, y)
            bumped[index] -= 2 * eps
            var.assign(bumped)
            down = _loss(model, x, y)
            var.assign(base)
            numeric = (up - down) / (2 * eps)
            assert grad[index] == pytest.approx(numeric, rel=1e-5, abs=1e-7), (var.name, index)


def test_loss_is_the_summed_cross_entropy_and_counts_correct():
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]])
    labels = np.array([0, 2])
    loss, dlogits = softmax_cross_entropy_sum(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert loss == pytest.approx(-np.log(p[0, 0]) - np.log(p[1, 2]))
    expected = p.copy()
    expected[[0, 1], labels] -= 1
    np.testing.assert_allclose(dlogits, expected)
    model = MLP([2, 3], seed=0, dtype="float64")
    model.variables[0].assign(np.eye(2, 3) * 10)
    _, correct, _ = model.loss_and_gradients(np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), np.array([0, 1, 1]))
    assert int(correct) == 2


def test_empty_batch_gives_zero_loss_and_gradients():
    model = MLP([4, 8, 3], seed=0)
    loss, correct, grads = model.loss_and_gradients(np.zeros((0, 4), np.float32), np.zeros(0, np.int32))
    assert float(loss) == 0.0 and int(correct) == 0
    assert all(g.shape == v.shape and not g.any() for g, v in zip(grads, model.variables))


def test_replicas_compute_with_their_own_copies():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = MLP([3, 4, 2], seed=5)
    assert isinstance(model.variables[0], ms.MirroredVariable)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    per_replica = strategy.run(lambda: model.predict(x))
    a, b = strategy.experimental_local_results(per_replica)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, MLP([3, 4, 2], seed=5).predict(x))


def test_bad_layer_sizes_and_dtype():
    with pytest.raises(ValueError, match="layer_sizes"):
        MLP([4])
    with pytest.raises(ValueError, match="layer_sizes"):
        MLP([4, 0, 2])
    with pytest.raises(ValueError, match="floating point"):
        MLP([4, 2], dtype="int32")
