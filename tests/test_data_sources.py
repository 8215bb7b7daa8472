"""Dataset sources against hand-computed results."""

from __future__ import annotations

import gzip

import zlib

import numpy as np
import pytest

import mpistrat.data as D
from mpistrat.data import TensorSpec


def ints(ds):
    return [int(x) for x in ds]


def test_range_forms_and_spec():
    assert ints(D.Dataset.range(5)) == [0, 1, 2, 3, 4]
    assert ints(D.Dataset.range(2, 5)) == [2, 3, 4]
    assert ints(D.Dataset.range(1, 10, 3)) == [1, 4, 7]
    assert ints(D.Dataset.range(5, 0, -2)) == [5, 3, 1]
    ds = D.Dataset.range(3)
    assert ds.element_spec == TensorSpec((), np.dtype(np.int64))
    assert all(isinstance(x, np.int64) for x in ds)
    with pytest.raises(ValueError, match="step"):
        D.Dataset.range(0, 5, 0)


def test_iteration_is_repeatable():
    ds = D.Dataset.range(4).map(lambda x: x * 10)
    assert ints(ds) == ints(ds) == [0, 10, 20, 30]


def test_from_tensor_slices_array_tuple_dict():
    x = np.arange(6).reshape(3, 2)
    out = list(D.Dataset.from_tensor_slices(x))
    assert [o.tolist() for o in out] == [[0, 1], [2, 3], [4, 5]]
    pairs = list(D.Dataset.from_tensor_slices((x, np.array([7, 8, 9]))))
    assert [(a.tolist(), int(b)) for a, b in pairs] == [([0, 1], 7), ([2, 3], 8), ([4, 5], 9)]
    dicts = list(D.Dataset.from_tensor_slices({"a": [1.0, 2.0], "s": [b"p", b"q"]}))
    assert [(float(d["a"]), d["s"]) for d in dicts] == [(1.0, b"p"), (2.0, b"q")]
    spec = D.Dataset.from_tensor_slices((x, np.array([7, 8, 9]))).element_spec
    assert spec == (TensorSpec((2,), x.dtype), TensorSpec((), np.dtype(np.int64)))


def test_from_tensor_slices_errors():
    with pytest.raises(ValueError, match="Dimensions 3 and 2 are not compatible"):
        D.Dataset.from_tensor_slices((np.zeros(3), np.zeros(2)))
    with pytest.raises(ValueError, match="rank >= 1"):
        D.Dataset.from_tensor_slices(np.float32(1.0))


def test_from_tensors_is_one_element():
    out = list(D.Dataset.from_tensors(np.arange(3)))
    assert len(out) == 1 and out[0].tolist() == [0, 1, 2]
    (element,) = list(D.Dataset.from_tensors([1, 2]))  # a list is one tensor, as in tf.data
    assert isinstance(element, np.ndarray) and element.tolist() == [1, 2]
    # Python ints convert to int32, as tf.convert_to_tensor (TF 2.21: TensorSpec(shape=(2,), dtype=tf.int32))
    assert D.Dataset.from_tensors([1, 2]).element_spec == TensorSpec((2,), np.dtype(np.int32))
    (pair,) = list(D.Dataset.from_tensors((np.arange(2), [3, 4])))
    assert pair[0].tolist() == [0, 1] and pair[1].tolist() == [3, 4]
    assert list(D.Dataset.from_tensors(b"xy")) == [b"xy"] and [int(x) for x in D.Dataset.from_tensors(3)] == [3]
    assert D.Dataset.from_tensors({"s": [b"a", b"bc"]}).element_spec == {"s": TensorSpec((2,), np.dtype(object))}


def test_from_generator_called_per_pass_with_signature():
    calls = []

    def gen(n):
        calls.append(n)
        for i in range(n):
            yield i, [i, i]

    sig = (TensorSpec((), np.float32), TensorSpec((2,), np.int32))
    ds = D.Dataset.from_generator(gen, args=(3,), output_signature=sig)
    first = list(ds)
    assert len(list(ds)) == 3 and calls == [3, 3]
    assert first[2][0].dtype == np.float32 and float(first[2][0]) == 2.0
    assert first[1][1].dtype == np.int32 and first[1][1].tolist() == [1, 1]
    assert ds.element_spec == sig
    bad = D.Dataset.from_generator(lambda: iter([(1, [1, 2, 3])]), output_signature=sig)
    with pytest.raises(TypeError, match="shape"):
        list(bad)


def test_list_files_sorted_shuffled_and_missing(tmp_path):
    for name in ["b.txt", "a.txt", "c.txt", "skip.bin"]:
        (tmp_path / name).write_text("x")
    pattern = str(tmp_path / "*.txt")
    ordered = list(D.Dataset.list_files(pattern, shuffle=False))
    assert ordered == [str(tmp_path / n) for n in ["a.txt", "b.txt", "c.txt"]]
    ds = D.Dataset.list_files(pattern, seed=3)
    passes = [list(ds) for _ in range(6)]
    assert all(sorted(p) == ordered for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # reshuffled per pass
    again = D.Dataset.list_files(pattern, seed=3)
    assert [list(again) for _ in range(6)] == passes  # same seed, same sequence
    with pytest.raises(FileNotFoundError, match="No files matched pattern"):
        D.Dataset.list_files(str(tmp_path / "*.none"))


def test_text_line_dataset_plain_gzip_zlib(tmp_path):
    text = b"alpha\nbeta\r\n\ngamma"
    (tmp_path / "p.txt").write_bytes(text)
    (tmp_path / "g.txt.gz").write_bytes(gzip.compress(b"one\ntwo\n"))
    (tmp_path / "z.txt").write_bytes(zlib.compress(b"three\n"))
    assert list(D.TextLineDataset(str(tmp_path / "p.txt"))) == [b"alpha", b"beta", b"", b"gamma"]
    (tmp_path / "q.txt").write_bytes(b"x\r\ny\r")
    # TensorFlow 2.21 gives these for the two files (a last line's "\r" is dropped too)
    assert list(D.TextLineDataset([str(tmp_path / "p.txt"), str(tmp_path / "q.txt")])) == [
        b"alpha", b"beta", b"", b"gamma", b"x", b"y"]
    assert list(D.TextLineDataset([str(tmp_path / "g.txt.gz")], compression_type="GZIP")) == [b"one", b"two"]
    assert list(D.TextLineDataset(str(tmp_path / "z.txt"), compression_type="ZLIB")) == [b"three"]
    with pytest.raises(FileNotFoundError, match=r"rank \d+: text file .*missing.txt"):
        list(D.TextLineDataset(str(tmp_path / "missing.txt")))


def test_npy_dataset_rows_and_fast_batches(tmp_path):
    a = np.arange(10, dtype=np.float32).reshape(5, 2)
    b = np.arange(10, 16, dtype=np.float32).reshape(3, 2)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    files = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    rows = list(D.NpyDataset(files))
    assert np.array_equal(np.stack(rows), np.concatenate([a, b]))
    batches = list(D.NpyDataset(files).batch(3))
    assert [x.shape[0] for x in batches] == [3, 3, 2]
    assert np.array_equal(np.concatenate(batches), np.concatenate([a, b]))
    assert batches[1].tolist() == [[6, 7], [8, 9], [10, 11]]  # spans both files
    assert type(batches[0]) is np.ndarray and batches[0].flags.writeable  # an owned copy, not the memmap
    assert [x.shape[0] for x in D.NpyDataset(files).batch(3, drop_remainder=True)] == [3, 3]
    assert D.NpyDataset(files).element_spec == TensorSpec((2,), np.dtype(np.float32))
    one_d = tmp_path / "c.npy"
    np.save(one_d, np.arange(4, dtype=np.int16))
    assert [int(x) for x in D.NpyDataset(str(one_d))] == [0, 1, 2, 3]


def test_npy_errors_name_file_offset_rank(tmp_path):
    good = np.arange(100, dtype=np.float64).reshape(25, 4)
    path = tmp_path / "t.npy"
    np.save(path, good)
    data = path.read_bytes()
    path.write_bytes(data[:-16])  # truncated
    with pytest.raises(D.DataLossError, match=r"rank \d+: truncated \.npy file .*t\.npy.*byte offset 128.*ends at byte offset"):
        list(D.NpyDataset(str(path)).batch(4))
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not an npy file at all")
    with pytest.raises(D.DataLossError, match=r"junk\.npy.*byte offset 0"):
        list(D.NpyDataset(str(junk)))
    with pytest.raises(FileNotFoundError, match=r"rank \d+: \.npy file .*nope\.npy.*not found \(byte offset 0\)"):
        list(D.NpyDataset(str(tmp_path / "nope.npy")))
    other = tmp_path / "other.npy"
    np.save(other, np.zeros((2, 3)))
    np.save(path, good)
    with pytest.raises(D.DataLossError, match="rows of shape"):
        list(D.NpyDataset([str(other), str(path)]).batch(2))


def test_zip_and_concatenate_sources():
    z = D.Dataset.zip({"a": D.Dataset.range(3), "b": D.Dataset.range(10, 20)})
    assert [(int(e["a"]), int(e["b"])) for e in z] == [(0, 10), (1, 11), (2, 12)]
    assert ints(D.Dataset.range(2).concatenate(D.Dataset.range(5, 7))) == [0, 1, 5, 6]
    with pytest.raises(TypeError):
        D.Dataset.zip((D.Dataset.range(2), [1, 2]))

