"""``Dataset``: the public, tf.data-like face of a lazy pipeline of nodes.

Iteration is repeatable: every ``iter(dataset)`` starts a new pass. Elements are
nests (tuples, dicts) of NumPy arrays, NumPy scalars and ``bytes``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from mpistrat import nest
from mpistrat.data.element import normalize_element
from mpistrat.data.node import Node
from mpistrat.data.options import Options
from mpistrat.data.spec import TensorSpec
from mpistrat.data.sources import GeneratorNode, ListFilesNode, NpyNode, RangeNode, TensorSlicesNode, TextLineNode, TFRecordNode
from mpistrat.data.transformations import (
    AUTOTUNE,
    BatchNode,
    CacheNode,
    ConcatenateNode,
    EnumerateNode,
    FilterNode,
    InterleaveNode,
    MapNode,
    PrefetchNode,
    RepeatNode,
    ShardNode,
    ShuffleNode,
    SkipNode,
    TakeNode,
    UnbatchNode,
    ZipNode,
)

__all__ = ["Dataset", "TFRecordDataset", "TextLineDataset", "NpyDataset", "AUTOTUNE"]


class Dataset:
    """A lazy, repeatable pipeline of elements, as ``tf.data.Dataset``."""

    def __init__(self, node: Node, options: Optional[Options] = None):
        self._node = node
        self._options = options if options is not None else Options()

    # -- iteration and description -------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._node.iterate()

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements as NumPy values (they already are): ``iter(self)``."""
        return iter(self)

    @property
    def element_spec(self) -> Any:
        """The nest of TensorSpecs of one element."""
        return self._node.spec()

    def options(self) -> Options:
        """The options of this dataset (merged from its inputs and ``with_options``)."""
        return self._options

    def with_options(self, options: Options) -> "Dataset":
        """A dataset with ``options`` merged over the current ones."""
        return Dataset(self._node, self._options.merge(options))

    def reduce(self, initial_state: Any, reduce_func: Callable[[Any, Any], Any]) -> Any:
        """Fold ``reduce_func(state, element)`` over all elements."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._node.describe()}>"

    def _derive(self, node: Node) -> "Dataset":
        return Dataset(node, self._options)

    # -- sources -------------------------------------------------------------------
    @staticmethod
    def range(*args: int, dtype: Any = None) -> "Dataset":
        """``range(stop)``, ``range(start, stop)`` or ``range(start, stop, step)`` of int64 scalars."""
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 positional arguments, got {len(args)}")
        start, stop, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) == 3 else 1)
        return Dataset(RangeNode(start, stop, step, np.int64 if dtype is None else dtype))

    @staticmethod
    def from_tensor_slices(tensors: Any) -> "Dataset":
        """Slices of arrays (or tuples/dicts of arrays) along their first axis."""
        return Dataset(TensorSlicesNode(tensors))

    @staticmethod
    def from_tensors(tensors: Any) -> "Dataset":
        """A dataset of one element, ``tensors`` itself."""
        def one_row(x: Any) -> np.ndarray:
            if isinstance(x, (bytes, str)):
                row = np.empty(1, dtype=object)
                row[0] = x
                return row
            return np.asarray(x)[None]

        # lists are tensors (as in tf.data), so normalise before adding the one-element axis
        return Dataset(TensorSlicesNode(nest.map_structure(one_row, normalize_element(tensors))))

    @staticmethod
    def from_generator(generator: Callable, output_types: Any = None, output_shapes: Any = None,
                       args: Sequence = (), output_signature: Any = None) -> "Dataset":
        """Elements from ``generator(*args)``, called anew each pass; ``output_signature`` checks and casts."""
        if output_signature is None and output_types is not None:
            shapes = output_shapes if output_shapes is not None else nest.map_structure(lambda _: None, output_types)
            output_signature = nest.map_structure(
                lambda t, s: TensorSpec(tuple(s) if s is not None else (), t), output_types, shapes
            )
        return Dataset(GeneratorNode(generator, output_signature, args))

    @staticmethod
    def list_files(file_pattern: Any, shuffle: Optional[bool] = None, seed: Optional[int] = None) -> "Dataset":
        """File names matching the glob pattern(s), shuffled each pass unless ``shuffle=False``."""
        return Dataset(ListFilesNode(file_pattern, shuffle, seed))

    @staticmethod
    def zip(*args: Any, datasets: Any = None) -> "Dataset":
        """Elements of a structure (tuple or dict) of datasets, zipped: ``zip((a, b))`` or ``zip(a, b)``."""
        if args and datasets is not None:
            raise TypeError("Dataset.zip takes the datasets either positionally or as `datasets=`, not both")
        if datasets is None:
            datasets = args[0] if len(args) == 1 else tuple(args)
        leaves = nest.flatten(datasets)
        if not leaves or not all(isinstance(d, Dataset) for d in leaves):
            raise TypeError("Dataset.zip expects a (nested) tuple or dict of Datasets")
        options = Options()
        for d in leaves:
            options = options.merge(d.options())
        return Dataset(ZipNode(datasets, [d._node for d in leaves]), options)

    # -- transformations -----------------------------------------------------------
    def map(self, map_func: Callable, num_parallel_calls: Optional[int] = None, deterministic: Optional[bool] = None) -> "Dataset":
        """Apply ``map_func`` to each element (in threads when ``num_parallel_calls`` > 1; order kept)."""
        return self._derive(MapNode(self._node, map_func, num_parallel_calls))

    def filter(self, predicate: Callable) -> "Dataset":
        """Keep the elements for which ``predicate`` returns True."""
        return self._derive(FilterNode(self._node, predicate))

    def batch(self, batch_size: int, drop_remainder: bool = False, num_parallel_calls: Optional[int] = None,
              deterministic: Optional[bool] = None) -> "Dataset":
        """Stack consecutive elements into batches of ``batch_size``."""
        return self._derive(BatchNode(self._node, batch_size, drop_remainder))

    def unbatch(self) -> "Dataset":
        """Split batches back into elements."""
        return self._derive(UnbatchNode(self._node))

    def shuffle(self, buffer_size: int, seed: Optional[int] = None, reshuffle_each_iteration: Optional[bool] = None) -> "Dataset":
        """Randomly shuffle with a buffer of ``buffer_size`` elements."""
        return self._derive(ShuffleNode(self._node, buffer_size, seed, reshuffle_each_iteration))

    def repeat(self, count: Optional[int] = None) -> "Dataset":
        """Repeat ``count`` times (for ever when None or -1)."""
        return self._derive(RepeatNode(self._node, count))

    def take(self, count: int) -> "Dataset":
        """The first ``count`` elements."""
        return self._derive(TakeNode(self._node, count))

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements."""
        return self._derive(SkipNode(self._node, count))

    def shard(self, num_shards: int, index: int) -> "Dataset":
        """Every ``num_shards``-th element, starting at ``index``."""
        return self._derive(ShardNode(self._node, num_shards, index))

    def interleave(self, map_func: Callable, cycle_length: Optional[int] = None, block_length: Optional[int] = None,
                   num_parallel_calls: Optional[int] = None, deterministic: Optional[bool] = None) -> "Dataset":
        """Map each element to a dataset and interleave them ``cycle_length`` at a time."""
        return self._derive(InterleaveNode(self._node, map_func, cycle_length, block_length))

    def flat_map(self, map_func: Callable) -> "Dataset":
        """Map each element to a dataset and concatenate them."""
        return self._derive(InterleaveNode(self._node, map_func, 1, 1))

    def prefetch(self, buffer_size: int) -> "Dataset":
        """Prepare up to ``buffer_size`` elements ahead in a background thread."""
        return self._derive(PrefetchNode(self._node, buffer_size))

    def cache(self, filename: str = "") -> "Dataset":
        """Keep the elements in memory after the first complete pass."""
        if filename:
            raise NotImplementedError("cache(filename) to a file is not supported; use cache() (in memory)")
        return self._derive(CacheNode(self._node))

    def enumerate(self, start: int = 0) -> "Dataset":
        """``(index, element)`` pairs."""
        return self._derive(EnumerateNode(self._node, start))

    def concatenate(self, dataset: "Dataset") -> "Dataset":
        """This dataset's elements followed by ``dataset``'s."""
        return Dataset(ConcatenateNode(self._node, dataset._node), self._options.merge(dataset.options()))


class TFRecordDataset(Dataset):
    """Records (bytes) of TFRecord files, as ``tf.data.TFRecordDataset``."""

    def __init__(self, filenames: Any, compression_type: Optional[str] = None, buffer_size: Optional[int] = None,
                 num_parallel_reads: Optional[int] = None):
        super().__init__(TFRecordNode(filenames, compression_type, num_parallel_reads))


class TextLineDataset(Dataset):
    """Lines (bytes, without line endings) of text files, as ``tf.data.TextLineDataset``."""

    def __init__(self, filenames: Any, compression_type: Optional[str] = None, buffer_size: Optional[int] = None,
                 num_parallel_reads: Optional[int] = None):
        super().__init__(TextLineNode(filenames, compression_type))


class NpyDataset(Dataset):
    """Rows (first axis) of memory-mapped ``.npy`` shard files; ``.batch`` slices without copying rows one by one."""

    def __init__(self, filenames: Any):
        super().__init__(NpyNode(filenames))


