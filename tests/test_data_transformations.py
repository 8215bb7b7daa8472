"""Dataset transformations against hand-computed results."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import mpistrat.data as D
from mpistrat.data import Options, TensorSpec
from mpistrat.data.experimental import AutoShardPolicy
from mpistrat.data.prefetch import live_producer_threads


def ints(ds):
    return [int(x) for x in ds]


def test_map_unpacks_tuples_and_keeps_order_in_parallel():
    ds = D.Dataset.from_tensor_slices((np.arange(4), np.arange(4) * 10)).map(lambda a, b: a + b)
    assert ints(ds) == [0, 11, 22, 33]

    def slow(x):
        time.sleep(0.002 * (5 - int(x) % 5))  # later elements finish first
        return x * 2

    assert ints(D.Dataset.range(20).map(slow, num_parallel_calls=4)) == [2 * i for i in range(20)]
    assert ints(D.Dataset.range(5).map(lambda x: x + 1, num_parallel_calls=D.AUTOTUNE)) == [1, 2, 3, 4, 5]
    lists = list(D.Dataset.range(2).map(lambda x: [x, x]))  # lists become arrays, as in tf.data
    assert isinstance(lists[1], np.ndarray) and lists[1].tolist() == [1, 1]
    with pytest.raises(ValueError, match="num_parallel_calls"):
        D.Dataset.range(2).map(lambda x: x, num_parallel_calls=0)


def test_map_exception_propagates_from_threads():
    def boom(x):
        if int(x) == 3:
            raise KeyError("bad element 3")
        return x

    with pytest.raises(KeyError, match="bad element 3"):
        list(D.Dataset.range(6).map(boom, num_parallel_calls=3))


def test_filter():
    assert ints(D.Dataset.range(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="scalar boolean"):
        list(D.Dataset.range(3).filter(lambda x: np.array([True, False])))


def test_batch_remainder_structures_and_errors():
    assert [b.tolist() for b in D.Dataset.range(7).batch(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in D.Dataset.range(7).batch(3, drop_remainder=True)] == [[0, 1, 2], [3, 4, 5]]
    # the stacking path (after a map) gives the same as the slicing path
    assert [b.tolist() for b in D.Dataset.range(7).map(lambda x: x).batch(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    b = next(iter(D.Dataset.from_tensor_slices({"x": np.ones((4, 2)), "s": [b"a", b"b", b"c", b"d"]}).map(lambda d: d).batch(4)))
    assert b["x"].shape == (4, 2) and b["s"].dtype == object and b["s"].tolist() == [b"a", b"b", b"c", b"d"]
    ragged = D.Dataset.from_generator(lambda: iter([np.zeros(2), np.zeros(3)]))
    with pytest.raises(ValueError, match=r"Cannot batch tensors with different shapes in component 0. First element had shape \[2\] and element 1 had shape \[3\]"):
        list(ragged.batch(2))
    assert D.Dataset.range(5).batch(2).element_spec == TensorSpec((None,), np.dtype(np.int64))
    assert D.Dataset.range(5).batch(2, drop_remainder=True).element_spec == TensorSpec((2,), np.dtype(np.int64))
    with pytest.raises(ValueError, match="batch_size"):
        D.Dataset.range(3).batch(0)


def test_unbatch():
    assert ints(D.Dataset.range(7).batch(3).unbatch()) == list(range(7))
    pairs = list(D.Dataset.from_tensor_slices((np.arange(4), np.arange(4) + 10)).batch(3).unbatch())
    assert [(int(a), int(b)) for a, b in pairs] == [(0, 10), (1, 11), (2, 12), (3, 13)]
    assert D.Dataset.range(4).batch(2).unbatch().element_spec == TensorSpec((), np.dtype(np.int64))


def test_shuffle_is_a_permutation_seeded_and_reshuffled():
    ds = D.Dataset.range(50).shuffle(10, seed=7)
    a, b = ints(ds), ints(ds)
    assert sorted(a) == sorted(b) == list(range(50))
    assert a != list(range(50)) and a != b  # reshuffle_each_iteration defaults to True
    assert ints(D.Dataset.range(50).shuffle(10, seed=7)) == a  # same seed, same first pass
    fixed = D.Dataset.range(50).shuffle(10, seed=7, reshuffle_each_iteration=False)
    assert ints(fixed) == ints(fixed)
    # a buffer of 1 does not shuffle; the first output comes from the first buffer_size elements
    assert ints(D.Dataset.range(10).shuffle(1, seed=1)) == list(range(10))
    assert all(ints(D.Dataset.range(100).shuffle(5, seed=s))[0] < 5 for s in range(10))


def test_repeat_take_skip_shard():
    assert ints(D.Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert ints(D.Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert ints(D.Dataset.range(0).repeat()) == []  # an empty dataset repeated for ever ends
    assert ints(D.Dataset.range(5).take(2)) == [0, 1]
    assert ints(D.Dataset.range(5).take(-1)) == [0, 1, 2, 3, 4]
    assert ints(D.Dataset.range(5).skip(3)) == [3, 4]
    assert ints(D.Dataset.range(5).skip(-1)) == []
    assert ints(D.Dataset.range(10).shard(3, 1)) == [1, 4, 7]
    with pytest.raises(ValueError, match="Index must be between 0 and 2"):
        D.Dataset.range(10).shard(3, 3)


def test_interleave_matches_tf_documented_order():
    # tf.data.Dataset.interleave docstring example
    ds = D.Dataset.range(1, 6).interleave(lambda x: D.Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4)
    assert ints(ds) == [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4, 5, 5, 5, 5, 5, 5]
    flat = D.Dataset.range(1, 4).flat_map(lambda x: D.Dataset.range(x))
    assert ints(flat) == [0, 0, 1, 0, 1, 2]
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(D.Dataset.range(2).interleave(lambda x: [x], cycle_length=1))


def test_interleave_uneven_inner_datasets_matches_tensorflow():
    # expected lists printed by tensorflow-cpu 2.21 for the same pipelines
    lengths = {1: 3, 2: 1, 3: 2}

    def inner(x):
        return D.Dataset.range(int(x) * 10, int(x) * 10 + lengths[int(x)])

    source = D.Dataset.from_tensor_slices(np.array([1, 2, 3]))
    assert ints(source.interleave(inner, cycle_length=2, block_length=1)) == [10, 20, 11, 12, 30, 31]
    assert ints(source.interleave(inner, cycle_length=2, block_length=2)) == [10, 11, 20, 12, 30, 31]
    ds = D.Dataset.range(1, 6).interleave(lambda x: D.Dataset.range(x * 10, x * 10 + x), cycle_length=3, block_length=2)
    assert ints(ds) == [10, 20, 21, 30, 31, 40, 41, 32, 42, 43, 50, 51, 52, 53, 54]


def test_interleave_of_tfrecord_files(tmp_path):
    files = []
    for k in range(3):
        path = tmp_path / f"f{k}.tfrecord"
        with D.TFRecordWriter(path) as w:
            for i in range(2):
                w.write(f"{k}-{i}".encode())
        files.append(str(path))
    ds = D.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False).interleave(D.TFRecordDataset, cycle_length=3)
    assert list(ds) == [b"0-0", b"1-0", b"2-0", b"0-1", b"1-1", b"2-1"]


def test_prefetch_values_thread_lifecycle_and_errors():
    before = len(live_producer_threads())
    assert ints(D.Dataset.range(10).prefetch(3)) == list(range(10))
    it = iter(D.Dataset.range(1000).prefetch(2))
    assert int(next(it)) == 0
    assert len(live_producer_threads()) == before + 1
    it.close()
    assert len(live_producer_threads()) == before

    def boom(x):
        if int(x) == 2:
            raise RuntimeError("element 2 is broken")
        return x

    it = iter(D.Dataset.range(5).map(boom).prefetch(1))
    assert [int(next(it)), int(next(it))] == [0, 1]
    with pytest.raises(RuntimeError, match="element 2 is broken"):
        next(it)
    deadline = time.time() + 5
    while len(live_producer_threads()) > before and time.time() < deadline:
        time.sleep(0.01)
    assert len(live_producer_threads()) == before
    assert ints(D.Dataset.range(3).prefetch(0)) == [0, 1, 2]


def test_prefetch_abandoned_iterator_thread_ends():
    before = len(live_producer_threads())
    it = iter(D.Dataset.range(10**6).prefetch(2))
    next(it)
    del it
    deadline = time.time() + 5
    while len(live_producer_threads()) > before and time.time() < deadline:
        time.sleep(0.01)
    assert len(live_producer_threads()) == before
    assert threading.active_count() >= 1


def test_shuffle_inside_repeat_reshuffles_each_repetition():
    reshuffled = ints(D.Dataset.range(10).shuffle(10, seed=1).repeat(2))
    first, second = reshuffled[:10], reshuffled[10:]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    fixed = ints(D.Dataset.range(10).shuffle(10, seed=1, reshuffle_each_iteration=False).repeat(2))
    assert fixed[:10] == fixed[10:] and sorted(fixed[:10]) == list(range(10))


def test_cache_discards_a_partial_pass():
    calls = []

    def record(x):
        calls.append(int(x))
        return x

    ds = D.Dataset.range(4).map(record).cache()
    it = iter(ds)
    next(it), next(it)
    it.close()  # abandoned after two elements: nothing cached (a truncated cache would lose elements)
    assert ints(ds) == [0, 1, 2, 3] and calls == [0, 1, 0, 1, 2, 3]
    assert ints(ds) == [0, 1, 2, 3] and calls == [0, 1, 0, 1, 2, 3]


def test_cache_replays_first_complete_pass():
    calls = []

    def record(x):
        calls.append(int(x))
        return x

    ds = D.Dataset.range(4).map(record).cache()
    assert ints(ds) == [0, 1, 2, 3]
    assert ints(ds) == [0, 1, 2, 3]
    assert calls == [0, 1, 2, 3]  # the second pass came from the cache
    with pytest.raises(NotImplementedError):
        D.Dataset.range(2).cache("somefile")


def test_zip_enumerate_reduce():
    z = D.Dataset.zip((D.Dataset.range(3), D.Dataset.range(3).map(lambda x: x * x)))
    assert [(int(a), int(b)) for a, b in z] == [(0, 0), (1, 1), (2, 4)]
    z2 = D.Dataset.zip(D.Dataset.range(2), D.Dataset.range(5, 9))  # positional form (tf.data >= 2.13)
    assert [(int(a), int(b)) for a, b in z2] == [(0, 5), (1, 6)]
    e = D.Dataset.from_tensor_slices(np.array([5.0, 6.0])).enumerate(start=10)
    assert [(int(i), float(v)) for i, v in e] == [(10, 5.0), (11, 6.0)]
    assert e.element_spec == (TensorSpec((), np.dtype(np.int64)), TensorSpec((), np.dtype(np.float64)))
    assert int(D.Dataset.range(5).reduce(np.int64(0), lambda s, x: s + x)) == 10


def test_options_and_with_options_are_inherited():
    ds = D.Dataset.range(4)
    assert ds.options().experimental_distribute.auto_shard_policy == AutoShardPolicy.AUTO
    opts = Options()
    opts.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    d2 = ds.with_options(opts).map(lambda x: x).batch(2)
    assert d2.options().experimental_distribute.auto_shard_policy == AutoShardPolicy.DATA
    assert ds.options().experimental_distribute.auto_shard_policy == AutoShardPolicy.AUTO
    with pytest.raises(ValueError, match="auto_shard_policy"):
        Options().experimental_distribute.auto_shard_policy = 42
