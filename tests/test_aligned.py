"""Host arrays on a cache line (``mpistrat.aligned``), and the variables that store theirs there, as TF does."""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import aligned

SHAPES = [(784, 1024), (1024,), (10,), (3, 5, 7), (), (0, 4)]


def off_line(array: np.ndarray, offset: int = 16) -> np.ndarray:
    """A copy of ``array`` starting ``offset`` bytes past a 64-byte boundary (NumPy guarantees only 16)."""
    raw = np.empty(array.nbytes + 128, np.uint8)
    start = -raw.__array_interface__["data"][0] % 64 + offset
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    assert not aligned.is_aligned(out) or array.nbytes == 0
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "int64", "bool", "complex128"])
@pytest.mark.parametrize("shape", SHAPES)
def test_empty_and_copy_start_on_a_cache_line_with_the_shape_and_dtype_asked(shape, dtype):
    a = aligned.empty(shape, dtype)
    assert aligned.is_aligned(a) and a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
    a[...] = np.arange(a.size).reshape(shape).astype(dtype)
    source = off_line(a)
    b = aligned.copy(source)
    assert aligned.is_aligned(b) and b.tobytes() == source.tobytes() and b.dtype == source.dtype
    assert not np.shares_memory(b, source)
    if b.size:
        b.reshape(-1)[0] = not b.reshape(-1)[0] if dtype == "bool" else b.reshape(-1)[0] + 1
        assert b.tobytes() != source.tobytes()


def test_dtypes_a_byte_buffer_cannot_hold_get_numpys_own_array():
    for dtype in ("U3", object, [("a", "i4"), ("b", "f8")]):
        a = aligned.empty((2,), dtype)
        assert a.shape == (2,) and a.dtype == np.dtype(dtype)


@pytest.mark.parametrize("n", [1, 2])
def test_variables_store_their_values_on_a_cache_line_whatever_they_were_given(n):
    values = [off_line(np.arange(np.prod(s, dtype=int), dtype=np.float32).reshape(s) / 3) for s in SHAPES[:4]]
    strategy = ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    with strategy.scope():
        variables = [ms.Variable(v) for v in values]
    plain = [ms.Variable(v) for v in values]
    for v, expected in zip(variables, values):
        for copy in v.values:
            stored = copy.value()
            assert aligned.is_aligned(stored) and not stored.flags.writeable
            assert stored.tobytes() == expected.tobytes() and not np.shares_memory(stored, expected)
    for v, expected in zip(plain, values):
        assert aligned.is_aligned(v.value()) and v.value().tobytes() == expected.tobytes()


def test_assign_stores_one_aligned_copy_with_numpys_conversion():
    v = ms.Variable(np.zeros((64, 33), np.float32))
    for value in (off_line(np.linspace(-3, 3, 64 * 33).reshape(64, 33)), off_line(np.arange(64 * 33).reshape(64, 33))):
        v.assign(value)
        stored = v.value()
        assert aligned.is_aligned(stored) and not stored.flags.writeable
        assert stored.dtype == np.float32 and stored.tobytes() == np.array(value, dtype=np.float32).tobytes()
        assert not np.shares_memory(stored, value)
    with pytest.raises(ValueError, match="shape"):
        v.assign(np.zeros((64, 32)))


def test_an_update_beside_a_held_snapshot_stores_its_new_array_on_a_cache_line_too():
    v = ms.Variable(np.ones((300, 7), np.float64))
    snapshot = v.value()  # held: the update cannot write into the array, it makes a new one
    delta = off_line(np.full((300, 7), 0.5))
    v.assign_add(delta)
    v.assign_sub(off_line(np.full((300, 7), 0.25)))
    assert np.all(snapshot == 1.0)
    assert aligned.is_aligned(v.value()) and np.all(v.value() == 1.25) and not v.value().flags.writeable


def test_an_optimizers_slots_and_updated_variables_stay_on_a_cache_line():
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        w = ms.Variable(off_line(np.ones((128, 9), np.float32)))
        opt = ms.optimizers.Adam(0.1)
    grad = off_line(np.full((128, 9), 0.5, np.float32))
    for _ in range(3):
        strategy.run(lambda: opt.apply_gradients([(grad, w)]))
    slots = [v for v in opt.variables if v.shape == w.shape]  # Adam's m and v
    assert len(slots) == 2 and all(aligned.is_aligned(c.value()) for s in slots for c in s.values)
    assert all(aligned.is_aligned(c.value()) for c in w.values)
    assert np.array_equal(w.values[0].value(), w.values[1].value()) and np.all(w.values[0].value() < 1.0)


def test_updates_of_an_aligned_variable_nobody_else_holds_reuse_its_memory():
    # An aligned array is a view of its buffer: the in-place check counts the buffer's holders, and with none but
    # the array, updates write where it is (no copy per step).
    v = ms.Variable(np.zeros(4099, np.float32))
    v.assign(off_line(np.arange(4099, dtype=np.float32)))  # assign's one copy: always a view of its own buffer
    assert v.value().base is not None and aligned.is_aligned(v.value())
    address = v.value().__array_interface__["data"][0]
    for _ in range(3):
        v.assign_add(np.ones(4099, np.float32))
    v.assign_sub(np.full(4099, 0.5, np.float32))
    assert v.value().__array_interface__["data"][0] == address
    np.testing.assert_array_equal(v.numpy(), np.arange(4099, dtype=np.float32) + 2.5)
