"""The saveable position of an input iterator (``tf.train.Checkpoint(iterator=...)``)."""

from __future__ import annotations

import abc
from typing import Any

from mpistrat.data.node import Node
from mpistrat.data.sources import GeneratorNode, ListFilesNode
from mpistrat.data.transformations import ShuffleNode

__all__ = ["SaveableIterator", "check_saveable", "random_state", "set_random_state"]


class SaveableIterator(abc.ABC):
    """An iterator whose position a Checkpoint saves and restores (collective on every rank)."""

    @abc.abstractmethod
    def _state(self) -> Any:
        """The position as a JSON-serialisable value (the same value on every rank)."""

    @abc.abstractmethod
    def _restore(self, state: Any) -> None:
        """Continue from ``state`` (a fresh iterator only)."""


def _walk(node: Node, out: list[Node]) -> list[Node]:
    out.append(node)
    for child in node.inputs:
        _walk(child, out)
    return out


def check_saveable(nodes: list[Node]) -> None:
    """Raise if a pipeline's state cannot be captured (a Python generator source), naming the step."""
    for root in nodes:
        for node in _walk(root, []):
            if isinstance(node, GeneratorNode):
                raise ValueError(
                    f"Cannot save the iterator: its pipeline reads {node.describe()} (Dataset.from_generator), "
                    "whose position in a Python generator cannot be captured (as TF's iterator checkpointing)")


def random_state(nodes: list[Node]) -> list[list[int]]:
    """(seed, epoch) of every shuffle and shuffled list_files, in walk order: what the next pass draws from."""
    return [[int(n.seed), int(n._epoch)] for root in nodes for n in _walk(root, [])
            if isinstance(n, ShuffleNode) or (isinstance(n, ListFilesNode) and n.shuffle)]


def set_random_state(nodes: list[Node], state: list[list[int]]) -> None:
    """Give the pipeline's random steps the seeds and epochs of ``random_state`` (the same pipeline)."""
    found = [n for root in nodes for n in _walk(root, [])
             if isinstance(n, ShuffleNode) or (isinstance(n, ListFilesNode) and n.shuffle)]
    if len(found) != len(state):
        raise ValueError(f"Cannot restore the iterator: the checkpoint has {len(state)} random step(s) "
                         f"(shuffle, list_files), this pipeline has {len(found)}")
    for node, (seed, epoch) in zip(found, state):
        node.seed, node._epoch = int(seed), int(epoch)
