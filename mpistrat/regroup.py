"""Moving between per-replica structures and structures of per-replica values.

``regroup`` turns a list (one entry per local replica) of equally nested
structures into one structure whose leaves are ``PerReplica`` (or the shared
object when every replica gave the same one). ``select_replica`` does the
reverse for one replica.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpistrat import nest
from mpistrat.values import DistributedValues, Mirrored, PerReplica

__all__ = ["regroup", "select_replica", "contains_distributed", "local_values"]


def regroup(per_replica: Sequence[Any], wrap_class: type = PerReplica) -> Any:
    """Combine one structure per replica into one structure of distributed leaves."""
    per_replica = list(per_replica)
    if len(per_replica) == 1:
        return per_replica[0]
    first = per_replica[0]
    signature = nest.structure_signature(first)
    for i, other in enumerate(per_replica[1:], start=1):
        other_sig = nest.structure_signature(other)
        if other_sig != signature:
            raise ValueError(
                "Replicas returned values with different structures: "
                f"replica 0 returned {signature}, replica {i} returned {other_sig}"
            )
    flats = [nest.flatten(s) for s in per_replica]
    leaves = []
    for column in zip(*flats):
        if all(v is column[0] for v in column):
            leaves.append(column[0])
        else:
            leaves.append(wrap_class(column))
    return nest.pack_sequence_as(first, leaves)


def select_replica(local_replica_id: int, structure: Any) -> Any:
    """This replica's view of a structure: DistributedValues leaves become their component."""
    if isinstance(structure, DistributedValues):
        return structure._get_replica(local_replica_id)
    if not nest.is_nested(structure):
        return structure
    flat = nest.flatten(structure)
    if not any(isinstance(v, DistributedValues) for v in flat):
        return structure
    return nest.pack_sequence_as(
        structure,
        [v._get_replica(local_replica_id) if isinstance(v, DistributedValues) else v for v in flat],
    )


def contains_distributed(structure: Any) -> bool:
    """Whether any leaf is a DistributedValues (or distributed variable)."""
    return any(isinstance(v, DistributedValues) for v in nest.flatten(structure))


def local_values(value: Any, num_local: int) -> tuple:
    """The per-local-replica components of ``value`` (a plain value repeats)."""
    if isinstance(value, DistributedValues):
        if len(value.values) != num_local:
            raise ValueError(
                f"Expected a distributed value with {num_local} local replica value(s), "
                f"got one with {len(value.values)}"
            )
        return value.values
    return (value,) * num_local


def is_mirrored(value: Any) -> bool:
    """Whether ``value`` is Mirrored (including mirrored variables)."""
    return isinstance(value, Mirrored) or getattr(value, "_is_mirrored", False)
