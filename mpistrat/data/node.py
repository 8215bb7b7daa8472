"""Pipeline nodes: the lazy graph behind a Dataset.

A node knows its inputs, makes a fresh Python iterator per pass (``iterate``),
describes its elements (``spec``) and can be copied with new inputs
(``with_inputs``), which is how auto-sharding rebuilds a pipeline around a
file source. Nodes know nothing of the public ``Dataset`` class.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Optional, Sequence

from mpistrat.data.spec import spec_of

__all__ = ["Node"]


class Node:
    """One step of a lazy pipeline."""

    inputs: tuple = ()

    def iterate(self) -> Iterator[Any]:
        """A fresh iterator over this node's elements."""
        raise NotImplementedError

    def spec(self) -> Any:
        """The nest of TensorSpecs of an element (default: look at the first element)."""
        it = self.iterate()
        try:
            first = next(it)
        except StopIteration:
            raise ValueError(
                f"Cannot infer the element_spec of an empty {type(self).__name__} dataset"
            ) from None
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        return spec_of(first)

    def slice_batches(self, batch_size: int, drop_remainder: bool) -> Optional[Iterator[Any]]:
        """Fast batching by slicing, for sources that hold arrays; None when not supported."""
        return None

    def with_inputs(self, inputs: Sequence["Node"]) -> "Node":
        """A shallow copy of this node reading from ``inputs``."""
        clone = copy.copy(self)
        clone.inputs = tuple(inputs)
        clone._reset_state()
        return clone

    def _reset_state(self) -> None:
        """Forget per-pass state kept across passes (caches, epoch counters) in a copy."""

    def describe(self) -> str:
        """A one-line description for error messages."""
        return type(self).__name__.replace("Node", "")
