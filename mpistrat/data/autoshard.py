"""Auto-sharding: which part of a pipeline's input each worker reads, by ``AutoShardPolicy``.

FILE gives worker w the files ``files[w::W]`` of the one file-based source at the
root of the pipeline (ListFiles shards its sorted list before shuffling, so
workers never overlap); fewer files than workers is an error naming both counts.
AUTO uses FILE when that works and otherwise DATA, warning once on rank 0.
For DATA, unseeded random transformations get seeds agreed from rank 0 so that
every worker walks the same global order.
"""

from __future__ import annotations

from typing import Callable

from mpistrat import logs
from mpistrat.data.dataset import Dataset
from mpistrat.data.node import Node
from mpistrat.data.options import AutoShardPolicy
from mpistrat.data.sources import FileSourceNode, ListFilesNode
from mpistrat.data.transformations import ShuffleNode

__all__ = ["FILE", "DATA", "OFF", "file_sources", "shard_by_file", "resolve_policy", "with_seeds", "needs_seeds", "logger"]

FILE, DATA, OFF = "FILE", "DATA", "OFF"
logger = logs.get_logger("mpistrat.data")


def file_sources(node: Node, path: tuple = ()) -> list:
    """Paths (tuples of input indices from ``node``) to every file-based source under ``node``."""
    if isinstance(node, FileSourceNode):
        return [path]
    found = []
    for i, child in enumerate(node.inputs):
        found.extend(file_sources(child, path + (i,)))
    return found


def _rebuild(node: Node, path: tuple, replace: Callable[[Node], Node]) -> Node:
    if not path:
        return replace(node)
    i = path[0]
    inputs = list(node.inputs)
    inputs[i] = _rebuild(inputs[i], path[1:], replace)
    return node.with_inputs(inputs)


def _get(node: Node, path: tuple) -> Node:
    for i in path:
        node = node.inputs[i]
    return node


def shard_by_file(dataset: Dataset, num_workers: int, index: int) -> Dataset:
    """The dataset reading only worker ``index``'s files (``files[index::num_workers]``)."""
    paths = file_sources(dataset._node)
    if not paths:
        raise ValueError(
            "AutoShardPolicy.FILE: the dataset has no file-based source (TFRecordDataset, TextLineDataset, "
            "NpyDataset or list_files) to shard; use AutoShardPolicy.DATA or OFF"
        )
    if len(paths) > 1:
        raise ValueError(
            f"AutoShardPolicy.FILE: the dataset has {len(paths)} file-based sources; FILE sharding needs exactly "
            "one (use AutoShardPolicy.DATA)"
        )
    source = _get(dataset._node, paths[0])
    files = list(source.files)
    if len(files) < num_workers:
        raise ValueError(
            f"AutoShardPolicy.FILE: there are {len(files)} input files but {num_workers} workers; every worker needs "
            "at least one file. Use more files, or set "
            "options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA (or OFF)"
        )
    mine = files[index::num_workers]
    node = _rebuild(dataset._node, paths[0], lambda src: src.with_files(mine))
    return Dataset(node, dataset.options())


def resolve_policy(dataset: Dataset, num_workers: int, index: int, *, warn: bool) -> "tuple[Dataset, str]":
    """(the dataset this worker reads, "FILE" | "DATA" | "OFF") for the dataset's policy."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if num_workers == 1:
        return dataset, OFF if policy == AutoShardPolicy.OFF else FILE
    if policy == AutoShardPolicy.OFF:
        return dataset, OFF
    if policy == AutoShardPolicy.DATA:
        return dataset, DATA
    if policy == AutoShardPolicy.FILE:
        return shard_by_file(dataset, num_workers, index), FILE
    try:  # AUTO (and HINT, which acts as AUTO)
        return shard_by_file(dataset, num_workers, index), FILE
    except ValueError as exc:
        if warn:
            logger.warning(
                "AUTO sharding policy will apply DATA sharding policy as it failed to apply FILE sharding "
                "policy because of the following reason: %s",
                exc,
            )
        return dataset, DATA


def _unseeded(node: Node) -> bool:
    if isinstance(node, ShuffleNode):
        return not node.seeded
    if isinstance(node, ListFilesNode):
        return node.shuffle and not getattr(node, "seeded", False)
    return False


def with_seeds(dataset: Dataset, base_seed: int) -> Dataset:
    """Give every unseeded shuffle / list_files a seed derived from ``base_seed`` (same on all ranks)."""
    counter = [0]

    def walk(node: Node) -> Node:
        inputs = [walk(child) for child in node.inputs]
        changed = any(a is not b for a, b in zip(inputs, node.inputs))
        if _unseeded(node):
            clone = node.with_inputs(inputs)
            clone.seed = int(base_seed) + 1000003 * counter[0]
            clone.seeded = True
            counter[0] += 1
            return clone
        return node.with_inputs(inputs) if changed else node

    return Dataset(walk(dataset._node), dataset.options())


def needs_seeds(dataset: Dataset) -> bool:
    """Whether the pipeline has an unseeded random step."""

    def walk(node: Node) -> bool:
        return _unseeded(node) or any(walk(c) for c in node.inputs)

    return walk(dataset._node)


