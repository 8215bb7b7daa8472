"""The optimizers' in-place update rules: the assigned rule's bits, block by block, only where nothing can tell."""

from __future__ import annotations

import threading
import time
import tracemalloc
import warnings

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.distribute import in_place
from mpistrat.optimizers import SGD, Adam
from mpistrat.train import kernels

STEP32 = kernels.BLOCK_BYTES // 4  # float32 items per block
SHAPES = [(1,), (STEP32 - 1,), (STEP32,), (STEP32 + 1,), (3 * STEP32 + 5,), (257, 1029)]
FLOATS = ["float16", "float32", "float64", "longdouble"]
RULES = {  # name: (optimizer, its slots)
    "sgd": (lambda: SGD(0.0123), ()),
    "momentum": (lambda: SGD(0.0123, momentum=0.9), ("momentum",)),
    "nesterov": (lambda: SGD(0.0123, momentum=0.9, nesterov=True), ("momentum",)),
    "adam": (lambda: Adam(0.0123), ("m", "v")),
}


def _same(a, b) -> bool:
    """Bit for bit, but for long double's padding: equal values (NaN to NaN) with equal signs."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
            and np.array_equal(np.signbit(a), np.signbit(b)))


@pytest.fixture(autouse=True)
def _runtime_warnings_warn():
    """NumPy's RuntimeWarnings only warn here, whatever the runner's filters (an "error" filter turns the
    in-place path off, which one test checks on purpose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default", RuntimeWarning)
        yield


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every kernel, the real one, counted: ``[(name, shape), ...]``."""
    calls = []
    for name in ("sgd", "momentum", "nesterov", "adam"):
        real = getattr(kernels, name)

        def counted(param, *rest, _real=real, _name=name):
            calls.append((_name, param.shape))
            _real(param, *rest)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.fixture(params=["compiled", "numpy"])
def rules(request, monkeypatch):
    """Each test below twice: with the compiled rules (``_update.c``, float32 and float64) and with the
    NumPy rules block by block (the only ones for other dtypes, and where the extension did not build)."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "_update", None)
    else:
        assert kernels._update is not None, "mpistrat.train._update was not built: pip install -e . with a C compiler"
    return request.param


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(0,), *SHAPES])
def test_kernels_have_the_bits_of_numpy_expressions(dtype, shape, rules):
    rng = np.random.default_rng(sum(shape))
    p, v, m, g = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    v2 = np.abs(v)  # Adam's second moment
    lr, mu, b1, b2, eps = 0.0123, 0.9, 0.9, 0.999, 1e-7

    param = p.copy()
    kernels.sgd(param, g, lr)
    assert _same(param, p - lr * g)

    for kernel, nesterov in ((kernels.momentum, False), (kernels.nesterov, True)):
        param, velocity = p.copy(), v.copy()
        kernel(param, velocity, g, lr, mu)
        new_v = mu * v - lr * g
        assert _same(velocity, new_v)
        assert _same(param, p + (mu * new_v - lr * g if nesterov else new_v))

    param, m1, m2 = p.copy(), m.copy(), v2.copy()
    kernels.adam(param, m1, m2, g, lr, b1, b2, eps)
    new_m = b1 * m + (1 - b1) * g
    new_v = b2 * v2 + (1 - b2) * (g * g)
    assert _same(m1, new_m)
    assert _same(m2, new_v)
    assert _same(param, p - lr * new_m / (np.sqrt(new_v) + eps))


def _special(dtype: str, n: int, seed: int) -> np.ndarray:
    """Normal values with every kind of special one among them, a third of the elements, drawn for each
    array apart, so that specials meet specials: infinities, NaNs of both signs, signed zeros,
    subnormals, the largest and the smallest normal numbers."""
    info = np.finfo(dtype)
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n).astype(dtype)
    special = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, info.max, -info.max, info.tiny,
                        info.smallest_subnormal, -info.smallest_subnormal, 3 * info.smallest_subnormal], dtype)
    where = rng.random(n) < 1 / 3
    values[where] = rng.choice(special, int(where.sum()))
    return values


def _same_but_nan_signs(a, b) -> bool:
    """Bit for bit, except that two NaNs are equal whatever their signs and payloads (where two NaN operands
    meet, the compiled rules' NaN may be the other operand's: _update.c)."""
    a, b = np.asarray(a), np.asarray(b)
    both_nan = np.isnan(a) & np.isnan(b)
    uint = np.dtype(f"u{a.dtype.itemsize}")
    return a.dtype == b.dtype and np.array_equal(a.view(uint)[~both_nan], b.view(uint)[~both_nan])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compiled_rules_have_the_numpy_rules_bits_on_special_values(dtype, monkeypatch):
    n = 3 * STEP32 + 11
    compiled = kernels._update
    assert compiled is not None, "mpistrat.train._update was not built: pip install -e . with a C compiler"
    inputs = [_special(dtype, n, seed) for seed in range(1, 5)]  # param, slot, slot, grad
    inputs[2] = np.abs(inputs[2])  # Adam's second moment (its NaNs stay)
    calls = {"sgd": lambda p, a, b, g: kernels.sgd(p, g, 1.5e-3),
             "momentum": lambda p, a, b, g: kernels.momentum(p, a, g, 0.25, 0.9),
             "nesterov": lambda p, a, b, g: kernels.nesterov(p, a, g, 3.0, 0.99),
             "adam": lambda p, a, b, g: kernels.adam(p, a, b, g, 1e-3, 0.9, 0.999, 1e-7)}
    for name, call in calls.items():
        results = []
        for module in (compiled, None):
            monkeypatch.setattr(kernels, "_update", module)
            arrays = [x.copy() for x in inputs]
            with np.errstate(all="ignore"):
                call(*arrays)
            results.append(arrays)
        for got, want in zip(*results):
            assert _same_but_nan_signs(got, want), name
            assert np.array_equal(np.isnan(got), np.isnan(want)), name


def test_compiled_rules_report_floating_point_errors_as_numpy_does(capsys):
    assert kernels._update is not None, "mpistrat.train._update was not built: pip install -e . with a C compiler"
    n = 2 * STEP32
    grad = np.ones(n, np.float32)
    grad[-1] = 3e38  # overflows in the product
    with np.errstate(over="warn"), pytest.warns(RuntimeWarning, match="overflow encountered in sgd"):
        param = np.zeros(n, np.float32)
        kernels.sgd(param, grad, 1e3)
    assert param[-1] == -np.inf and param[0] == np.float32(-1e3)
    with np.errstate(over="print"), warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.sgd(np.zeros(n, np.float32), grad, 1e3)
    assert capsys.readouterr().err == "Warning: overflow encountered in sgd\n"  # where NumPy prints it
    with np.errstate(over="ignore"), warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.sgd(np.zeros(n, np.float32), grad, 1e3)
    # Adam's second moment made negative: sqrt's invalid value, a NaN step
    param, m, v = np.zeros(n, np.float32), np.zeros(n, np.float32), np.full(n, -1.0, np.float32)
    with np.errstate(invalid="warn"), pytest.warns(RuntimeWarning, match="invalid value encountered in adam"):
        kernels.adam(param, m, v, np.ones(n, np.float32), 1e-3, 0.9, 0.999, 1e-7)
    assert np.isnan(param).all()
    # raise (or call, log): the NumPy rules run, and NumPy raises where it meets the error, as before
    param = np.zeros(n, np.float32)
    with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow encountered in multiply"):
        kernels.sgd(param, grad, 1e3)
    assert param[0] == np.float32(-1e3) and param[-1] == 0  # the NumPy rules stopped in the last block


def test_compiled_rules_leave_what_they_do_not_take_untouched():
    compiled = kernels._update
    assert compiled is not None, "mpistrat.train._update was not built: pip install -e . with a C compiler"
    grad = np.ones(10, np.float32)
    read_only = np.zeros(10, np.float32)
    read_only.flags.writeable = False
    cases = [np.zeros(10, np.float16), np.zeros(10, ">f4"), np.zeros(20, np.float32)[::2], np.zeros(11, np.float32),
             np.zeros(10, np.float64), np.zeros(10, np.int32), read_only]
    for param in cases:
        before = param.copy()
        assert compiled.sgd(param, grad, 0.5) is NotImplemented, param
        assert compiled.momentum(param, param.copy(), grad, 0.5, 0.9, False) is NotImplemented
        assert compiled.adam(param, param.copy(), param.copy(), grad, 0.5, 0.9, 0.1, 0.999, 0.001, 1e-7) is NotImplemented
        assert _same(param, before)
    param, velocity = np.zeros(10, np.float32), np.zeros(10, np.float32)
    assert compiled.momentum(param, velocity[::1], grad[:9], 0.5, 0.9, True) is NotImplemented  # lengths differ
    unaligned = np.zeros(44, np.uint8)[1:41].view(np.float32)
    assert not unaligned.flags.aligned and compiled.sgd(unaligned, grad, 0.5) is NotImplemented
    shared = np.arange(15, dtype=np.float32)
    assert compiled.sgd(shared[:10], shared[5:], 0.5) is NotImplemented  # overlapping arrays
    assert compiled.adam(param, velocity, velocity, grad, 0.5, 0.9, 0.1, 0.999, 0.001, 1e-7) is NotImplemented
    np.testing.assert_array_equal(shared, np.arange(15))
    # only the arithmetic's exceptions count, not the coefficients' rounding (NumPy reports none of these)
    assert compiled.sgd(np.ones(10, np.float32), grad, 1e-40) == 0  # lr underflows to a subnormal float32
    assert compiled.sgd(np.zeros(0, np.float32), np.zeros(0, np.float32), 1e39) == 0  # lr overflows
    assert compiled.sgd(np.zeros(10, np.float32), grad, 0.5) == 0  # no error raised
    with pytest.raises(TypeError):
        compiled.sgd(np.zeros(10, np.float32), grad, "0.5")


def test_numpy_scalar_coefficients_keep_the_numpy_rules(monkeypatch):
    """A NumPy float64 coefficient makes NumPy's float32 arithmetic float64, rounded once more: the
    compiled rules, which round every coefficient to the arrays' dtype, are not taken."""
    rng = np.random.default_rng(3)
    p, g = (rng.standard_normal(2 * STEP32).astype(np.float32) for _ in range(2))
    compiled = p.copy()
    kernels.sgd(compiled, g, np.float64(0.0123))
    monkeypatch.setattr(kernels, "_update", None)
    blocks = p.copy()
    kernels.sgd(blocks, g, np.float64(0.0123))
    assert _same(compiled, blocks)
    assert not _same(blocks, p - np.float32(0.0123) * g)  # the coefficient's dtype shows in the bits


def test_kernels_refuse_arrays_they_would_copy():
    fortran = np.asfortranarray(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels.sgd(fortran, np.ones((4, 3), np.float32), 0.5)
    np.testing.assert_array_equal(fortran, 1)


def test_kernels_work_block_by_block():
    param = np.zeros(8 * STEP32, np.float32)
    grad = np.ones_like(param)
    velocity, m, v = np.zeros_like(param), np.zeros_like(param), np.zeros_like(param)
    tracemalloc.start()
    try:
        for call in (lambda: kernels.sgd(param, grad, 0.5), lambda: kernels.momentum(param, velocity, grad, 0.5, 0.9),
                     lambda: kernels.adam(param, m, v, grad, 0.5, 0.9, 0.999, 1e-7)):
            tracemalloc.reset_peak()
            call()
            assert tracemalloc.get_traced_memory()[1] <= 2 * kernels.BLOCK_BYTES + 4096  # scratch, not an array
    finally:
        tracemalloc.stop()


def _train(rule: str, dtype: str, shape: tuple, hold: bool, steps: int = 3):
    """Weights and slots after ``steps`` updates; ``hold``: a snapshot of every array is held meanwhile
    (so no update may write in place: the assigning path, the reference)."""
    make, slot_names = RULES[rule]
    rng = np.random.default_rng(7)
    var = ms.Variable(rng.standard_normal(shape).astype(dtype))
    opt = make()
    opt.build([var])
    slots = [opt.get_slot(var, s) for s in slot_names]
    for step in range(steps):
        grad = rng.standard_normal(shape).astype(dtype)
        held = [x.value() for x in (var, *slots)] if hold else []
        before = [h.copy() for h in held]
        opt.apply_gradients([(grad, var)])
        for h, b in zip(held, before):
            assert _same(h, b)  # a held snapshot never changes
        del held
    return [x.numpy() for x in (var, *slots)]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_in_place_updates_have_the_assigned_updates_bits(rule, dtype, kernel_calls):
    shape = (2 * STEP32 + 3,)
    reference = _train(rule, dtype, shape, hold=True)
    assert kernel_calls == []  # held: every update assigned
    fast = _train(rule, dtype, shape, hold=False)
    assert kernel_calls == [(rule, shape)] * 3
    for a, b in zip(fast, reference):
        assert _same(a, b)


def test_an_in_place_update_keeps_the_variables_array_and_read_only(kernel_calls):
    var = ms.Variable(np.ones(STEP32 + 7, np.float32))
    address = var.value().__array_interface__["data"][0]  # no reference kept
    SGD(0.5).apply_gradients([(np.ones(STEP32 + 7, np.float32), var)])
    assert kernel_calls == [("sgd", (STEP32 + 7,))]
    assert var.value().__array_interface__["data"][0] == address
    assert not var.value().flags.writeable
    np.testing.assert_array_equal(var.numpy(), 0.5)


@pytest.mark.parametrize("case", ["held value", "strided gradient", "numpy lr", "0-d", "wider gradient"])
def test_updates_assign_where_in_place_could_differ(case, kernel_calls):
    shape = (2 * STEP32 + 3,)
    grad = np.linspace(-1, 1, shape[0]).astype(np.float32)
    start = np.arange(shape[0], dtype=np.float32)
    opt = SGD(0.1)
    held = None
    if case == "held value":
        var = ms.Variable(start)
        held = var.value()
    elif case == "strided gradient":
        var = ms.Variable(start)
        grad = np.repeat(grad, 2)[::2]
    elif case == "numpy lr":
        var = ms.Variable(start)
        opt.learning_rate = np.float64(0.1)  # not weak: lr * grad is float64, then cast
    elif case == "0-d":
        start, grad = np.float32(3.0), np.array(1 / 3, np.float32)
        var = ms.Variable(start)
    else:
        var = ms.Variable(start)
        grad = grad.astype(np.float64)
    expected = (start - opt.learning_rate * grad).astype(np.float32)
    opt.apply_gradients([(grad, var)])
    assert kernel_calls == []
    assert _same(var.numpy(), expected)
    if held is not None:
        np.testing.assert_array_equal(held, start)


@pytest.mark.parametrize("rule", ["momentum", "nesterov", "adam"])
def test_a_held_slot_keeps_the_whole_update_assigning(rule, kernel_calls):
    shape = (STEP32 + 1,)
    make, slot_names = RULES[rule]
    var = ms.Variable(np.ones(shape, np.float32))
    opt = make()
    grad = np.full(shape, 0.5, np.float32)
    opt.apply_gradients([(grad, var)])
    held = opt.get_slot(var, slot_names[-1]).value()
    snapshot = held.copy()
    kernel_calls.clear()
    opt.apply_gradients([(grad, var)])
    assert kernel_calls == []
    np.testing.assert_array_equal(held, snapshot)
    del held
    opt.apply_gradients([(grad, var)])
    assert kernel_calls == [(rule, shape)]


def test_variables_are_c_ordered_so_updates_stay_in_place(kernel_calls):
    shape = (STEP32, 3)
    var = ms.Variable(np.asfortranarray(np.zeros(shape, np.float32)))
    assert var.value().flags.c_contiguous
    var.assign(np.asfortranarray(np.ones(shape, np.float32)))
    assert var.value().flags.c_contiguous
    np.testing.assert_array_equal(var.numpy(), 1)
    SGD(0.5).apply_gradients([(np.ones(shape, np.float32), var)])
    assert kernel_calls == [("sgd", shape)]
    np.testing.assert_array_equal(var.numpy(), 0.5)


def test_short_gradients_keep_the_numpy_expressions(kernel_calls):
    for rule in sorted(RULES):
        var = ms.Variable(np.ones(STEP32, np.float32))  # one block: nothing to gain
        RULES[rule][0]().apply_gradients([(np.ones(STEP32, np.float32), var)])
    assert kernel_calls == []


def test_applies_names_what_the_kernels_need():
    c = np.ones((4, 3), np.float32)
    assert kernels.applies([c.copy()], c, (0.5,))
    assert not kernels.applies([np.asfortranarray(c)], c, (0.5,))  # an array the kernel would copy
    assert not kernels.applies([c.copy()], np.asfortranarray(c), (0.5,))
    assert not kernels.applies([c.astype(np.float64)], c, (0.5,))
    assert not kernels.applies([c.copy()], c, (np.float64(0.5),))
    assert not kernels.applies([c.copy()], c.astype(np.int32), (0.5,))
    assert not kernels.applies([np.ones((), np.float32)], np.ones((), np.float32), (0.5,))


def test_integer_variables_still_refuse_a_float_step(kernel_calls):
    counts = ms.Variable(np.ones(3, np.int64))
    with pytest.raises(TypeError, match="variable"):
        SGD(0.1).apply_gradients([(np.ones(3, np.int64), counts)])
    np.testing.assert_array_equal(counts.numpy(), np.ones(3, np.int64))
    assert kernel_calls == []


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_floating_point_error_that_raises_leaves_every_array_as_it_was(rule, kernel_calls):
    shape = (3 * STEP32,)
    make, slot_names = RULES[rule]
    var = ms.Variable(np.zeros(shape, np.float32))
    opt = make()
    opt.apply_gradients([(np.ones(shape, np.float32), var)])
    kernel_calls.clear()
    before = [x.numpy() for x in (var, *[opt.get_slot(var, s) for s in slot_names])]
    grad = np.zeros(shape, np.float32)
    grad[-1] = 3e38  # overflows in the last block only
    opt.learning_rate = 1e3
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        opt.apply_gradients([(grad, var)])
    after = [x.numpy() for x in (var, *[opt.get_slot(var, s) for s in slot_names])]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
    assert kernel_calls == []


@pytest.mark.parametrize("rule, lr", [("nesterov", 2.5e34), ("adam", 3e38)])
def test_an_error_in_the_step_of_a_short_variable_leaves_its_slots(rule, lr, kernel_calls):
    make, slot_names = RULES[rule]
    var = ms.Variable(np.zeros(8, np.float32))
    opt = make()
    opt.apply_gradients([(np.ones(8, np.float32), var)])
    before = [x.numpy() for x in (var, *[opt.get_slot(var, s) for s in slot_names])]
    opt.learning_rate = lr  # the step overflows; the slots' new values do not
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        opt.apply_gradients([(np.full(8, 1e4, np.float32), var)])
    after = [x.numpy() for x in (var, *[opt.get_slot(var, s) for s in slot_names])]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
    assert kernel_calls == []  # one block: the NumPy expressions


def test_a_warnings_filter_that_raises_keeps_updates_assigning(kernel_calls):
    var = ms.Variable(np.ones(4, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert in_place.errors_may_raise()
        SGD(0.5).apply_gradients([(np.ones(4, np.float32), var)])
    assert kernel_calls == []
    np.testing.assert_array_equal(var.numpy(), 0.5)
    assert not in_place.errors_may_raise()  # NumPy's default modes only warn


def test_assign_sub_in_place_leaves_the_variable_alone_when_an_error_raises():
    var = ms.Variable(np.full(4, 3e38, np.float32))
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        var.assign_add(np.full(4, 3e38, np.float32))
    np.testing.assert_array_equal(var.numpy(), np.float32(3e38))


def _free_for_other_threads(var) -> bool:
    """Whether another thread can take ``var``'s update lock right now."""
    got = []

    def take() -> None:
        got.append(var._update_lock.acquire(blocking=False))
        if got[0]:
            var._update_lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return got[0]


def test_run_refuses_the_same_array_twice_and_unlocks():
    var = ms.Variable(np.ones(4, np.float32))
    seen = []

    def kernel(array, value):
        seen.append(array.flags.writeable)
        assert not _free_for_other_threads(var)  # locked against other threads meanwhile
        array += value

    assert not in_place.run((var, var), lambda arrays: True, kernel, 1)
    assert in_place.run((var,), lambda arrays: True, kernel, 1)
    assert seen == [True]
    np.testing.assert_array_equal(var.numpy(), 2)
    assert not var.value().flags.writeable
    assert not in_place.run((var,), lambda arrays: False, kernel, 1)  # the check refuses
    held = var.value()
    assert not in_place.run((var,), lambda arrays: True, kernel, 1)  # held
    del held
    assert _free_for_other_threads(var)  # every refusal left the lock free
    assert seen == [True]
    np.testing.assert_array_equal(var.numpy(), 2)


def test_run_restores_read_only_and_unlocks_when_the_kernel_raises():
    var = ms.Variable(np.ones(4, np.float32))

    def kernel(array):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        in_place.run((var,), lambda arrays: True, kernel)
    assert not var.value().flags.writeable
    assert not var._writing
    assert _free_for_other_threads(var)


@pytest.mark.timeout(30)  # a handler that waits on its own thread's lock would hang
@pytest.mark.parametrize("how", ["optimizer", "assign_sub"])
def test_a_warning_handler_may_read_the_variable_during_its_update(how, kernel_calls, monkeypatch):
    shape = (4 * STEP32,)
    var = ms.Variable(np.full(shape, 3e38, np.float32))
    grad = np.full(shape, -3e38, np.float32)  # 3e38 - (-3e38) overflows in every block
    seen = []

    def handler(message, category, filename, lineno, file=None, line=None):
        seen.append(var.value())  # re-entered from inside the update: a copy, which never changes
        seen.append(seen[-1].copy())

    monkeypatch.setattr(warnings, "showwarning", handler)
    with warnings.catch_warnings():
        warnings.simplefilter("always", RuntimeWarning)
        if how == "optimizer":
            SGD(1.0).apply_gradients([(grad, var)])
            assert kernel_calls == [("sgd", shape)]
        else:
            var.assign_sub(grad)
    assert len(seen) >= 2
    for snapshot, copy in zip(seen[::2], seen[1::2]):
        np.testing.assert_array_equal(snapshot, copy)
        assert not snapshot.flags.writeable
    assert np.all(np.isinf(var.numpy()))
    assert _free_for_other_threads(var)


def test_central_storage_updates_its_one_copy_in_place(kernel_calls):
    shape = (2 * STEP32 + 3,)
    strategy = ms.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        var = ms.Variable(np.arange(shape[0], dtype=np.float32))
        opt = Adam(0.0123)
    grad = np.linspace(-1, 1, shape[0]).astype(np.float32)
    strategy.run(lambda: opt.apply_gradients([(grad, var)]))
    assert kernel_calls == [("adam", shape)]
    reference = ms.Variable(np.arange(shape[0], dtype=np.float32))
    held = reference.value()  # the assigning path
    Adam(0.0123).apply_gradients([(2 * grad, reference)])  # the replicas' gradients summed
    del held
    assert _same(var.numpy(), reference.numpy())


def test_a_snapshot_read_during_updates_never_changes():
    var = ms.Variable(np.zeros(16 * STEP32, np.float32))
    grad = np.ones(16 * STEP32, np.float32)
    opt = SGD(1.0)
    changed, stop = [], threading.Event()

    def reader() -> None:
        while not stop.is_set():
            snapshot = var.value()
            first = float(snapshot[0]), float(snapshot[-1])
            time.sleep(0.0005)
            if (float(snapshot[0]), float(snapshot[-1])) != first or snapshot[0] != snapshot[-1]:
                changed.append(first)
            del snapshot

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(40):
            opt.apply_gradients([(grad, var)])
    finally:
        stop.set()
        thread.join()
    assert changed == []
    np.testing.assert_array_equal(var.numpy(), -40.0)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_mirrored_copies_take_the_kernel_and_stay_equal(rule, kernel_calls):
    shape = (2 * STEP32 + 3,)
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        var = ms.Variable(np.arange(shape[0], dtype=np.float32))
        opt = RULES[rule][0]()
    grad = np.linspace(-1, 1, shape[0]).astype(np.float32)
    for _ in range(2):
        strategy.run(lambda: opt.apply_gradients([(grad, var)], experimental_aggregate_gradients=False))
    assert kernel_calls == [(rule, shape)] * 4
    reference = ms.Variable(np.arange(shape[0], dtype=np.float32))
    ref_opt = RULES[rule][0]()
    for _ in range(2):
        held = reference.value()  # assigning path
        ref_opt.apply_gradients([(grad, reference)])
        del held
    for copy in strategy.experimental_local_results(var):
        assert _same(copy.numpy(), reference.numpy())
