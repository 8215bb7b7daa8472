"""An all-reduce call's signature: per array ``(shape, dtype code)``, the arrays' kinds, a local error.

The signature is what the agreement check compares across ranks (hashed into the call's fingerprint)
and what plans are cached by.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import numpy as np

from mpistrat.comm.arraylist import loops as _arraylist
from mpistrat.devices import is_cupy_array, is_device_buffer

__all__ = ["HOST", "CUPY", "CAI", "ListSignature", "allreduce_signature", "list_signature"]

HOST, CUPY, CAI = 0, 1, 2  # the kinds of arrays: NumPy, CuPy, other __cuda_array_interface__ buffers

_SCALARS = (int, float, complex, np.generic)


class _DtypeCodes(dict):
    """dtype -> ``dtype.str``, filled on first use (the attribute builds a new string on every access)."""

    def __missing__(self, dtype: np.dtype) -> str:
        code = self[dtype] = dtype.str
        return code


_DTYPE_STR = _DtypeCodes()
_NDARRAY_ONLY = {np.ndarray}
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")


def _cai_info(x: Any) -> tuple[tuple[int, ...], np.dtype, bool]:
    cai = x.__cuda_array_interface__
    shape = tuple(int(n) for n in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize)
    return shape, dtype, contiguous


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def allreduce_signature(
    arrays: list, inplace: bool, device_mpi_missing: Callable[[], bool]
) -> tuple[tuple, tuple | None, Exception | None]:
    """Per-array ``(shape, dtype)`` signature, the arrays' kinds (None: all NumPy), a local error.

    Building it also validates the arrays, returning the error instead of raising it, so that the
    check can carry it to every rank. The common case, a list of NumPy arrays reduced into new
    arrays, is built in C loops.

    Scalars in ``arrays`` are replaced by 0-d arrays. ``device_mpi_missing()`` is asked only for
    buffers exposing ``__cuda_array_interface__`` alone: True when they cannot go to MPI (more than
    one rank and an MPI that is not CUDA-aware).
    """
    if not inplace:
        if len(arrays) == 1 and type(arrays[0]) is np.ndarray:  # the commonest case: one array
            a = arrays[0]
            return ((a.shape, _DTYPE_STR[a.dtype]),), None, None
        if set(map(type, arrays)) == _NDARRAY_ONLY:  # the common case, in C loops
            return tuple(zip(map(_shape_of, arrays), map(_DTYPE_STR.__getitem__, map(_dtype_of, arrays)))), None, None
    sig = []
    kinds = None
    for i, a in enumerate(arrays):
        if type(a) is np.ndarray:
            if inplace and not a.flags.writeable:
                return (), None, ValueError(f"allreduce(inplace=True): array #{i} is read-only")
            sig.append((a.shape, _DTYPE_STR[a.dtype]))
            if kinds is not None:
                kinds.append(HOST)
            continue
        if kinds is None:
            kinds = [HOST] * i
        if isinstance(a, np.ndarray):
            sig.append((a.shape, a.dtype.str))
            kinds.append(HOST)
        elif is_cupy_array(a):
            sig.append((tuple(a.shape), a.dtype.str, "CuPy"))
            kinds.append(CUPY)
        elif is_device_buffer(a):
            shape, dtype, contiguous = _cai_info(a)
            if not inplace:
                return (), None, TypeError(
                    f"allreduce: array #{i} ({type(a).__name__}) exposes only __cuda_array_interface__; "
                    "such buffers are reduced in place: pass inplace=True"
                )
            if not contiguous:
                return (), None, ValueError(f"allreduce: array #{i} ({type(a).__name__}) is not C-contiguous")
            if device_mpi_missing():
                return (), None, RuntimeError(
                    f"allreduce: array #{i} ({type(a).__name__}) is device memory and this MPI is not "
                    "CUDA-aware (set MPISTRAT_CUDA_AWARE=1 if it is); use CuPy arrays for host staging"
                )
            sig.append((shape, dtype.str, "CUDA buffer"))
            kinds.append(CAI)
        elif isinstance(a, _SCALARS) and not isinstance(a, bool):
            if inplace:
                return (), None, TypeError(f"allreduce(inplace=True): item #{i} is a scalar {a!r}, not an array")
            arrays[i] = a = np.asarray(a)
            sig.append((a.shape, a.dtype.str))
            kinds.append(HOST)
        else:
            return (), None, TypeError(
                f"allreduce: item #{i} is a {type(a).__name__}; expected NumPy or CuPy arrays or numbers"
            )
    return tuple(sig), (tuple(kinds) if kinds is not None else None), None


class ListSignature:
    """The signature of a call of a list of NumPy arrays, matched against a later call's list in one C loop.

    A later list matches when it has as many items, each exactly a ``numpy.ndarray``, C-contiguous, of
    the same shape and buffer format (so dtype) as this call's, in order: then
    :func:`allreduce_signature` would give it this call's signature, and its plan is this call's.
    """

    __slots__ = ("_formats", "_dims")

    def __init__(self, arrays: list) -> None:
        self._formats = tuple(memoryview(a).format.encode() for a in arrays)
        self._dims = np.array([n for a in arrays for n in (a.ndim, *a.shape)], np.int64).tobytes()

    def matches(self, arrays: list) -> bool:
        """Whether ``arrays`` (a list) is a call of this signature."""
        return _arraylist.matches(arrays, np.ndarray, self._formats, self._dims)


def list_signature(arrays: list) -> ListSignature | None:
    """The :class:`ListSignature` of ``arrays``, a list of NumPy arrays (exactly ``numpy.ndarray``), or None
    where the compiled loops are not built."""
    return None if _arraylist is None else ListSignature(arrays)
