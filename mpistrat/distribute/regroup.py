"""Moving between per-replica structures and structures of per-replica values.

``regroup`` turns one structure per local replica into one structure of
distributed leaves; ``select_replica`` and ``select_component`` take one
replica's view back out.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpistrat import nest
from mpistrat.distribute.values import DistributedValues, PerReplica

__all__ = ["regroup", "select_replica", "select_component", "contains_distributed", "local_values"]


def _container_of_copies(column: Sequence[Any]) -> Any:
    """The distributed variable whose local copies ``column`` holds in order, else None."""
    container = getattr(column[0], "_distributed_container", None)
    if container is None or len(container.values) != len(column):
        return None
    if all(v is c for v, c in zip(column, container.values)):
        return container
    return None


def regroup(per_replica: Sequence[Any], wrap_class: type = PerReplica, always_wrap: bool = False,
            what: str = "returned values") -> Any:
    """Combine one structure per replica into one structure of distributed leaves.

    A leaf that is the same object on every replica stays as it is (unless
    ``always_wrap``); the local copies of one distributed variable become that
    variable; anything else becomes ``wrap_class(values)``. Structures that
    differ between replicas raise ValueError naming both (``what`` says what
    the replicas gave, for the message).
    """
    per_replica = list(per_replica)
    if len(per_replica) == 1 and not always_wrap:
        return per_replica[0]
    first = per_replica[0]
    signature = nest.structure_signature(first)
    for i, other in enumerate(per_replica[1:], start=1):
        other_sig = nest.structure_signature(other)
        if other_sig != signature:
            raise ValueError(
                f"Replicas {what} with different structures: "
                f"replica 0: {signature}, replica {i}: {other_sig}"
            )
    flats = [nest.flatten(s) for s in per_replica]
    leaves = []
    for column in zip(*flats):
        container = _container_of_copies(column)
        if container is not None:
            leaves.append(container)
        elif not always_wrap and all(v is column[0] for v in column):
            leaves.append(column[0])
        else:
            leaves.append(wrap_class(column))
    return _pack(first, leaves)


def _pack(structure: Any, leaves: list) -> Any:
    """``nest.pack_sequence_as(structure, leaves)``, but a namedtuple is rebuilt with its ``_make``.

    As TF's regroup: a namedtuple subclass's own ``__new__`` is not called
    (``tf.nest`` calls it), so one that takes other arguments still regroups.
    """
    items = nest.children(structure) if nest.is_nested(structure) else ()
    nested_items = any(issubclass(t, (list, tuple, dict)) for t in set(map(type, items)))
    if not nested_items and not nest.is_namedtuple(structure):  # no namedtuple anywhere: nest rebuilds it alike
        return nest.pack_sequence_as(structure, leaves)
    it = iter(leaves)

    def build(x: Any) -> Any:
        if not nest.is_nested(x):
            return next(it)
        parts = [build(c) for c in nest.children(x)]
        return type(x)._make(parts) if nest.is_namedtuple(x) else nest.sequence_like(x, parts)

    return build(structure)


def _select(local_replica_id: int, structure: Any, keep_variables: bool) -> Any:
    def pick(v: Any) -> Any:
        if not isinstance(v, DistributedValues) or (keep_variables and getattr(v, "_is_variable", False)):
            return v
        return v._get_replica(local_replica_id)

    if not nest.is_nested(structure):
        return pick(structure)
    flat = nest.flatten(structure)
    if not any(isinstance(v, DistributedValues) for v in flat):
        return structure
    return nest.pack_sequence_as(structure, [pick(v) for v in flat])


def select_replica(local_replica_id: int, structure: Any) -> Any:
    """This replica's view of a structure, as tf.distribute's ``select_replica``.

    ``PerReplica``/``Mirrored`` leaves become their component; distributed
    variables are kept whole (inside the replica they read and write the
    replica's own copy, and a replica function updates them through their
    aggregation).
    """
    return _select(local_replica_id, structure, keep_variables=True)


def select_component(local_replica_id: int, structure: Any) -> Any:
    """Like :func:`select_replica`, but distributed variables become their local copy too."""
    return _select(local_replica_id, structure, keep_variables=False)


def contains_distributed(structure: Any) -> bool:
    """Whether any leaf is a DistributedValues (or distributed variable).

    Runs on every ``strategy.run``'s arguments: a walk that stops at the first
    one, in no particular order (dict keys are not sorted).
    """
    stack = [structure]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            x = tuple(x.values())
        elif not isinstance(x, (list, tuple)):
            if isinstance(x, DistributedValues):
                return True
            continue
        if len(x) <= 8:
            stack.extend(x)
            continue
        kinds = set(map(type, x))  # a long sequence: its distinct types, collected in C
        if any(issubclass(t, DistributedValues) for t in kinds):
            return True
        if any(issubclass(t, (list, tuple, dict)) for t in kinds):
            stack.extend(c for c in x if isinstance(c, (list, tuple, dict)))
    return False


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
