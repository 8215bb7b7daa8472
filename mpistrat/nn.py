"""``ms.nn``: tf.nn's loss scaling for custom training loops (``compute_average_loss``, ``scale_regularization_loss``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpistrat import devices as dev
from mpistrat.arrays import as_array, python_default_dtype
from mpistrat.distribute import context
from mpistrat.distribute.variables import BaseVariable
from mpistrat.ops import mean_dtype

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None) -> Any:
    """The sum of the (weighted) per-example losses divided by the global batch size, as ``tf.nn``'s.

    Args:
      per_example_loss: the losses of this replica's examples, at least one
        dimension (the batch); NumPy or CuPy, or a Python list/scalar.
      sample_weight: optional weights: a scalar, or an array matching the
        losses (one dimension more or less is squeezed or expanded, as TF).
        As TF, the weighted losses are computed in float32 and cast back to
        the losses' dtype.
      global_batch_size: an integer scalar; default: the losses' first
        dimension times ``num_replicas_in_sync`` of the current replica
        context (so it must then be called inside ``strategy.run``).

    Returns:
      A 0-d array (NumPy or CuPy, as the losses) of the losses' dtype
      (float64 for integer losses); zero when ``global_batch_size`` is zero.
    """
    loss = _as_array(per_example_loss, "compute_average_loss: per_example_loss")
    input_dtype = loss.dtype
    if loss.ndim == 0:
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1. "
                         f"Received per_example_loss={loss} with rank 0")
    xp = _array_module(loss)
    if sample_weight is not None:
        weight = dev.to_device(_as_array(sample_weight, "compute_average_loss: sample_weight"), dev.device_of(loss))
        loss = _weighted(loss, weight).astype(input_dtype)
    if global_batch_size is None:
        _require_replica_context("compute_average_loss")
        global_batch_size = loss.shape[0] * context.get_strategy().num_replicas_in_sync
    batch = _check_global_batch_size(global_batch_size)
    result_dtype = mean_dtype(input_dtype)
    if batch == 0:  # TF's div_no_nan
        return xp.zeros((), dtype=result_dtype)
    return xp.asarray(xp.sum(loss).astype(result_dtype) / result_dtype.type(batch), dtype=result_dtype)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """The sum of ``regularization_loss`` divided by ``num_replicas_in_sync``, as ``tf.nn``'s (in replica context).

    Summed over the replicas by the gradient all-reduce, it counts once.
    A 0-d array; integer losses give float64.
    """
    _require_replica_context("scale_regularization_loss")
    loss = _as_array(regularization_loss, "scale_regularization_loss: regularization_loss")
    xp = _array_module(loss)
    return xp.asarray(xp.sum(loss) / context.get_strategy().num_replicas_in_sync)


def _require_replica_context(name: str) -> None:
    """Raise TF's RuntimeError when ``name`` is called in cross-replica context (in a strategy's scope)."""
    if context.has_strategy() and context.in_cross_replica_context():
        raise RuntimeError(f"You are calling `{name}` in cross replica context, while it was expected to be called "
                           "in replica context.")


def _as_array(x: Any, what: str) -> Any:
    """``x`` as a NumPy or CuPy array: a variable's current value; Python numbers and lists as TF converts them
    (float32, int32); arrays of other libraries through the one boundary conversion."""
    if isinstance(x, BaseVariable):
        x = x.value()
    default = python_default_dtype(x)
    array = as_array(x, what=what)
    if default is not None or isinstance(array, (bool, int, float, complex, np.generic)):
        return np.asarray(array, dtype=default)  # numbers pass the boundary as they are
    return array


def _array_module(x: Any) -> Any:
    return dev.array_module(dev.device_of(x))


def _weighted(loss: Any, weight: Any) -> Any:
    """``loss * weight`` in float32, ``weight``'s last dimension squeezed or expanded to ``loss``'s rank (TF's rule)."""
    if weight.ndim == loss.ndim + 1:
        if weight.shape[-1] != 1:
            raise ValueError(f"sample_weight of shape {weight.shape} does not match per_example_loss of shape "
                             f"{loss.shape}: its last dimension must be 1 to be squeezed")
        weight = weight[..., 0]
    elif weight.ndim != 0 and weight.ndim == loss.ndim - 1:
        weight = weight[..., None]
    try:
        return loss.astype(np.float32) * weight.astype(np.float32)
    except ValueError:
        raise ValueError(f"sample_weight of shape {weight.shape} cannot be broadcast to per_example_loss of "
                         f"shape {loss.shape}") from None


def _check_global_batch_size(global_batch_size: Any) -> int:
    """``global_batch_size`` as an int: a non-negative integer scalar (TF's checks and texts)."""
    size = np.asarray(dev.to_device(global_batch_size, "/cpu:0"))
    if size.ndim != 0:
        raise ValueError(f"global_batch_size must be scalar. Expected scalar shape, saw shape: {size.shape}.")
    if size.dtype.kind not in "iu":
        raise TypeError(f"global_batch_size must be an integer. Expected an integer, got {global_batch_size!r} "
                        f"of dtype {size.dtype}.")
    if size < 0:
        raise ValueError(f"global_batch_size must be non-negative. Got {int(size)}.")
    return int(size)
