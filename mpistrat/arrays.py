"""Arrays from other libraries: the one conversion into NumPy or CuPy where user values enter mpistrat."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from mpistrat import devices as dev

__all__ = ["as_array", "as_arrays", "python_default_dtype", "kind_change_error"]

# Every native-byte-order dtype mpistrat computes with: bool, integers, floating point, complex.
_NATIVE_NUMERIC = frozenset(np.dtype(code) for code in "?" + np.typecodes["AllInteger"] + np.typecodes["AllFloat"])
NATIVE_NUMERIC = _NATIVE_NUMERIC  # the dtypes as_arrays passes through unconverted
_NUMERIC_KINDS = frozenset("biufc")
_PYTHON_SCALARS = (bool, int, float, complex)
_NDARRAY_ONLY = {np.ndarray}
_dtype_of = operator.attrgetter("dtype")

# DLPack device types (dlpack.h DLDeviceType): memory NumPy reads, and GPU memory CuPy reads.
_DLPACK_HOST = frozenset((1, 3, 11))  # kDLCPU, kDLCUDAHost, kDLROCMHost
_DLPACK_GPU = frozenset((2, 10, 13))  # kDLCUDA, kDLROCM, kDLCUDAManaged
_NUMPY_PROTOCOLS = ("__array__", "__array_interface__", "__array_struct__")


def as_array(value: Any, *, what: str = "value", numeric: bool = True) -> Any:
    """``value`` as an array mpistrat computes with: NumPy for host memory, CuPy for GPU memory.

    NumPy and CuPy arrays, NumPy scalars and Python numbers are native and come back as they
    are (a NumPy array in non-native byte order is converted to native order, as
    ``tf.convert_to_tensor`` does). Objects from other libraries (JAX, PyTorch, ...) are
    converted once, without a copy where the producer allows it, and the result may share
    memory with ``value``:

    - ``__cuda_array_interface__``, or ``__dlpack__`` on a CUDA/ROCm device: ``cupy.asarray``
      or ``cupy.from_dlpack`` (a ``cupy.ndarray``; CuPy is optional and needed only here);
    - ``__array__``, ``__array_interface__`` or ``__array_struct__``: ``numpy.asarray``;
    - ``__dlpack__`` on the host: ``numpy.from_dlpack``;
    - anything else (lists, ...): ``numpy.asarray``.

    With ``numeric`` (the default) the result must hold bool, integer, floating-point or
    complex values; strings, objects and other dtypes raise TypeError naming ``what``, the
    value and its dtype. ``numeric=False`` keeps any dtype (dataset elements carry strings).
    """
    if type(value) is np.ndarray and value.dtype in _NATIVE_NUMERIC:  # the common case
        return value
    if isinstance(value, _PYTHON_SCALARS):
        return value
    if isinstance(value, (np.ndarray, np.generic)) or dev.is_cupy_array(value):
        array = value
    else:
        array = _convert(value, what)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if numeric and array.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(f"{what}: {_describe(value)} has dtype {array.dtype}, which is not numeric; mpistrat takes "
                        "bool, integer, floating-point and complex arrays here")
    return array


_FLOAT32 = np.dtype(np.float32)
_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)
_INT32_RANGE, _INT64_RANGE = np.iinfo(np.int32), np.iinfo(np.int64)


def python_default_dtype(value: Any) -> np.dtype | None:
    """The dtype ``tf.convert_to_tensor`` gives a Python number, list or tuple; None where NumPy's is kept.

    As TF 2.21: a Python float gives float32, an int int32 (int64 when a value is outside int32's range,
    ValueError outside int64's), a bool bool, a complex complex128. A list or tuple is a tensor of its
    leaves: integers of any kind give int32 (int64 when out of range); floating values take the dtype of
    the first leaf when that is a NumPy floating value (``[np.float64(1), 2.0]`` is float64), else
    float32 (``[1, np.float64(2)]``, as TF samples the first leaf). Arrays of any library, NumPy scalars,
    strings and bools keep their own dtype (None).
    """
    if isinstance(value, (np.generic, bool)):  # NumPy scalars are float and int subclasses too
        return None
    if isinstance(value, float):
        return _FLOAT32
    if isinstance(value, int):
        return _int_dtype(value, value)
    if isinstance(value, (list, tuple)):
        return _sequence_dtype(value)
    return None


# The kinds of value each kind of dtype takes without a change of kind. TF's rule (IsCompatible in
# tensorflow/python/eager/pywrap_tensor.cc, which decides what convert_to_tensor(value, dtype) casts):
# integers into integers, integers and floats into floats, every number into complex, only bools into
# bool. Bools go into numbers too, as TF's converters take Python True as 1 (and NumPy bools are cast).
_TAKES_KINDS = {"b": "b", "i": "biu", "u": "biu", "f": "biuf", "c": "biufc"}
_KIND_NAMES = {"b": "booleans", "i": "integers", "u": "integers", "f": "floating-point values",
               "c": "complex values"}
_PYTHON_KINDS = ((bool, "b"), (int, "i"), (float, "f"), (complex, "c"))  # bool first: it is an int


def kind_change_error(value: Any, dtype: Any, what: str) -> TypeError | None:
    """The TypeError for making ``value`` (a number or an array as :func:`as_array` returns it) ``dtype``
    when that changes its kind, or None; ``what`` names the target (``"assign to variable 'v'"``).

    Refused are floating-point into integer (the fraction would be cut, NaN would become an arbitrary
    integer), complex into real or integer (the imaginary part would be dropped) and numbers into bool,
    as TF's ``convert_to_tensor(value, dtype)`` refuses them for Python values ("Cannot convert 1.7 to
    EagerTensor of dtype int32"). Changes within a kind (float64 into float32, int64 into int32) and
    widening ones (integers into floats, anything numeric into complex, bools into numbers) are taken, as
    TF takes them. TF casts NumPy arrays whatever their kind; mpistrat refuses those changes of kind for
    every value, so no assignment loses data silently.
    """
    if hasattr(value, "dtype"):  # NumPy and CuPy arrays, NumPy scalars
        kind, given = value.dtype.kind, str(value.dtype)
    else:
        kind = next((k for t, k in _PYTHON_KINDS if isinstance(value, t)), "O")
        given = f"Python {type(value).__name__}"
    target = np.dtype(dtype)
    if kind in _TAKES_KINDS.get(target.kind, target.kind):
        return None
    return TypeError(f"{what} of dtype {target}: the value has dtype {given}; {_KIND_NAMES.get(kind, 'such values')} "
                     f"do not become {_KIND_NAMES.get(target.kind, str(target))} implicitly (TensorFlow refuses "
                     "this for Python values); convert the value explicitly first if that is meant")


def _sequence_dtype(value: list | tuple) -> np.dtype | None:
    """``python_default_dtype`` of a list or tuple: NumPy's dtype for it, made TF's."""
    probe = np.asarray(value)
    if probe.dtype.kind in "iu":
        return _int_dtype(probe.min(), probe.max()) if probe.size else _INT32
    first = _first_leaf(value)
    if probe.dtype.kind == "f":
        return first.dtype if isinstance(first, np.floating) else _FLOAT32
    if probe.dtype == object and type(first) is int:  # Python ints beyond int64 (NumPy keeps them as objects)
        raise ValueError(f"Can't convert a Python sequence with an out-of-range integer to an array: {value!r:.80}")
    return None


def _int_dtype(low: Any, high: Any) -> np.dtype:
    """int32 when ``[low, high]`` fits it, else int64; ValueError beyond int64 (TF's rule for Python ints)."""
    low, high = int(low), int(high)
    if _INT32_RANGE.min <= low and high <= _INT32_RANGE.max:
        return _INT32
    if _INT64_RANGE.min <= low and high <= _INT64_RANGE.max:
        return _INT64
    raise ValueError(f"Can't convert out-of-range integer {high if high > _INT64_RANGE.max else low} to an array: "
                     "integers must fit in int64")


def _first_leaf(value: Any) -> Any:
    """The first scalar of a (nested) list or tuple, an array's first element (what TF samples); None if empty."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    if isinstance(value, np.ndarray):
        return value.reshape(-1)[0] if value.size else None
    return None if isinstance(value, (list, tuple)) else value


def as_arrays(values: list, *, what: str = "value") -> list:
    """``as_array`` of each item; ``values`` itself when every item is a native numeric NumPy array."""
    if set(map(type, values)) <= _NDARRAY_ONLY and set(map(_dtype_of, values)) <= _NATIVE_NUMERIC:
        return values
    return [as_array(v, what=f"{what} (value #{j})" if len(values) > 1 else what) for j, v in enumerate(values)]


def _convert(value: Any, what: str) -> Any:
    """A foreign ``value`` as a NumPy or CuPy array (device memory first, then NumPy's protocols, then DLPack)."""
    if isinstance(value, (list, tuple)):  # Python sequences: NumPy's own errors (ragged, mixed) are the clearest
        return np.asarray(value)
    if getattr(value, "__cuda_array_interface__", None) is not None:  # host tensors may raise AttributeError
        return _to_cupy(value, what, "__cuda_array_interface__")
    kind = type(value)
    dlpack = hasattr(kind, "__dlpack__")
    device_type = _dlpack_device_type(value, what) if dlpack else None
    if device_type in _DLPACK_GPU:
        return _to_cupy(value, what, "__dlpack__")
    if dlpack and not any(hasattr(kind, p) for p in _NUMPY_PROTOCOLS):
        if device_type is not None and device_type not in _DLPACK_HOST:
            raise TypeError(f"{what}: {_describe(value)} lives on DLPack device type {device_type}, which is "
                            "neither host nor CUDA/ROCm memory; copy it to the host first")
        return _call(np.from_dlpack, value, what, "numpy.from_dlpack")
    return _call(np.asarray, value, what, "numpy.asarray")


def _dlpack_device_type(value: Any, what: str) -> int | None:
    """The DLPack device type ``value`` reports (None when it has no ``__dlpack_device__``)."""
    device = getattr(value, "__dlpack_device__", None)
    if device is None:
        return None
    try:
        return int(device()[0])
    except Exception as exc:
        raise TypeError(f"{what}: {_describe(value)}.__dlpack_device__() failed: {exc}") from exc


def _to_cupy(value: Any, what: str, protocol: str) -> Any:
    cupy = dev.cupy_or_none()
    if cupy is None:
        raise RuntimeError(f"{what}: {_describe(value)} is GPU memory ({protocol}) but CuPy is not installed or sees "
                           "no GPU; install mpistrat[cuda12] or mpistrat[cuda13], or pass a host array")
    convert = cupy.asarray if protocol == "__cuda_array_interface__" else cupy.from_dlpack
    return _call(convert, value, what, f"cupy.{convert.__name__}")


def _call(convert: Any, value: Any, what: str, name: str) -> Any:
    try:
        return convert(value)
    except Exception as exc:  # the producer refused (a tensor that requires grad, an unsupported dtype, ...)
        raise TypeError(f"{what}: cannot convert {_describe(value)} with {name}: {exc}") from exc


def _describe(value: Any, limit: int = 80) -> str:
    """``value``'s repr, shortened, with its type when the repr does not start with it."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    name = type(value).__name__
    return text if text.startswith((name, "array(")) else f"{name} {text}"
