"""Variable partitioners (``tf.distribute.experimental.partitioners``) and TF's split of rows into shards."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner",
           "shard_offsets", "shard_sizes", "num_shards_for"]


def _dims(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints (a tuple, list, array shape or anything with ``as_list()``)."""
    if hasattr(shape, "as_list"):
        shape = shape.as_list()
    dims = tuple(shape)
    if any(d is None for d in dims):
        raise ValueError(f"shape is not fully defined: {shape}")
    return tuple(int(d) for d in dims)


def _element_bytes(dtype: Any, bytes_per_string: int) -> int:
    """Bytes of one element: the dtype's item size, or ``bytes_per_string`` for strings (TF's estimate)."""
    dt = np.dtype(getattr(dtype, "name", dtype))
    if dt.kind in "USO":
        return bytes_per_string
    return dt.itemsize


class Partitioner:
    """Base class of partitioners: ``partitioner(shape, dtype, axis=0)`` gives the number of shards per axis.

    As TF's ``tf.distribute.experimental.partitioners.Partitioner``: the
    result is a list with one entry per axis, all 1 except ``axis``.
    """

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        """Partition ``shape``: a list of the number of partitions on each axis."""
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """A fixed number of shards (never more than the axis has rows).

    >>> FixedShardsPartitioner(num_shards=2)((10, 3), np.float32)
    [2, 1]
    """

    def __init__(self, num_shards: int):
        self._num_shards = num_shards

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        dims = _dims(shape)
        result = [1] * len(dims)
        result[axis] = min(self._num_shards, dims[axis])
        return result


class MinSizePartitioner(Partitioner):
    """At least ``min_shard_bytes`` per shard, as many shards as that allows, at most ``max_shards``.

    TF's arithmetic (``partitioned_variables.min_max_variable_partitioner``):
    ``max(1, min(rows, max_shards, ceil(total_bytes / min_shard_bytes)))``.

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
    [2, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        if min_shard_bytes < 1:
            raise ValueError(f"Argument `min_shard_bytes` must be positive. Received: {min_shard_bytes}")
        if max_shards < 1:
            raise ValueError(f"Argument `max_shards` must be positive. Received: {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"Argument `bytes_per_string` must be positive. Received: {bytes_per_string}")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        dims = _dims(shape)
        if axis >= len(dims):
            raise ValueError(f"Cannot partition variable along axis {axis} when shape is only {list(dims)}")
        total_bytes = math.prod(dims) * _element_bytes(dtype, self._bytes_per_string)
        partitions = total_bytes / self._min_shard_bytes
        result = [1] * len(dims)
        result[axis] = max(1, min(dims[axis], self._max_shards, int(math.ceil(partitions))))
        return result


class MaxSizePartitioner(Partitioner):
    """At most ``max_shard_bytes`` per shard, as few shards as that allows (``max_shards`` takes precedence).

    TF's arithmetic (``partitioned_variables.variable_axis_size_partitioner``):
    rows per shard ``max(1, floor(max_shard_bytes / bytes_per_row))``, shards
    ``ceil(rows / rows_per_shard)``, capped by ``max_shards``.

    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32)
    [6, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        if max_shard_bytes < 1:
            raise ValueError(f"Argument `max_shard_bytes` must be positive. Received {max_shard_bytes}")
        if max_shards and max_shards < 1:
            raise ValueError(f"Argument `max_shards` must be positive. Received {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"Argument `bytes_per_string` must be positive. Received: {bytes_per_string}")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        dims = _dims(shape)
        element = _element_bytes(dtype, self._bytes_per_string)
        bytes_per_slice = 1.0 * (math.prod(dims) / dims[axis]) * element
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        axis_shards = int(math.ceil(1.0 * dims[axis] / slices_per_shard))
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        result = [1] * len(dims)
        result[axis] = axis_shards
        return result


def num_shards_for(partitions: Sequence[int], rows: int) -> int:
    """The number of shards a partitioner's answer gives a variable of ``rows`` rows along axis 0.

    As TF's ``ParameterServerStrategyV2`` (``_create_variable``): the answer
    must be non-empty with a non-zero first entry and 1 elsewhere
    (ValueError otherwise); shards are at most ``rows``.
    """
    partitions = list(partitions) if partitions is not None else []
    if not partitions or partitions[0] == 0 or any(v != 1 for v in partitions[1:]):
        raise ValueError("variable_partitioner must return a list/tuple whose elements are 1 besides the first "
                         f"element (non-zero), got: {partitions!r}")
    return min(int(partitions[0]), rows)


def shard_offsets(rows: int, num_shards: int) -> list[int]:
    """Where each shard starts, and ``rows`` at the end: TF's "div" split (the first ``rows % num_shards``
    shards get one row more), as ``ParameterServerStrategyV2._create_variable`` computes it."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    base, extra = divmod(rows, num_shards)
    offsets = [0]
    for i in range(1, num_shards):
        offsets.append(offsets[-1] + base + (1 if i - 1 < extra else 0))
    offsets.append(rows)
    return offsets


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    """Rows of each shard (TF's split: 13 rows over 5 shards are ``[3, 3, 3, 2, 2]``)."""
    offsets = shard_offsets(rows, num_shards)
    return [b - a for a, b in zip(offsets, offsets[1:])]
