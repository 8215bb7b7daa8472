"""Transformation nodes: the pipeline steps a ``Dataset`` method adds (map, batch, shuffle, ...)."""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import numpy as np

from mpistrat import nest
from mpistrat.data.element import normalize_element, stack_elements
from mpistrat.data.interleave import interleave
from mpistrat.data.node import Node
from mpistrat.data.prefetch import BackgroundProducer
from mpistrat.data.spec import TensorSpec, batched_spec, unbatched_spec

__all__ = [
    "AUTOTUNE",
    "call_with_element",
    "MapNode",
    "FilterNode",
    "BatchNode",
    "UnbatchNode",
    "ShuffleNode",
    "RepeatNode",
    "TakeNode",
    "SkipNode",
    "ShardNode",
    "InterleaveNode",
    "PrefetchNode",
    "CacheNode",
    "ZipNode",
    "EnumerateNode",
    "ConcatenateNode",
]

AUTOTUNE = -1


def _workers(n: Optional[int]) -> int:
    if n is None:
        return 0
    if n == AUTOTUNE:
        return os.cpu_count() or 1
    if n < 1:
        raise ValueError(f"num_parallel_calls must be a positive integer or AUTOTUNE (-1), got {n}")
    return int(n)


def call_with_element(fn: Callable, element: Any) -> Any:
    """Call ``fn`` as tf.data does: a tuple element is unpacked into positional arguments."""
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        return fn(*element)
    return fn(element)


class _Unary(Node):
    def __init__(self, input_node: Node):
        self.inputs = (input_node,)

    @property
    def input(self) -> Node:
        return self.inputs[0]

    def spec(self) -> Any:
        return self.input.spec()


class MapNode(_Unary):
    """``map(fn, num_parallel_calls)``: threads when parallel, output order kept."""

    def __init__(self, input_node: Node, fn: Callable, num_parallel_calls: Optional[int] = None):
        super().__init__(input_node)
        if not callable(fn):
            raise TypeError(f"map expects a callable, got {type(fn).__name__}")
        self.fn, self.workers = fn, _workers(num_parallel_calls)

    def _apply(self, element: Any) -> Any:
        return normalize_element(call_with_element(self.fn, element))

    def iterate(self) -> Iterator[Any]:
        if self.workers <= 1:
            return (self._apply(e) for e in self.input.iterate())
        return self._parallel()

    def _parallel(self) -> Iterator[Any]:
        window: collections.deque = collections.deque()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="mpistrat-map") as pool:
            try:
                for element in self.input.iterate():
                    window.append(pool.submit(self._apply, element))
                    if len(window) >= 2 * self.workers:
                        yield window.popleft().result()
                while window:
                    yield window.popleft().result()
            finally:
                for f in window:
                    f.cancel()

    def spec(self) -> Any:
        return Node.spec(self)


class FilterNode(_Unary):
    """``filter(predicate)``: keep elements for which the predicate is true."""

    def __init__(self, input_node: Node, predicate: Callable):
        super().__init__(input_node)
        self.predicate = predicate

    def iterate(self) -> Iterator[Any]:
        for element in self.input.iterate():
            keep = np.asarray(call_with_element(self.predicate, element))
            if keep.shape != () or keep.dtype != np.bool_:
                raise ValueError(
                    f"filter predicate must return a scalar boolean, got dtype {keep.dtype} and shape {keep.shape}"
                )
            if keep:
                yield element


class BatchNode(_Unary):
    """``batch(batch_size, drop_remainder)``: stacks elements; slices directly for array sources."""

    def __init__(self, input_node: Node, batch_size: int, drop_remainder: bool = False):
        super().__init__(input_node)
        batch_size = int(batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
        self.batch_size, self.drop_remainder = batch_size, bool(drop_remainder)

    def iterate(self) -> Iterator[Any]:
        fast = self.input.slice_batches(self.batch_size, self.drop_remainder)
        if fast is not None:
            return fast
        return self._stacked()

    def _stacked(self) -> Iterator[Any]:
        buf: list = []
        for element in self.input.iterate():
            buf.append(element)
            if len(buf) == self.batch_size:
                yield stack_elements(buf)
                buf = []
        if buf and not self.drop_remainder:
            yield stack_elements(buf)

    def spec(self) -> Any:
        return batched_spec(self.input.spec(), self.batch_size if self.drop_remainder else None)


class UnbatchNode(_Unary):
    """``unbatch()``: split every batch into its rows."""

    def iterate(self) -> Iterator[Any]:
        for batch in self.input.iterate():
            leaves = nest.flatten(batch)
            n = {len(x) for x in leaves}
            if len(n) != 1:
                raise ValueError(f"unbatch: components have different leading sizes {sorted(n)}")
            for i in range(n.pop()):
                yield nest.pack_sequence_as(batch, [x[i] for x in leaves])

    def spec(self) -> Any:
        return unbatched_spec(self.input.spec())


class ShuffleNode(_Unary):
    """``shuffle(buffer_size, seed, reshuffle_each_iteration)`` with tf.data's buffer algorithm."""

    def __init__(self, input_node: Node, buffer_size: int, seed: Optional[int] = None, reshuffle_each_iteration: Optional[bool] = None):
        super().__init__(input_node)
        if buffer_size == AUTOTUNE:
            buffer_size = 1 << 16
        if buffer_size < 1:
            raise ValueError(f"shuffle buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = int(buffer_size)
        self.reshuffle = True if reshuffle_each_iteration is None else bool(reshuffle_each_iteration)
        self.seed = int(np.random.SeedSequence().entropy % (1 << 62)) if seed is None else int(seed)
        self.seeded = seed is not None
        self._epoch = 0
        self._lock = threading.Lock()

    def _reset_state(self) -> None:
        self._epoch = 0
        self._lock = threading.Lock()

    def iterate(self) -> Iterator[Any]:
        with self._lock:
            epoch = self._epoch if self.reshuffle else 0
            self._epoch += 1
        rng = np.random.default_rng([self.seed, epoch])
        return self._shuffled(rng)

    def _shuffled(self, rng: np.random.Generator) -> Iterator[Any]:
        buf: list = []
        for element in self.input.iterate():
            if len(buf) < self.buffer_size:
                buf.append(element)
                continue
            i = int(rng.integers(len(buf)))
            out, buf[i] = buf[i], element
            yield out
        rng.shuffle(buf)
        yield from buf


class RepeatNode(_Unary):
    """``repeat(count)``: ``None`` or -1 repeats for ever."""

    def __init__(self, input_node: Node, count: Optional[int] = None):
        super().__init__(input_node)
        self.count = -1 if count is None else int(count)

    def iterate(self) -> Iterator[Any]:
        n = 0
        while self.count < 0 or n < self.count:
            empty = True
            for element in self.input.iterate():
                empty = False
                yield element
            if empty:
                return
            n += 1


class TakeNode(_Unary):
    """``take(count)``: the first ``count`` elements (-1: all)."""

    def __init__(self, input_node: Node, count: int):
        super().__init__(input_node)
        self.count = int(count)

    def iterate(self) -> Iterator[Any]:
        if self.count < 0:
            yield from self.input.iterate()
            return
        if self.count == 0:
            return
        for i, element in enumerate(self.input.iterate()):
            yield element
            if i + 1 >= self.count:
                return


class SkipNode(_Unary):
    """``skip(count)``: drop the first ``count`` elements (-1: all)."""

    def __init__(self, input_node: Node, count: int):
        super().__init__(input_node)
        self.count = int(count)

    def iterate(self) -> Iterator[Any]:
        for i, element in enumerate(self.input.iterate()):
            if self.count >= 0 and i >= self.count:
                yield element


class ShardNode(_Unary):
    """``shard(num_shards, index)``: every ``num_shards``-th element from ``index``."""

    def __init__(self, input_node: Node, num_shards: int, index: int):
        super().__init__(input_node)
        num_shards, index = int(num_shards), int(index)
        if num_shards < 1:
            raise ValueError(f"Number of shards must be >= 1, got {num_shards}")
        if not 0 <= index < num_shards:
            raise ValueError(f"Index must be between 0 and {num_shards - 1} (num_shards - 1), got {index}")
        self.num_shards, self.index = num_shards, index

    def iterate(self) -> Iterator[Any]:
        for i, element in enumerate(self.input.iterate()):
            if i % self.num_shards == self.index:
                yield element


class InterleaveNode(_Unary):
    """``interleave(fn, cycle_length, block_length)``: tf.data's deterministic cycle order."""

    def __init__(self, input_node: Node, fn: Callable, cycle_length: Optional[int] = None, block_length: Optional[int] = None):
        super().__init__(input_node)
        cycle = AUTOTUNE if cycle_length is None else int(cycle_length)
        self.cycle_length = (os.cpu_count() or 1) if cycle == AUTOTUNE else cycle
        self.block_length = 1 if block_length is None else int(block_length)
        if self.cycle_length < 1 or self.block_length < 1:
            raise ValueError(
                f"interleave needs cycle_length >= 1 and block_length >= 1, got {cycle_length}, {block_length}"
            )
        self.fn = fn

    def _open(self, element: Any) -> Iterator[Any]:
        result = call_with_element(self.fn, element)
        if not hasattr(result, "_node"):
            raise TypeError(f"The interleave/flat_map function must return a Dataset, got {type(result).__name__}")
        return result._node.iterate()

    def iterate(self) -> Iterator[Any]:
        return interleave(self.input.iterate(), self._open, self.cycle_length, self.block_length)

    def spec(self) -> Any:
        return Node.spec(self)


class PrefetchNode(_Unary):
    """``prefetch(buffer_size)``: a background thread keeps ``buffer_size`` elements ready."""

    def __init__(self, input_node: Node, buffer_size: int):
        super().__init__(input_node)
        buffer_size = int(buffer_size)
        if buffer_size == AUTOTUNE:
            buffer_size = 2
        if buffer_size < 0:
            raise ValueError(f"prefetch buffer_size must be >= 0 or AUTOTUNE, got {buffer_size}")
        self.buffer_size = buffer_size

    def iterate(self) -> Iterator[Any]:
        if self.buffer_size == 0:
            return self.input.iterate()
        return _ClosingIterator(BackgroundProducer(self.input.iterate, self.buffer_size, "mpistrat-dataset-prefetch"))


class _ClosingIterator:
    """Wraps a BackgroundProducer so that ``close()`` (as on a generator) stops its thread."""

    def __init__(self, producer: BackgroundProducer):
        self._producer = producer

    def __iter__(self) -> "_ClosingIterator":
        return self

    def __next__(self) -> Any:
        return next(self._producer)

    def close(self) -> None:
        self._producer.close()

    def __del__(self) -> None:
        self._producer.close(timeout=0)


class CacheNode(_Unary):
    """``cache()``: the first complete pass is kept in memory and replayed afterwards."""

    def __init__(self, input_node: Node):
        super().__init__(input_node)
        self._cache: Optional[list] = None
        self._lock = threading.Lock()

    def _reset_state(self) -> None:
        self._cache = None
        self._lock = threading.Lock()

    def iterate(self) -> Iterator[Any]:
        with self._lock:
            cached = self._cache
        if cached is not None:
            return iter(cached)
        return self._fill()

    def _fill(self) -> Iterator[Any]:
        items = []
        for element in self.input.iterate():
            items.append(element)
            yield element
        with self._lock:
            if self._cache is None:
                self._cache = items


class ZipNode(Node):
    """``Dataset.zip(datasets)``: a structure of datasets -> elements of that structure; stops at the shortest."""

    def __init__(self, structure: Any, nodes: list):
        self.structure, self.inputs = structure, tuple(nodes)

    def iterate(self) -> Iterator[Any]:
        iters = [n.iterate() for n in self.inputs]
        while True:
            items = []
            for it in iters:
                try:
                    items.append(next(it))
                except StopIteration:
                    return
            yield nest.pack_sequence_as(self.structure, items)

    def spec(self) -> Any:
        return nest.pack_sequence_as(self.structure, [n.spec() for n in self.inputs])


class EnumerateNode(_Unary):
    """``enumerate(start)``: ``(int64 index, element)`` pairs."""

    def __init__(self, input_node: Node, start: int = 0):
        super().__init__(input_node)
        self.start = int(start)

    def iterate(self) -> Iterator[Any]:
        for i, element in enumerate(self.input.iterate(), self.start):
            yield (np.int64(i), element)

    def spec(self) -> Any:
        return (TensorSpec((), np.dtype(np.int64)), self.input.spec())


class ConcatenateNode(Node):
    """``concatenate(other)``: the elements of one dataset, then the other's."""

    def __init__(self, first: Node, second: Node):
        self.inputs = (first, second)

    def iterate(self) -> Iterator[Any]:
        for n in self.inputs:
            yield from n.iterate()

    def spec(self) -> Any:
        return self.inputs[0].spec()
