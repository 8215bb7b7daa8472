"""Element specs: the shape and dtype of each leaf of a dataset element."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from mpistrat import arrays, nest
from mpistrat.distribute.values import PerReplica

__all__ = ["TensorSpec", "PerReplicaSpec", "spec_of", "per_replica_spec", "batched_spec", "unbatched_spec",
           "to_numpy_leaf"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape (``None`` for an unknown dimension) and dtype of one leaf, as ``tf.TensorSpec``."""

    shape: tuple
    dtype: np.dtype
    name: Optional[str] = None

    def is_compatible_with(self, value: Any) -> bool:
        """Whether ``value`` has this dtype and a shape matching the known dimensions."""
        arr = np.asarray(value) if not hasattr(value, "shape") else value
        if np.dtype(arr.dtype) != np.dtype(self.dtype) or len(arr.shape) != len(self.shape):
            return False
        return all(s is None or s == d for s, d in zip(self.shape, arr.shape))

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={np.dtype(self.dtype).name})"


@dataclass(frozen=True)
class PerReplicaSpec:
    """The specs of one ``PerReplica`` leaf: one TensorSpec per local replica, as ``tf.distribute``'s."""

    value_specs: tuple


def to_numpy_leaf(x: Any) -> Any:
    """Normalise a leaf: bytes/str stay as they are; numbers and arrays become NumPy."""
    if isinstance(x, (bytes, str, np.ndarray, np.generic)):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return x
    return np.asarray(x)


def _leaf_spec(x: Any) -> Any:
    if isinstance(x, PerReplica):
        return PerReplicaSpec(tuple(spec_of(v) for v in x.values))
    if isinstance(x, (bytes, str)):
        return TensorSpec((), np.dtype(object))
    shape = tuple(int(d) for d in getattr(x, "shape", np.shape(x)))
    if hasattr(x, "dtype"):
        return TensorSpec(shape, np.dtype(x.dtype))
    default = arrays.python_default_dtype(x)  # Python numbers: TF's float32, int32
    return TensorSpec(shape, default if default is not None else np.asarray(x).dtype)


def spec_of(element: Any) -> Any:
    """The nest of TensorSpecs describing ``element`` (a ``PerReplica`` leaf gets a PerReplicaSpec)."""
    return nest.map_structure(_leaf_spec, element)


def per_replica_spec(spec: Any, num_replicas: int) -> Any:
    """``spec`` with each TensorSpec leaf replaced by a PerReplicaSpec of ``num_replicas`` copies of it."""
    return nest.map_structure(lambda s: PerReplicaSpec((s,) * num_replicas), spec)


def batched_spec(spec: Any, batch_size: Optional[int]) -> Any:
    """Add a leading dimension (``None`` when batches may be partial)."""
    return nest.map_structure(lambda s: TensorSpec((batch_size,) + tuple(s.shape), s.dtype), spec)


def unbatched_spec(spec: Any) -> Any:
    """Remove the leading dimension; raises on scalars."""

    def drop(s: TensorSpec) -> TensorSpec:
        if len(s.shape) == 0:
            raise ValueError("Cannot unbatch an element with a scalar component; every component needs rank >= 1.")
        return TensorSpec(tuple(s.shape[1:]), s.dtype)

    return nest.map_structure(drop, spec)
