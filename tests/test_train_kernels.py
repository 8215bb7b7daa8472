"""The optimizers' in-place update rules: NumPy's bits, block by block, and only where the variable allows it."""

from __future__ import annotations

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.optimizers import SGD
from mpistrat.train import kernels

STEP32 = kernels.BLOCK_BYTES // 4  # float32 items per block


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(0,), (1,), (STEP32 - 1,), (STEP32,), (STEP32 + 1,), (3 * STEP32 + 5,),
                                   (257, 1029)])
def test_sgd_kernel_has_numpys_bits(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    param = rng.standard_normal(shape).astype(dtype)
    grad = rng.standard_normal(shape).astype(dtype) * 1e3
    lr = 0.012345
    expected = param.copy()
    expected -= lr * grad
    kernels.sgd(param, grad, lr)
    assert param.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(param.view(np.uint8), expected.view(np.uint8))


def _address(var) -> int:
    return var.value().__array_interface__["data"][0]  # the reference is dropped with the dict


@pytest.fixture
def kernel_calls(monkeypatch):
    """The real ``kernels.sgd``, counted."""
    calls = []
    real = kernels.sgd

    def counted(param, grad, lr):
        calls.append(param.shape)
        real(param, grad, lr)

    monkeypatch.setattr(kernels, "sgd", counted)
    return calls


def test_sgd_updates_a_float_variable_in_place_with_assign_subs_bits(kernel_calls):
    shape = (STEP32 + 7,)
    rng = np.random.default_rng(1)
    grad = rng.standard_normal(shape).astype(np.float32)
    var = ms.Variable(rng.standard_normal(shape).astype(np.float32))
    twin = ms.Variable(var.numpy())
    before = _address(var)
    SGD(0.5).apply_gradients([(grad, var)])
    twin.assign_sub(0.5 * grad)
    assert _address(var) == before  # no new array: the kernel wrote into the variable's own
    assert kernel_calls == [shape]
    np.testing.assert_array_equal(var.numpy(), twin.numpy())
    assert not var.value().flags.writeable  # read-only again, as every value a variable hands out


def test_sgd_leaves_a_held_value_and_a_strided_gradient_to_assign(kernel_calls):
    rng = np.random.default_rng(2)
    var = ms.Variable(rng.standard_normal((64, 32)).astype(np.float32))
    held = var.value()
    snapshot = held.copy()
    grad = rng.standard_normal((32, 64)).astype(np.float32).T  # not C-contiguous
    expected = snapshot - np.float32(0.25) * grad
    SGD(0.25).apply_gradients([(grad, var)])
    np.testing.assert_array_equal(held, snapshot)  # the snapshot the caller holds did not change
    np.testing.assert_array_equal(var.numpy(), expected)
    del held
    expected -= np.float32(0.25) * grad
    SGD(0.25).apply_gradients([(grad, var)])  # strided: assigned, the same bits
    np.testing.assert_array_equal(var.numpy(), expected)
    assert kernel_calls == []
    SGD(0.25).apply_gradients([(np.ascontiguousarray(grad), var)])
    assert kernel_calls == [(64, 32)]


def test_sgd_keeps_assigns_casts_and_errors(kernel_calls):
    wide = ms.Variable(np.ones(5, np.float32))
    grad64 = np.full(5, 1 / 3)  # float64 into float32: assign's cast, not the kernel
    SGD(0.1).apply_gradients([(grad64, wide)])
    np.testing.assert_array_equal(wide.numpy(), (np.ones(5, np.float32) - 0.1 * grad64).astype(np.float32))
    counts = ms.Variable(np.ones(3, np.int64))
    with pytest.raises(TypeError, match="int64"):  # a float step into an integer variable still raises
        SGD(0.1).apply_gradients([(np.ones(3, np.int64), counts)])
    np.testing.assert_array_equal(counts.numpy(), np.ones(3, np.int64))
    assert kernel_calls == []


def test_apply_in_place_refuses_what_it_cannot_do_bitwise():
    var = ms.Variable(np.zeros(4, np.float32))
    calls = []

    def kernel(target, *operands):
        calls.append(len(operands))
        target += 1

    assert not var._apply_in_place(kernel, (np.ones(4, np.float64),))  # another dtype
    assert not var._apply_in_place(kernel, (np.ones(5, np.float32),))  # another shape
    assert not var._apply_in_place(kernel, ([1.0, 1.0, 1.0, 1.0],))  # not an array
    held = var.value()
    assert not var._apply_in_place(kernel, (np.ones(4, np.float32),))  # someone holds the value
    del held
    assert calls == []
    assert var._apply_in_place(kernel, (np.ones(4, np.float32),), 7)
    assert calls == [2]
    np.testing.assert_array_equal(var.numpy(), np.ones(4, np.float32))


def test_mirrored_copies_take_the_kernel_and_stay_equal(kernel_calls):
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        var = ms.Variable(np.arange(2 * STEP32 + 3, dtype=np.float32))
        opt = SGD(0.5)
    grad = np.linspace(-1, 1, 2 * STEP32 + 3).astype(np.float32)
    expected = np.arange(2 * STEP32 + 3, dtype=np.float32) - 0.5 * grad
    strategy.run(lambda: opt.apply_gradients([(grad, var)], experimental_aggregate_gradients=False))
    copies = strategy.experimental_local_results(var)
    for copy in copies:
        np.testing.assert_array_equal(copy.numpy(), expected)
    assert kernel_calls == [(2 * STEP32 + 3,)] * 2
