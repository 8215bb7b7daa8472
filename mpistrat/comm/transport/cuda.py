"""CUDA-aware MPI detection, device-buffer helpers and pinned host staging.

* :func:`mpi_cuda_support` asks the loaded MPI library
  (``MPIX_Query_cuda_support``, exported by MPICH and Open MPI) through
  ctypes; the library is the ``libmpi`` that mpi4py loaded, found in
  ``/proc/self/maps``. ``MPISTRAT_CUDA_AWARE=1``/``0`` forces the answer.
* :func:`is_device_buffer` / :func:`synchronize_producer`: objects exposing
  ``__cuda_array_interface__`` (CuPy arrays and others); the producer's
  stream is synchronised before MPI touches the memory.
* :class:`PinnedStaging`: reusable page-locked host buffers
  (``cupy.cuda.alloc_pinned_memory``) for MPI without CUDA support; they
  grow on demand and are never allocated per call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np

__all__ = [
    "CUDA_AWARE_ENV",
    "mpi_cuda_support",
    "loaded_mpi_library",
    "is_device_buffer",
    "is_cupy_array",
    "synchronize_producer",
    "PinnedStaging",
]

CUDA_AWARE_ENV = "MPISTRAT_CUDA_AWARE"


def loaded_mpi_library() -> str | None:
    """Path of the MPI shared library mapped into this process, or None."""
    from mpi4py import MPI  # noqa: F401, PLC0415 - make sure libmpi is loaded

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = [line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6]
    except OSError:
        return None
    candidates = [p for p in paths if "/libmpi" in p and ".so" in p]
    # Prefer the C library (libmpi.so*, libmpich.so*) over Fortran/C++ bindings.
    for path in candidates:
        base = os.path.basename(path)
        if base.startswith(("libmpi.so", "libmpich.so")):
            return path
    return candidates[0] if candidates else None


@functools.lru_cache(maxsize=1)
def _query_library() -> bool | None:
    path = loaded_mpi_library()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        query = lib.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def mpi_cuda_support() -> bool | None:
    """Whether the MPI library accepts CUDA device pointers.

    ``MPISTRAT_CUDA_AWARE=1`` or ``0`` forces True or False; otherwise the
    library's ``MPIX_Query_cuda_support()`` answers, and None means unknown
    (the query is not exported).
    """
    forced = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    if forced:
        raise ValueError(f"{CUDA_AWARE_ENV} must be 1 or 0, got {forced!r}")
    return _query_library()


def is_cupy_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy ndarray (without importing CuPy)."""
    return type(x).__module__.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def is_device_buffer(x: Any) -> bool:
    """Whether ``x`` exposes ``__cuda_array_interface__`` (device memory)."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


def synchronize_producer(x: Any) -> None:
    """Wait until the work producing ``x`` on its stream has finished.

    CuPy arrays: the current stream is synchronised. Other producers: the
    ``stream`` of their ``__cuda_array_interface__`` (version 3), if given.
    """
    if is_cupy_array(x):
        import cupy  # noqa: PLC0415

        cupy.cuda.get_current_stream().synchronize()
        return
    stream = x.__cuda_array_interface__.get("stream")
    if stream is None or stream in (0,):
        return  # no stream given / legacy default stream semantics
    import cupy  # noqa: PLC0415

    cupy.cuda.ExternalStream(int(stream)).synchronize()


class PinnedStaging:
    """Page-locked host buffers, one per slot, grown on demand and reused."""

    def __init__(self) -> None:
        self._memory: dict[Any, Any] = {}
        self._nbytes: dict[Any, int] = {}

    def get(self, count: int, dtype: np.dtype, slot: Any = 0) -> np.ndarray:
        """A 1-D NumPy view of ``count`` items over pinned memory for ``slot``."""
        dtype = np.dtype(dtype)
        nbytes = max(count * dtype.itemsize, 1)
        if self._nbytes.get(slot, 0) < nbytes:
            import cupy  # noqa: PLC0415

            size = max(nbytes, 2 * self._nbytes.get(slot, 0))
            self._memory[slot] = cupy.cuda.alloc_pinned_memory(size)
            self._nbytes[slot] = size
        return np.frombuffer(self._memory[slot], dtype=dtype, count=count)

    def close(self) -> None:
        """Drop the buffers (freed when no view refers to them)."""
        self._memory.clear()
        self._nbytes.clear()
