"""Distributed values: one value per local replica (``PerReplica``) or one mirrored across them (``Mirrored``)."""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import numpy as np

from mpistrat import devices as dev
from mpistrat.distribute import context
from mpistrat.ops import ReduceOp

__all__ = ["ReduceOp", "DistributedValues", "PerReplica", "Mirrored", "ValueOperators"]  # ReduceOp: mpistrat.ops


class ValueOperators:
    """Python's operators applied to the value an object stands for (``_operand_value()``), as a tensor's.

    Arithmetic, comparison, bitwise operators, ``@`` and indexing; an operand
    that stands for a value too is read first. ``==`` and ``!=`` stay identity
    tests, so the objects stay hashable.
    """

    __slots__ = ()
    __array_priority__ = 100  # NumPy defers to the reflected operator: ``array + v`` reads ``v``

    def _operand_value(self) -> Any:
        raise NotImplementedError

    def __neg__(self) -> Any:
        return -self._operand_value()

    def __abs__(self) -> Any:
        return abs(self._operand_value())

    def __invert__(self) -> Any:
        return ~self._operand_value()

    def __getitem__(self, index: Any) -> Any:
        return self._operand_value()[index]

    def __pow__(self, other: Any, modulo: Any = None) -> Any:
        return pow(self._operand_value(), _operand(other), modulo)


def _operand(x: Any) -> Any:
    return x._operand_value() if isinstance(x, ValueOperators) else x


def _binary(op: Callable[[Any, Any], Any], reflected: bool = False) -> Callable:
    if reflected:
        return lambda self, other: op(_operand(other), self._operand_value())
    return lambda self, other: op(self._operand_value(), _operand(other))


_REFLECTED_OPERATORS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and_", "or_", "xor", "matmul")
_COMPARISONS = ("lt", "le", "gt", "ge")

for _name in _REFLECTED_OPERATORS + _COMPARISONS:
    _dunder = _name.rstrip("_")
    if _name != "pow":  # __pow__ takes a modulo (above)
        setattr(ValueOperators, f"__{_dunder}__", _binary(getattr(operator, _name)))
    if _name in _REFLECTED_OPERATORS:
        setattr(ValueOperators, f"__r{_dunder}__", _binary(getattr(operator, _name), reflected=True))
del _name, _dunder


class DistributedValues:
    """Values that differ (or may differ) per replica: one entry per local replica.

    ``values`` holds this process's replicas in order of their local index.
    Use ``strategy.experimental_local_results`` to read them, ``strategy.run``
    to compute on them replica by replica, and ``strategy.reduce`` to combine.
    """

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one value")
        self._values = values

    @property
    def values(self) -> tuple:
        """The per-replica values of this process, in local replica order."""
        return self._values

    def _get_replica(self, local_replica_id: int) -> Any:
        return self._values[local_replica_id]

    def _devices(self) -> tuple[str, ...]:
        """The canonical device of each local value (a NumPy value's is the host CPU, whatever its replica)."""
        return tuple(dev.device_of(v) for v in self._values)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n  {inner}\n}}"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Inside ``strategy.run``, the running replica's value; anywhere else a ValueError (TF's conversion)."""
        local_id = None if context.in_cross_replica_context() else context.current_local_replica_id()
        if local_id is None:
            raise ValueError(
                f"It looks like you are using a {type(self).__name__} object while not inside a replica context, "
                "which is not supported. Try running your op or function inside a replica context by using "
                "`strategy.run`, reduce it with strategy.reduce(...), or read one replica's value with "
                "strategy.experimental_local_results(...).")
        return _host_array(self._values[local_id], dtype)

    def __bool__(self) -> bool:
        raise TypeError(
            f"The truth value of a {type(self).__name__} is ambiguous (one value per replica)."
        )


class PerReplica(DistributedValues):
    """One (possibly different) value per replica, e.g. returned by ``strategy.run``."""

    __slots__ = ()


class Mirrored(ValueOperators, DistributedValues):
    """The same value on every replica (one copy per device), usable as that value.

    As tf.distribute's ``Mirrored``: operators, NumPy conversion and
    attributes act on this replica's copy inside ``strategy.run`` (the copy
    being updated inside ``extended.update``) and on the first copy anywhere
    else.
    """

    __slots__ = ()

    def _get(self) -> Any:
        """The copy that stands for the value here."""
        local_id = context.current_local_replica_id()
        if local_id is None:
            return self._values[0]
        if local_id >= len(self._values):
            raise ValueError(f"A {type(self).__name__} with {len(self._values)} value(s) was used in local replica "
                             f"{local_id}; it was made by another strategy.")
        return self._values[local_id]

    def _operand_value(self) -> Any:
        return self._get()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return _host_array(self._get(), dtype)

    def __bool__(self) -> bool:
        return bool(self._operand_value())

    def __getattr__(self, name: str) -> Any:
        # Public attributes are the value's (shape, dtype, ...); private ones, looked up by copy and
        # pickle on objects not yet initialised, never are.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._get(), name)


def _host_array(value: Any, dtype: Any) -> np.ndarray:
    """``value`` as a new NumPy array: writing into it leaves the value alone (as a tensor's ``numpy()``)."""
    host = dev.to_device(value, "/cpu:0")
    return np.array(host, dtype=dtype, copy=True) if host is value else np.asarray(host, dtype=dtype)
