"""Arrays from other libraries: one conversion where user values enter, the same under every strategy.

Where TensorFlow converts: ``tf.convert_to_tensor`` "accepts Tensor objects, numpy arrays, Python
lists, and Python scalars" and objects with ``__array__``/``__array_interface__``
(tensorflow/python/framework/tensor_conversion.py, ``convert_to_tensor_v2_with_dispatch``), and the
distribute library calls it on every value it reduces that is not a tensor yet
(tensorflow/python/distribute/cross_device_ops.py, ``_make_tensor_into_per_replica``, used by
``CrossDeviceOps.reduce`` and ``batch_reduce``), on a variable's ``initial_value`` ("A Tensor, or
Python object convertible to a Tensor", tensorflow/python/ops/variables.py, ``Variable.__init__``)
and on dataset components (``Dataset.from_tensor_slices``/``from_tensors`` through
``structure.normalize_element``). TF does not convert ``strategy.run`` arguments or what
``experimental_distribute_values_from_function``'s function returns (mirrored_strategy.py,
``_experimental_distribute_values_from_function`` regroups the values as they are); mpistrat
converts those when they reach one of the points above. DLPack-only objects are an mpistrat
extension (TF needs ``tf.experimental.dlpack.from_dlpack``).

Every strategy runs the same checks: OneDevice, Mirrored over two logical CPUs, and
MultiWorkerMirrored (marked ``mpi``; run under ``mpiexec -n 2`` and ``-n 4``). JAX and PyTorch
cases skip when the library is not installed.
"""

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import arrays
from mpistrat.devices import cupy_or_none

from helpers import DLPackOnly

BASE = np.arange(4, dtype=np.float32)
MATRIX = np.arange(6, dtype=np.float32).reshape(3, 2)


class ArrayInterfaceOnly:
    """An array that offers only ``__array_interface__``, over a NumPy array."""

    def __init__(self, array):
        self._array = array

    @property
    def __array_interface__(self):
        return self._array.__array_interface__


class CudaArrayInterfaceOnly:
    """An object that offers only ``__cuda_array_interface__`` (the dict it is given)."""

    def __init__(self, interface):
        self._interface = interface

    @property
    def __cuda_array_interface__(self):
        return self._interface


def host_interface(array):
    """A ``__cuda_array_interface__`` dict over host memory (claims GPU memory; never read in these tests)."""
    return {"shape": array.shape, "typestr": array.dtype.str, "data": (array.ctypes.data, False), "version": 3,
            "strides": None}


def _jax(a):
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(a)


def _torch(a):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.array(a))


def _big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


FOREIGN = {
    "jax": _jax,
    "torch": _torch,
    "dlpack": DLPackOnly,
    "array_interface": ArrayInterfaceOnly,
    "big_endian": _big_endian,
}


@pytest.fixture(params=sorted(FOREIGN))
def foreign(request):
    """A maker of one kind of foreign array from a float32 NumPy array."""
    make = FOREIGN[request.param]
    make(BASE)  # skips here, once, when the library is missing
    return make


@pytest.fixture(scope="module")
def multi_worker():
    """One MultiWorkerMirroredStrategy over all ranks, shared by this module's tests (making one is collective)."""
    return ms.MultiWorkerMirroredStrategy()


@pytest.fixture(params=[
    "one_device",
    "mirrored",
    pytest.param("multi_worker", marks=pytest.mark.mpi(min_size=1)),
])
def strategy(request):
    if request.param == "one_device":
        return ms.OneDeviceStrategy("/cpu:0")
    if request.param == "mirrored":
        return ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return request.getfixturevalue("multi_worker")


def assert_native(result, expected):
    """``result`` is a NumPy array (or NumPy scalar) in native byte order equal to ``expected``, dtype included."""
    assert type(result) is np.ndarray or isinstance(result, np.generic), type(result)
    assert result.dtype.isnative and result.dtype == expected.dtype, result.dtype
    np.testing.assert_array_equal(result, expected)


# -- the conversion itself ----------------------------------------------------------------------------------------


def test_native_values_come_back_as_they_are():
    array = np.ones((2, 3), np.float32)
    assert arrays.as_array(array) is array
    for scalar in (3, 2.5, True, 1 + 2j, np.float32(1.5), np.int64(7)):
        assert arrays.as_array(scalar) is scalar
    leaves = [array, np.zeros(2, np.int64)]
    assert arrays.as_arrays(leaves) is leaves


def test_foreign_arrays_become_numpy(foreign):
    result = arrays.as_array(foreign(BASE))
    assert_native(result, BASE)


@pytest.mark.parametrize("make", [DLPackOnly, ArrayInterfaceOnly])
def test_dlpack_and_array_interface_are_read_without_a_copy(make):
    source = np.arange(5, dtype=np.int32)
    result = arrays.as_array(make(source))
    assert_native(result, source)
    assert np.shares_memory(result, source)


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">c16", ">u2"])
def test_non_native_byte_order_is_converted_to_native(dtype):
    # TF 2.21: tf.convert_to_tensor(np.arange(4, dtype='>f4')) is a tf.float32 tensor whose .numpy() is in native
    # byte order (tf.as_dtype(np.dtype('>f4')) is tf.float32, whose as_numpy_dtype is the native float32;
    # tensorflow/python/framework/dtypes.py, as_dtype). MPI would otherwise sum the swapped bytes.
    source = np.arange(4).astype(dtype)
    result = arrays.as_array(source)
    assert result.dtype.isnative and result.dtype == np.dtype(dtype).newbyteorder("=")
    assert result.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("value, dtype", [
    (np.array(["a", "b"]), "<U1"),
    (np.array([b"xy"]), "|S2"),
    (np.array([{"a": 1}], dtype=object), "object"),
    ("text", "<U4"),
    (np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64[D]"),
])
def test_strings_and_objects_are_rejected_naming_the_value_and_dtype(value, dtype):
    with pytest.raises(TypeError) as info:
        arrays.as_array(value, what="all_reduce")
    message = str(info.value)
    assert message.startswith("all_reduce: ") and dtype in message and "not numeric" in message
    assert repr(value)[:20] in message


def test_datasets_keep_strings():
    strings = np.array(["a", "bc"])
    assert arrays.as_array(strings, numeric=False) is strings
    swapped = arrays.as_array(np.array(["ab"], dtype=">U2"), numeric=False)
    assert swapped.dtype.isnative and swapped.tolist() == ["ab"]


def test_unsupported_dlpack_device_is_named():
    with pytest.raises(TypeError, match="DLPack device type 8"):
        arrays.as_array(DLPackOnly(BASE, device=(8, 0)), what="reduce")


@pytest.mark.skipif(cupy_or_none() is not None, reason="CuPy with a GPU is installed: the conversion would succeed")
def test_gpu_memory_without_cupy_says_what_to_install():
    for value in (CudaArrayInterfaceOnly(host_interface(BASE)), DLPackOnly(BASE, device=(2, 0))):
        with pytest.raises(RuntimeError, match=r"GPU memory .* CuPy is not installed.*mpistrat\[cuda12\]"):
            arrays.as_array(value, what="reduce")


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["__cuda_array_interface__", "__dlpack__"])
def test_gpu_memory_becomes_cupy_without_a_copy(protocol):
    import cupy

    source = cupy.arange(4, dtype=cupy.float32)
    value = (CudaArrayInterfaceOnly(source.__cuda_array_interface__) if protocol == "__cuda_array_interface__"
             else DLPackOnly(source))
    result = arrays.as_array(value)
    assert isinstance(result, cupy.ndarray) and result.dtype == cupy.float32
    assert result.data.ptr == source.data.ptr
    assert result.get().tolist() == [0, 1, 2, 3]


def test_a_producer_that_refuses_is_named():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"Variable initial_value: cannot convert Tensor .*numpy.asarray.*detach"):
        arrays.as_array(torch.ones(2, requires_grad=True), what="Variable initial_value")


def test_unsupported_foreign_dtype_is_named():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match="has dtype bfloat16, which is not numeric"):
        arrays.as_array(jnp.ones(2, jnp.bfloat16))


# -- every strategy: the points where values enter --------------------------------------------------------------


def _global_id():
    return ms.get_replica_context().replica_id_in_sync_group


def test_all_reduce(strategy, foreign):
    # TF converts each value it reduces that is not a tensor yet (cross_device_ops.py, _make_tensor_into_per_replica,
    # reached from ReplicaContext.all_reduce through batch_reduce_to); the result is a tensor, here a NumPy array.
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("sum", foreign(BASE + _global_id())))
    expected = n * BASE + np.float32(n * (n - 1) / 2)
    for result in strategy.experimental_local_results(out):
        assert_native(result, expected)


def test_reduce_across_replicas_and_along_an_axis(strategy, foreign):
    # TF: Strategy.reduce -> extended.reduce_to -> CrossDeviceOps.reduce, which converts (as test_all_reduce); the
    # values of experimental_distribute_values_from_function stay as value_fn returned them until then.
    n = strategy.num_replicas_in_sync
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: foreign(BASE + ctx.replica_id_in_sync_group))
    assert_native(strategy.reduce("sum", values, axis=None), n * BASE + np.float32(n * (n - 1) / 2))
    assert_native(strategy.reduce("max", values, axis=None), BASE + np.float32(n - 1))
    assert_native(strategy.reduce("sum", values, axis=0), np.array(n * BASE.sum() + 4 * n * (n - 1) / 2, np.float32))
    assert_native(strategy.reduce("mean", values, axis=0), np.array(BASE.mean() + (n - 1) / 2, np.float32))


def test_broadcast_and_reduce_to(strategy, foreign):
    # TF: broadcast copies with array_ops.identity (cross_device_ops.py simple_broadcast ->
    # cross_device_utils.copy_tensor_or_indexed_slices_to_device), which converts its input to a tensor.
    ext = strategy.extended
    placed = ext.broadcast_to(foreign(BASE), ext.worker_devices[0])
    assert_native(placed, BASE)
    assert_native(ext.reduce_to("mean", foreign(BASE), ext.worker_devices[0]), BASE)


def test_variables(strategy, foreign):
    # TF: Variable's initial_value is "A Tensor, or Python object convertible to a Tensor" (variables.py); assign*
    # convert their value (resource_variable_ops.py, BaseResourceVariable.assign: ops.convert_to_tensor).
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        v = ms.Variable(foreign(BASE))
        mean = ms.Variable(np.zeros(4, np.float32), aggregation=ms.VariableAggregation.MEAN)
    assert v.dtype == np.float32
    assert_native(v.numpy(), BASE)
    v.assign(foreign(2 * BASE))
    v.assign_add(foreign(BASE))
    v.assign_sub(foreign(np.ones(4, np.float32)))
    assert_native(v.numpy(), 3 * BASE - 1)
    strategy.run(lambda: mean.assign(foreign(BASE + _global_id())))
    assert_native(mean.numpy(), BASE + np.float32((n - 1) / 2))


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.int8])
@pytest.mark.parametrize("make", [DLPackOnly, ArrayInterfaceOnly, _torch])
def test_variables_keep_the_dtype_of_a_foreign_array(strategy, make, dtype):
    # TF 2.21: tf.Variable(<object with __array_interface__ over float64>) is tf.float64; only Python numbers and
    # lists take TF's float32/int32 defaults (tf.Variable([1.0]).dtype is tf.float32).
    with strategy.scope():
        v = ms.Variable(make(np.arange(3, dtype=dtype)))
        python = ms.Variable([1.0, 2.0])
    assert v.dtype == dtype and python.dtype == np.float32
    assert_native(v.numpy(), np.arange(3, dtype=dtype))


def test_dataset_sources(strategy, foreign):
    # TF: from_tensor_slices/from_tensors convert every component (dataset_ops.py -> structure.normalize_element ->
    # ops.convert_to_tensor), so elements are tensors (here NumPy arrays) in native byte order.
    rows = list(ms.data.Dataset.from_tensor_slices(foreign(MATRIX)))
    assert len(rows) == 3
    for row, expected in zip(rows, MATRIX):
        assert_native(row, expected)
    (whole,) = list(ms.data.Dataset.from_tensors(foreign(MATRIX)))
    assert_native(whole, MATRIX)
    n = strategy.num_replicas_in_sync
    dataset = ms.data.Dataset.from_tensor_slices(foreign(np.arange(2 * n, dtype=np.float32))).batch(2 * n)
    (element,) = list(strategy.experimental_distribute_dataset(dataset))
    total = strategy.reduce("sum", element, axis=0)
    assert_native(total, np.array(sum(range(2 * n)), np.float32))


def test_strings_are_rejected_everywhere_on_every_rank(strategy):
    # A deliberate difference: TF has tf.string tensors and variables; mpistrat computes with numeric arrays only and
    # rejects strings where they enter, under every strategy alike. Every rank passes the same strings here, so every
    # rank raises before any collective and no rank is left waiting.
    strings = np.array(["a", "b"])
    with pytest.raises(TypeError, match=r"all_reduce: .*dtype <U1, which is not numeric"):
        strategy.run(lambda: ms.get_replica_context().all_reduce("sum", strings))
    values = strategy.experimental_distribute_values_from_function(lambda ctx: strings)
    with pytest.raises(TypeError, match=r"reduce: .*dtype <U1, which is not numeric"):
        strategy.reduce("sum", values, axis=None)
    with strategy.scope(), pytest.raises(TypeError, match=r"Variable initial_value: .*dtype <U1"):
        ms.Variable(strings)
    with strategy.scope():
        v = ms.Variable(BASE)
    with pytest.raises(TypeError, match=r"assign to variable .*dtype <U1"):
        v.assign(np.array(["a", "b", "c", "d"]))
    # Strings stay valid in datasets, as in tf.data.
    assert list(ms.data.Dataset.from_tensor_slices(strings)) == ["a", "b"]
    # The strategy still works afterwards (no rank was left in a collective).
    out = strategy.run(lambda: ms.get_replica_context().all_reduce("sum", np.ones(2, np.float32)))
    for result in strategy.experimental_local_results(out):
        assert result.tolist() == [strategy.num_replicas_in_sync] * 2
