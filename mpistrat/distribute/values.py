"""Reduction operations and distributed values (``PerReplica``, ``Mirrored``)."""

from __future__ import annotations

import enum
from typing import Any, Sequence

__all__ = ["ReduceOp", "DistributedValues", "PerReplica", "Mirrored"]


class ReduceOp(enum.Enum):
    """How values from replicas are combined: SUM and MEAN (as TF) plus MIN and MAX."""

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @staticmethod
    def from_string(op: "str | ReduceOp") -> "ReduceOp":
        """``ReduceOp.from_string("mean")`` -> ``ReduceOp.MEAN`` (case-insensitive)."""
        if type(op) is str:
            found = _OPS_BY_NAME.get(op)  # the exact spellings: one lookup on the hot path
            if found is not None:
                return found
        elif isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return ReduceOp[op.strip().upper()]
            except KeyError:
                pass
        raise ValueError(
            f"Unknown reduce op {op!r}; expected one of SUM, MEAN, MIN, MAX (a ReduceOp or a string)."
        )

    @staticmethod
    def from_variable_aggregation(aggregation: Any) -> "ReduceOp":
        """The reduce op matching a ``VariableAggregation`` (SUM or MEAN)."""
        name = getattr(aggregation, "name", str(aggregation)).upper()
        if name in ("SUM", "MEAN"):
            return ReduceOp[name]
        raise ValueError(
            f"Could not convert from `VariableAggregation` {name} to `ReduceOp` type"
        )


_OPS_BY_NAME = {spelling: op for op in ReduceOp for spelling in (op.value, op.value.lower())}


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

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n  {inner}\n}}"

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"A {type(self).__name__} holds one value per replica and cannot be used where a single "
            "value is needed; reduce it with strategy.reduce(...), or read one replica's value with "
            "strategy.experimental_local_results(...)."
        )

    def __bool__(self) -> bool:
        raise TypeError(
            f"The truth value of a {type(self).__name__} is ambiguous (one value per replica)."
        )


class PerReplica(DistributedValues):
    """One (possibly different) value per replica, e.g. returned by ``strategy.run``."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """The same value on every replica (one copy per device)."""

    __slots__ = ()
