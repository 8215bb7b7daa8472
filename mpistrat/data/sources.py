"""Source nodes: where a pipeline's elements come from (ranges, arrays, generators, files)."""

from __future__ import annotations

import glob
import gzip
import io
import itertools
import os
import zlib
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from mpistrat import nest
from mpistrat.data.element import normalize_element
from mpistrat.data.errors import DataLossError, rank_label
from mpistrat.data.interleave import interleave
from mpistrat.data.node import Node
from mpistrat.data.npy import open_npy
from mpistrat.data.spec import TensorSpec
from mpistrat.data.tfrecord import normalize_compression, tf_record_iterator

__all__ = [
    "RangeNode",
    "TensorSlicesNode",
    "GeneratorNode",
    "ListFilesNode",
    "FileSourceNode",
    "TFRecordNode",
    "TextLineNode",
    "NpyNode",
    "normalize_filenames",
]


class RangeNode(Node):
    """``Dataset.range(start, stop, step)``: int64 scalars."""

    def __init__(self, start: int, stop: int, step: int, dtype: Any = np.int64):
        if step == 0:
            raise ValueError("Dataset.range: step must not be zero")
        self.start, self.stop, self.step, self.dtype = int(start), int(stop), int(step), np.dtype(dtype)

    def iterate(self) -> Iterator[Any]:
        t = self.dtype.type
        return (t(i) for i in range(self.start, self.stop, self.step))

    def spec(self) -> Any:
        return TensorSpec((), self.dtype)

    def slice_batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
        values = np.arange(self.start, self.stop, self.step, dtype=self.dtype)
        return _slice_rows({"v": values}, len(values), batch_size, drop_remainder, unwrap="v")


def _slice_rows(arrays: Any, n: int, batch_size: int, drop_remainder: bool, unwrap: Optional[str] = None):
    stop = n - n % batch_size if drop_remainder else n
    for start in range(0, stop, batch_size):
        batch = nest.map_structure(lambda a: np.array(a[start:start + batch_size]), arrays)
        yield batch[unwrap] if unwrap else batch


class TensorSlicesNode(Node):
    """``Dataset.from_tensor_slices(tensors)``: slices along the first axis of every leaf."""

    def __init__(self, tensors: Any):
        tensors = normalize_element(tensors)
        leaves = nest.flatten(tensors)
        if not leaves:
            raise ValueError("from_tensor_slices needs at least one tensor")
        arrays = []
        for leaf in leaves:
            arr = np.asarray(leaf) if not isinstance(leaf, (bytes, str)) else np.asarray(leaf, dtype=object)
            if arr.ndim == 0:
                raise ValueError(
                    f"from_tensor_slices: every component needs rank >= 1 to be sliced, got a scalar {leaf!r}"
                )
            if arr.dtype.kind in "SU":
                arr = arr.astype(object)
            arrays.append(arr)
        n = arrays[0].shape[0]
        for arr in arrays[1:]:
            if arr.shape[0] != n:
                raise ValueError(f"Dimensions {n} and {arr.shape[0]} are not compatible (first axis of every component)")
        self.tensors = nest.pack_sequence_as(tensors, arrays)
        self.length = int(n)

    def iterate(self) -> Iterator[Any]:
        leaves = nest.flatten(self.tensors)
        for i in range(self.length):
            yield nest.pack_sequence_as(self.tensors, [a[i] for a in leaves])

    def spec(self) -> Any:
        return nest.map_structure(lambda a: TensorSpec(tuple(a.shape[1:]), a.dtype), self.tensors)

    def slice_batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
        return _slice_rows(self.tensors, self.length, batch_size, drop_remainder)


class GeneratorNode(Node):
    """``Dataset.from_generator(generator, output_signature)``: a new generator each pass."""

    def __init__(self, generator: Callable, output_signature: Any = None, args: Sequence = ()):
        if not callable(generator):
            raise TypeError("from_generator: `generator` must be a callable returning an iterator")
        self.generator, self.output_signature, self.args = generator, output_signature, tuple(args)

    def _convert(self, element: Any) -> Any:
        element = normalize_element(element)
        if self.output_signature is None:
            return element
        try:
            nest.assert_same_structure(self.output_signature, element)
        except ValueError:
            raise TypeError(
                f"`generator` yielded an element that did not match the expected structure: expected "
                f"{nest.structure_signature(self.output_signature)}, got {nest.structure_signature(element)}"
            ) from None

        def conv(spec: TensorSpec, x: Any) -> Any:
            if np.dtype(spec.dtype) == object:
                return x
            arr = np.asarray(x, dtype=spec.dtype)
            if not spec.is_compatible_with(arr):
                raise TypeError(
                    f"`generator` yielded an element of shape {arr.shape} where an element of shape "
                    f"{spec.shape} was expected."
                )
            return arr

        return nest.map_structure(conv, self.output_signature, element)

    def iterate(self) -> Iterator[Any]:
        for element in self.generator(*self.args):
            yield self._convert(element)

    def spec(self) -> Any:
        return self.output_signature if self.output_signature is not None else super().spec()


def normalize_filenames(filenames: Any, what: str) -> list:
    """A list of str paths from a path, a list of paths, or an array of them."""
    if isinstance(filenames, (str, bytes, os.PathLike)):
        filenames = [filenames]
    if not isinstance(filenames, list):
        filenames = np.asarray(filenames, dtype=object).reshape(-1).tolist()
    out = [f.decode("utf-8") if isinstance(f, bytes) else os.fspath(f) for f in filenames]
    if not out:
        raise ValueError(f"{what}: no filenames given")
    return out


class FileSourceNode(Node):
    """A source reading a static list of files; auto-sharding (FILE) rebuilds it with a subset."""

    files: list

    def with_files(self, files: Sequence[str]) -> "FileSourceNode":
        """A copy reading only ``files``."""
        clone = self.with_inputs(())
        clone.files = list(files)
        return clone

    def describe(self) -> str:
        return f"{super().describe()}({len(self.files)} files)"


class ListFilesNode(FileSourceNode):
    """``Dataset.list_files(pattern, shuffle, seed)``: matching file names (str), sorted or shuffled per pass."""

    def __init__(self, patterns: Any, shuffle: Optional[bool] = None, seed: Optional[int] = None):
        patterns = normalize_filenames(patterns, "list_files")
        files = sorted({f for p in patterns for f in glob.glob(p)})
        if not files:
            raise FileNotFoundError(f"{rank_label()}: No files matched pattern: {', '.join(patterns)}")
        self.files = files
        self.shuffle = True if shuffle is None else bool(shuffle)
        self.seed = None if seed is None else int(seed)
        self.seeded = seed is not None
        if self.shuffle and self.seed is None:
            self.seed = int(np.random.SeedSequence().entropy % (1 << 62))
        self._epoch = 0

    def _reset_state(self) -> None:
        self._epoch = 0

    def iterate(self) -> Iterator[Any]:
        files = list(self.files)
        if self.shuffle:
            np.random.default_rng([self.seed, self._epoch]).shuffle(files)
            self._epoch += 1
        return iter(files)

    def spec(self) -> Any:
        return TensorSpec((), np.dtype(object))


class TFRecordNode(FileSourceNode):
    """``TFRecordDataset(filenames, compression_type, num_parallel_reads)``: raw records (bytes)."""

    def __init__(self, filenames: Any, compression_type: Optional[str] = None, num_parallel_reads: Optional[int] = None):
        self.files = normalize_filenames(filenames, "TFRecordDataset")
        self.compression_type = normalize_compression(compression_type)
        self.num_parallel_reads = num_parallel_reads

    def iterate(self) -> Iterator[Any]:
        cycle = self.num_parallel_reads
        if not cycle or cycle == 1:
            return (r for f in self.files for r in tf_record_iterator(f, self.compression_type))
        # tf.data reads num_parallel_reads files at a time in interleave order (block length 1)
        cycle = cycle if cycle > 0 else os.cpu_count() or 1
        return interleave(iter(self.files), lambda f: tf_record_iterator(f, self.compression_type), cycle, 1)

    def spec(self) -> Any:
        return TensorSpec((), np.dtype(object))

    def slice_batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
        return _record_batches(self.iterate(), batch_size, drop_remainder)


def _record_batches(records: Iterator[bytes], batch_size: int, drop_remainder: bool) -> Iterator[np.ndarray]:
    """Batches of records as object arrays, straight from the reader."""
    while True:
        chunk = list(itertools.islice(records, batch_size))
        if not chunk or (drop_remainder and len(chunk) < batch_size):
            return
        out = np.empty(len(chunk), dtype=object)
        out[:] = chunk
        yield out


def _open_text(path: str, compression_type: str):
    try:
        if compression_type == "GZIP":
            return gzip.open(path, "rb")
        if compression_type == "ZLIB":
            with open(path, "rb") as f:
                return io.BytesIO(zlib.decompress(f.read()))
        return open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{rank_label()}: text file {path!r} not found (byte offset 0)") from None
    except zlib.error as exc:
        raise DataLossError(f"{rank_label()}: corrupt ZLIB text file {path!r} (byte offset 0): {exc}") from None


class TextLineNode(FileSourceNode):
    """``TextLineDataset(filenames, compression_type)``: lines as bytes without the line ending."""

    def __init__(self, filenames: Any, compression_type: Optional[str] = None):
        self.files = normalize_filenames(filenames, "TextLineDataset")
        self.compression_type = normalize_compression(compression_type)

    def iterate(self) -> Iterator[Any]:
        for path in self.files:
            with _open_text(path, self.compression_type) as f:
                for line in f:  # as TensorFlow: one trailing "\n", then one "\r" (also on a last line without "\n")
                    if line.endswith(b"\n"):
                        line = line[:-1]
                    if line.endswith(b"\r"):
                        line = line[:-1]
                    yield line

    def spec(self) -> Any:
        return TensorSpec((), np.dtype(object))


class NpyNode(FileSourceNode):
    """Memory-mapped ``.npy`` shards: the rows (first axis) of every file in order; fast batching by slicing."""

    def __init__(self, filenames: Any):
        self.files = normalize_filenames(filenames, "NpyDataset")

    def iterate(self) -> Iterator[Any]:
        for path in self.files:
            arr = open_npy(path)
            for i in range(arr.shape[0]):
                yield np.array(arr[i]) if arr.ndim > 1 else arr.dtype.type(arr[i])

    def spec(self) -> Any:
        arr = open_npy(self.files[0])
        return TensorSpec(tuple(arr.shape[1:]), arr.dtype)

    def slice_batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
        return self._batches(batch_size, drop_remainder)

    def _batches(self, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
        carry: list = []  # pieces of a batch that spans files
        have = 0
        first_shape = None
        for path in self.files:
            arr = open_npy(path).view(np.ndarray)  # slices of a plain view skip np.memmap's per-slice bookkeeping
            if first_shape is None:
                first_shape = (arr.shape[1:], arr.dtype)
            elif (arr.shape[1:], arr.dtype) != first_shape:
                raise DataLossError(
                    f"{rank_label()}: .npy shard {path!r} holds rows of shape {arr.shape[1:]} and dtype {arr.dtype} "
                    f"(byte offset 0) but earlier shards hold {first_shape[0]} {first_shape[1]}"
                )
            n, pos = arr.shape[0], 0
            if carry:
                take = min(batch_size - have, n)
                carry.append(arr[:take])
                have += take
                pos = take
                if have == batch_size:
                    yield np.concatenate(carry)
                    carry, have = [], 0
            while n - pos >= batch_size:
                yield np.array(arr[pos:pos + batch_size])
                pos += batch_size
            if pos < n:
                carry, have = [arr[pos:]], n - pos
        if carry and not drop_remainder:
            yield np.concatenate(carry)


