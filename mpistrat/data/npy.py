"""Memory-mapped ``.npy`` shard files (first axis = examples).

``open_npy(path)`` parses the header itself, checks that the file holds all the
bytes the header promises, and maps the data read-only. A missing, unreadable
or truncated file raises an error naming the file, the byte offset and the rank.
"""

from __future__ import annotations

import os
from typing import Union

import numpy as np
from numpy.lib import format as npformat

from mpistrat.data.errors import DataLossError, rank_label

__all__ = ["open_npy"]


def _header(path: str, f) -> "tuple[tuple, np.dtype, bool, int]":
    try:
        version = npformat.read_magic(f)
    except ValueError as exc:
        raise DataLossError(f"{rank_label()}: {path!r} is not a .npy file (bad magic at byte offset 0): {exc}") from None
    try:
        if version == (1, 0):
            shape, fortran, dtype = npformat.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = npformat.read_array_header_2_0(f)
        else:
            shape, fortran, dtype = npformat._read_array_header(f, version)  # 3.0
    except (ValueError, OSError) as exc:
        raise DataLossError(f"{rank_label()}: unreadable .npy header in {path!r} at byte offset 6: {exc}") from None
    if dtype.hasobject:
        raise DataLossError(
            f"{rank_label()}: {path!r} holds Python objects (dtype {dtype}) at byte offset {f.tell()}; "
            "only plain numeric .npy files can be memory-mapped"
        )
    return shape, dtype, fortran, f.tell()


def open_npy(path: Union[str, os.PathLike]) -> np.ndarray:
    """The array in a ``.npy`` file, memory-mapped read-only (C order, at least 1-D)."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{rank_label()}: .npy file {path!r} not found (byte offset 0)") from None
    except OSError as exc:
        raise OSError(f"{rank_label()}: cannot open .npy file {path!r} (byte offset 0): {exc}") from exc
    with f:
        shape, dtype, fortran, offset = _header(path, f)
        size = os.fstat(f.fileno()).st_size
    if not shape:
        raise DataLossError(f"{rank_label()}: {path!r} holds a scalar (byte offset {offset}); shards need a first axis")
    if fortran and len(shape) > 1:
        raise DataLossError(
            f"{rank_label()}: {path!r} is in Fortran order (byte offset {offset}); save shards in C order"
        )
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size < offset + nbytes:
        raise DataLossError(
            f"{rank_label()}: truncated .npy file {path!r}: the header promises {nbytes} data bytes from byte "
            f"offset {offset} (to {offset + nbytes}) but the file ends at byte offset {size}"
        )
    if nbytes == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)

