"""Distributed values: one value per local replica (``PerReplica``) or one mirrored across them (``Mirrored``)."""

from __future__ import annotations

from typing import Any, Sequence

from mpistrat.ops import ReduceOp

__all__ = ["ReduceOp", "DistributedValues", "PerReplica", "Mirrored"]  # ReduceOp: mpistrat.ops


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
