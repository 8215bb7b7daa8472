"""Dataset elements: nests of NumPy leaves, and how batches are stacked, sliced and measured."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mpistrat import arrays, nest
from mpistrat.data.spec import to_numpy_leaf

__all__ = ["normalize_element", "stack_elements", "slice_element", "element_length"]


def normalize_element(x: Any) -> Any:
    """Lists become arrays (as tf.data does); tuples and dicts stay structures; numbers become NumPy.

    Python numbers and lists get TF's dtypes (``arrays.python_default_dtype``: float32, int32);
    arrays from other libraries are converted once (``arrays.as_array``: NumPy, or CuPy for GPU
    memory; native byte order); strings and objects stay, as dataset elements may carry them.
    """
    if isinstance(x, list):
        return np.asarray(x, dtype=arrays.python_default_dtype(x))
    if isinstance(x, dict):
        return type(x)((k, normalize_element(v)) for k, v in x.items()) if type(x) is not dict else {
            k: normalize_element(v) for k, v in x.items()
        }
    if isinstance(x, tuple):
        items = [normalize_element(v) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, (bytes, str)):
        return x
    default = arrays.python_default_dtype(x)
    if default is not None:  # a Python number
        return np.asarray(x, dtype=default)
    return to_numpy_leaf(arrays.as_array(x, what="dataset element", numeric=False))


def _stack_leaf(values: list, position: int) -> np.ndarray:
    first = values[0]
    if isinstance(first, (bytes, str)) or (isinstance(first, np.ndarray) and first.dtype == object and first.ndim == 0):
        out = np.empty(len(values), dtype=object)
        out[:] = values if not isinstance(first, np.ndarray) else [v[()] for v in values]
        return out
    try:
        return np.stack(values)
    except ValueError:
        shape0 = np.shape(first)
        for i, v in enumerate(values):
            if np.shape(v) != shape0:
                raise ValueError(
                    f"Cannot batch tensors with different shapes in component {position}. First element had "
                    f"shape {list(shape0)} and element {i} had shape {list(np.shape(v))}."
                ) from None
        raise


def stack_elements(elements: Sequence[Any]) -> Any:
    """Batch a list of elements of the same structure into one element (leaves stacked on axis 0)."""
    if not nest.is_nested(elements[0]):
        return _stack_leaf(list(elements), 0)
    flats = [nest.flatten(e) for e in elements]
    n = len(flats[0])
    for i, f in enumerate(flats):
        if len(f) != n:
            nest.assert_same_structure(elements[0], elements[i])
    leaves = [_stack_leaf([f[j] for f in flats], j) for j in range(n)]
    return nest.pack_sequence_as(elements[0], leaves)


def slice_element(element: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every leaf of a batched element."""
    if not nest.is_nested(element):
        return element[start:stop]
    return nest.map_structure(lambda x: x[start:stop], element)


def element_length(element: Any) -> int:
    """The leading (batch) dimension of a batched element; leaves must agree."""
    if isinstance(element, np.ndarray) and element.ndim:
        return int(element.shape[0])
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in nest.flatten(element)}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(
            "A distributed dataset's elements must be batches whose components share a leading dimension "
            f"(call .batch(global_batch_size) before distributing); got leading sizes {sorted(lengths)}"
        )
    return lengths.pop()
