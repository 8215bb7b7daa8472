"""Reductions along axes inside one replica's value, before the cross-replica step of ``Strategy.reduce``."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mpistrat import arrays
from mpistrat import devices as dev
from mpistrat.distribute.values import ReduceOp
from mpistrat.ops import mean_dtype, reduce_dtype_error

__all__ = ["normalize_axis", "reduce_along", "sum_and_count"]


def normalize_axis(axis: "int | Sequence[int]", ndim: int) -> tuple[int, ...]:
    """``axis`` (an int or a sequence of ints) as a tuple of distinct non-negative axes of an ``ndim`` array."""
    axes = tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)
    out = []
    for a in axes:
        if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
            raise TypeError(f"axis must be an int or a sequence of ints, got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a value of rank {ndim}")
        out.append(int(a) % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"axis {axis!r} names an axis twice")
    return tuple(out)


def reduce_along(op: ReduceOp, x: Any, axis: "int | Sequence[int]") -> Any:
    """Reduce ``x`` along ``axis`` with SUM, MIN or MAX (an empty axis gives MIN/MAX's identity)."""
    x, xp = _array_and_module(x, op.wire)
    axes = normalize_axis(axis, x.ndim)
    if op is ReduceOp.SUM:
        return x.sum(axis=axes, dtype=x.dtype)  # TF's reduce_sum keeps the dtype (NumPy widens small ints)
    if any(x.shape[a] == 0 for a in axes):  # an empty batch contributes the identity of MIN/MAX
        shape = tuple(n for a, n in enumerate(x.shape) if a not in axes)
        if x.dtype.kind == "f":
            fill = np.inf if op is ReduceOp.MIN else -np.inf
        else:
            info = np.iinfo(x.dtype)
            fill = info.max if op is ReduceOp.MIN else info.min
        return xp.full(shape, fill, dtype=x.dtype)
    return x.min(axis=axes) if op is ReduceOp.MIN else x.max(axis=axes)


def sum_and_count(x: Any, axis: "int | Sequence[int]") -> tuple:
    """``x``'s sum along ``axis`` and the number of elements summed (for a global MEAN)."""
    x, xp = _array_and_module(x, "sum")
    axes = normalize_axis(axis, x.ndim)
    total = x.sum(axis=axes, dtype=x.dtype)
    count = int(np.prod([x.shape[a] for a in axes]))
    return total, xp.asarray(count, dtype=mean_dtype(total.dtype))


def _array_and_module(x: Any, wire: str) -> tuple[Any, Any]:
    """A replica's value as an array (converted once, ``arrays.as_array``) and its array module; TypeError
    where the wire op cannot reduce its dtype (the rule of every reduction, ``ops.reduce_dtype_error``)."""
    x = arrays.as_array(x, what="reduce")
    reason = reduce_dtype_error(x.dtype, wire)
    if reason is not None:
        raise TypeError(f"reduce along an axis: the value {reason}")
    xp = dev.array_module(dev.device_of(x))
    return xp.asarray(x), xp
