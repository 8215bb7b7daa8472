"""Nested structures (lists, tuples, namedtuples, dicts) of leaves, as ``tf.nest``.

Dicts are traversed in sorted key order, so two ranks flatten equal
structures identically. Anything else (arrays, scalars, DistributedValues,
None) is a leaf.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

__all__ = ["is_nested", "is_namedtuple", "children", "sequence_like", "flatten", "pack_sequence_as", "map_structure",
           "assert_same_structure", "structure_signature"]


def is_namedtuple(x: Any) -> bool:
    """Whether ``x`` is a namedtuple (a tuple with ``_fields``)."""
    return isinstance(x, tuple) and hasattr(x, "_fields")


def is_nested(x: Any) -> bool:
    """Whether ``x`` is a list, tuple or dict (a structure, not a leaf)."""
    return isinstance(x, (list, tuple, dict))


def children(x: Any) -> list:
    """The items of the structure ``x`` in :func:`flatten`'s order (a dict's values by sorted key)."""
    if isinstance(x, dict):
        return [x[k] for k in _sorted_keys(x)]
    return list(x)


def _sorted_keys(d: dict) -> list:
    """A dict's keys in the order its values flatten: sorted, as TF's nest (which refuses unsortable keys:
    sorting by repr would order objects by their memory address, differently on every rank)."""
    try:
        return sorted(d)
    except TypeError:
        raise TypeError(f"nest only supports dicts with sortable keys; got keys {list(d)!r}") from None


_NESTED = (list, tuple, dict)


def _flat_sequence(x: Any) -> bool:
    """A plain list or tuple whose items are all leaves (the common case, handled without a walk)."""
    if type(x) is not list and type(x) is not tuple:
        return False
    # The items' distinct types, collected in C: a list of 100 arrays is one type to check.
    return not any(issubclass(t, _NESTED) for t in set(map(type, x)))


def flatten(structure: Any) -> list:
    """The leaves of ``structure`` in a deterministic order."""
    if not isinstance(structure, (list, tuple, dict)):
        return [structure]
    if _flat_sequence(structure):
        return list(structure)
    out: list = []
    stack = [structure]
    # Iterative depth-first walk keeping left-to-right order.
    while stack:
        x = stack.pop()
        if is_nested(x):
            stack.extend(reversed(children(x)))
        else:
            out.append(x)
    return out


def sequence_like(template: Any, items: list) -> Any:
    """A structure of ``template``'s type holding ``items`` (in :func:`children`'s order), as tf.nest rebuilds one.

    A namedtuple is made by calling its type, so a subclass's own ``__new__`` runs (as ``tf.nest``).
    """
    if isinstance(template, dict):
        built = dict(zip(_sorted_keys(template), items))
        kind = type(template)
        if kind is dict:
            return {k: built[k] for k in template}
        # As tf.nest: an empty instance of the same type (a defaultdict keeps its factory), filled key by key.
        out = kind(template.default_factory) if isinstance(template, collections.defaultdict) else kind()
        for k in template:
            out[k] = built[k]
        return out
    if is_namedtuple(template):
        return type(template)(*items)
    if isinstance(template, tuple):
        return tuple(items)
    return list(items)


def pack_sequence_as(structure: Any, flat: list) -> Any:
    """Inverse of :func:`flatten`: put ``flat`` leaves back into ``structure``'s shape."""
    if not isinstance(structure, (list, tuple, dict)) and len(flat) == 1:
        return flat[0]
    if _flat_sequence(structure):
        if len(flat) > len(structure):
            raise ValueError(f"pack_sequence_as: {len(flat) - len(structure)} more leaves than the structure holds")
        if len(flat) < len(structure):
            raise ValueError(f"pack_sequence_as: the structure holds {len(structure)} leaves, got only {len(flat)}")
        return list(flat) if type(structure) is list else tuple(flat)
    it = iter(flat)

    def build(x: Any) -> Any:
        if is_nested(x):
            return sequence_like(x, [build(c) for c in children(x)])
        return next(it)

    result = build(structure)
    leftover = sum(1 for _ in it)
    if leftover:
        raise ValueError(f"pack_sequence_as: {leftover} more leaves than the structure holds")
    return result


def structure_signature(structure: Any) -> str:
    """A short text describing the nesting (not the leaves), for comparisons and errors."""
    if isinstance(structure, dict):
        return "{" + ",".join(f"{k!r}:{structure_signature(structure[k])}" for k in _sorted_keys(structure)) + "}"
    if is_namedtuple(structure):
        return type(structure).__name__ + "(" + ",".join(structure_signature(c) for c in structure) + ")"
    if isinstance(structure, tuple):
        return "(" + ",".join(structure_signature(c) for c in structure) + ")"
    if isinstance(structure, list):
        return "[" + ",".join(structure_signature(c) for c in structure) + "]"
    return "."


def assert_same_structure(a: Any, b: Any) -> None:
    """Raise ValueError naming both structures if their nesting differs."""
    sa, sb = structure_signature(a), structure_signature(b)
    if sa != sb:
        raise ValueError(f"The two structures don't have the same nested structure: {sa} vs {sb}")


def map_structure(fn: Callable, *structures: Any) -> Any:
    """Apply ``fn`` leaf-wise across structures of the same shape."""
    if not structures:
        raise ValueError("map_structure needs at least one structure")
    for s in structures[1:]:
        assert_same_structure(structures[0], s)
    flats = [flatten(s) for s in structures]
    return pack_sequence_as(structures[0], [fn(*leaves) for leaves in zip(*flats)])
