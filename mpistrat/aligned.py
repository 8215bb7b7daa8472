"""Host arrays that start on a cache line, where TensorFlow's CPU allocator starts every tensor.

NumPy aligns its allocations to 16 bytes only. A 64-byte vector load (AVX-512) from an array that starts 16
bytes into a cache line spans two lines at every step, and BLAS kernels read the weights of a matmul that
way: `benchmarks/aligned_weights.py` measures the difference in a training step's matmuls.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ALIGNMENT", "copy", "empty", "ensure", "is_aligned"]

ALIGNMENT = 64  # bytes: TF's Allocator::kAllocatorAlignment (framework/allocator.h); one x86-64 cache line
_PLAIN_KINDS = frozenset("biufc")  # dtypes a byte buffer can be viewed as (no objects, no structures)


def is_aligned(array: np.ndarray) -> bool:
    """Whether ``array``'s first byte is on an ``ALIGNMENT`` boundary (an empty array has none: True)."""
    return array.size == 0 or array.__array_interface__["data"][0] % ALIGNMENT == 0


def empty(shape: tuple[int, ...], dtype: np.dtype | type | str) -> np.ndarray:
    """A new C-ordered array, uninitialised, whose first byte is on an ``ALIGNMENT`` boundary (bool and
    numeric dtypes; any other dtype: NumPy's own ``np.empty``)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in _PLAIN_KINDS:
        return np.empty(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.__array_interface__["data"][0] % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def copy(array: np.ndarray, dtype: np.dtype | type | str | None = None) -> np.ndarray:
    """A C-ordered copy of ``array`` from :func:`empty`, sharing no memory with it; with ``dtype``, converted
    to it whatever the kinds, as ``np.array(array, dtype=dtype)`` converts."""
    out = empty(array.shape, array.dtype if dtype is None else dtype)
    np.copyto(out, array, casting="unsafe")
    return out


def ensure(array: np.ndarray) -> np.ndarray:
    """``array`` itself where it is C-contiguous and on a boundary (or C-contiguous, of a dtype :func:`empty`
    cannot place), else :func:`copy`."""
    if array.flags.c_contiguous and (array.dtype.kind not in _PLAIN_KINDS or is_aligned(array)):
        return array
    return copy(array)
