"""TFRecord reader/writer and tf.train.Example codec, against files written by TensorFlow."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import mpistrat.data as D
from mpistrat.data import crc32c as crcmod
from mpistrat.data.example import FixedLenFeature, VarLenFeature, decode_example, encode_example, parse_single_example
from mpistrat.data.tfrecord import tf_record_iterator

TF_DIR = Path(__file__).resolve().parent / "data" / "tfrecord"  # written by TensorFlow 2.21 (its README.md)


def manifest() -> dict:
    return json.loads((TF_DIR / "MANIFEST.json").read_text())["files"]


RAW_FILES = sorted(n for n, e in manifest().items() if "records_utf8" in e)


def test_manifest_covers_every_kind_of_file():
    m = manifest()
    assert {m[n]["compression"] for n in RAW_FILES} == {None, "GZIP", "ZLIB"}
    assert len([n for n in RAW_FILES if n.startswith("raw-0000")]) == 4
    assert sorted(set(m) - set(RAW_FILES)) == ["examples-00000-of-00001.tfrecord"]  # the tf.train.Example file


@pytest.mark.parametrize("name", RAW_FILES)
def test_reads_tensorflow_files_exactly(name):
    entry = manifest()[name]
    got = list(D.TFRecordDataset(str(TF_DIR / name), compression_type=entry["compression"] or ""))
    assert [r.decode("utf-8") for r in got] == entry["records_utf8"]


def test_reads_sharded_tensorflow_files_in_order_and_interleaved():
    m = manifest()
    files = [str(TF_DIR / f"raw-0000{k}-of-00004.tfrecord") for k in range(4)]
    expected = [r for k in range(4) for r in m[f"raw-0000{k}-of-00004.tfrecord"]["records_utf8"]]
    assert [r.decode() for r in D.TFRecordDataset(files)] == expected
    per_file = [m[f"raw-0000{k}-of-00004.tfrecord"]["records_utf8"] for k in range(4)]
    round_robin = [recs[i] for i in range(max(map(len, per_file))) for recs in per_file if i < len(recs)]
    assert [r.decode() for r in D.TFRecordDataset(files, num_parallel_reads=4)] == round_robin
    # fewer parallel reads than files: tf.data's interleave order (printed by tensorflow-cpu 2.21), where a
    # finished file's slot is refilled when the cycle comes back to it
    tf_order = {
        2: "00 10 01 11 02 12 03 13 04 14 15 20 21 30 22 31 23 32 24 33 25 34 26 35 36 37",
        3: "00 10 20 01 11 21 02 12 22 03 13 23 04 14 24 15 25 30 26 31 32 33 34 35 36 37",
    }
    for reads, order in tf_order.items():
        want = [per_file[int(pair[0])][int(pair[1])] for pair in order.split()]
        assert [r.decode() for r in D.TFRecordDataset(files, num_parallel_reads=reads)] == want, reads
    listed = D.Dataset.list_files(str(TF_DIR / "raw-0000*-of-00004.tfrecord"), shuffle=False)
    assert [r.decode() for r in listed.interleave(D.TFRecordDataset, cycle_length=1)] == expected


def test_writer_is_byte_identical_to_tensorflow(tmp_path):
    for name, entry in manifest().items():
        src = TF_DIR / name
        records = list(tf_record_iterator(src, entry["compression"]))
        out = tmp_path / name
        with D.TFRecordWriter(out, D.TFRecordOptions(entry["compression"])) as w:
            for r in records:
                w.write(r)
        assert out.read_bytes() == src.read_bytes(), name


def test_writer_round_trip_all_compressions(tmp_path):
    rng = np.random.default_rng(0)
    records = [rng.bytes(int(n)) for n in rng.integers(0, 3000, size=40)] + [b""]
    for ct in ["", "GZIP", "ZLIB"]:
        path = tmp_path / f"r-{ct or 'plain'}.tfrecord"
        with D.TFRecordWriter(path, ct) as w:
            for r in records:
                w.write(r)
        assert list(D.TFRecordDataset(str(path), compression_type=ct)) == records
    with pytest.raises(ValueError, match="compression_type"):
        D.TFRecordWriter(tmp_path / "x", "BZIP2")


def test_decodes_tensorflow_examples():
    entries = manifest()["examples-00000-of-00001.tfrecord"]["tf_train_Example"]
    records = list(D.TFRecordDataset(str(TF_DIR / "examples-00000-of-00001.tfrecord")))
    assert len(records) == len(entries)
    spec = {"x": FixedLenFeature([8], np.float32), "y": FixedLenFeature([], np.int64), "id": FixedLenFeature([], bytes)}
    for record, want in zip(records, entries):
        raw = decode_example(record)
        assert raw["x"].dtype == np.float32 and np.array_equal(raw["x"], np.float32(want["x"]))
        assert raw["y"].dtype == np.int64 and raw["y"].tolist() == [want["y"]]
        assert raw["id"].tolist() == [want["id"].encode()]
        parsed = parse_single_example(record, spec)
        assert parsed["x"].shape == (8,) and parsed["y"].shape == () and parsed["id"][()] == want["id"].encode()
        assert encode_example(raw) == record  # our encoder writes what TF wrote
    batch = next(iter(D.TFRecordDataset(str(TF_DIR / "examples-00000-of-00001.tfrecord"))
                      .map(lambda r: parse_single_example(r, spec)).batch(4)))
    assert batch["x"].shape == (4, 8) and batch["y"].tolist() == [e["y"] for e in entries[:4]]


def test_example_codec_edge_cases():
    ex = {"neg": np.array([-1, -(2**40), 2**62], dtype=np.int64), "e": np.zeros(0, np.float32), "s": [b"a", "b\u00e9"]}
    back = decode_example(encode_example(ex))
    assert back["neg"].tolist() == [-1, -(2**40), 2**62]
    assert back["s"].tolist() == [b"a", "b\u00e9".encode()]
    assert back["e"].size == 0
    # unpacked (non-packed) int64 and float fields, as proto2 writers emit them
    int_list = b"\x08\x05\x08\x07"  # value=5, value=7
    float_list = b"\x0d" + struct.pack("<f", 1.5)
    feature = lambda kind, payload: bytes([kind << 3 | 2, len(payload)]) + payload  # noqa: E731
    def entry(name, feat):
        body = b"\x0a" + bytes([len(name)]) + name + b"\x12" + bytes([len(feat)]) + feat
        return b"\x0a" + bytes([len(body)]) + body
    features = entry(b"i", feature(3, int_list)) + entry(b"f", feature(2, float_list))
    raw = decode_example(b"\x0a" + bytes([len(features)]) + features)
    assert raw["i"].tolist() == [5, 7] and raw["f"].tolist() == [1.5]
    with pytest.raises(ValueError, match="Could not parse a tf.train.Example"):
        decode_example(b"\x0a\x50\x01")
    spec = {"i": FixedLenFeature([3], np.int64)}
    with pytest.raises(ValueError, match="expected 3 values"):
        parse_single_example(encode_example({"i": [1, 2]}), spec)
    with pytest.raises(ValueError, match="required but missing"):
        parse_single_example(encode_example({"j": [1]}), spec)
    assert parse_single_example(encode_example({"j": [1]}), {"i": FixedLenFeature([2], np.int64, default_value=4)})["i"].tolist() == [4, 4]
    assert parse_single_example(encode_example({"v": [1.0, 2.0, 3.0]}), {"v": VarLenFeature(np.float32)})["v"].tolist() == [1.0, 2.0, 3.0]


def _write(path, records, ct=""):
    with D.TFRecordWriter(path, ct) as w:
        for r in records:
            w.write(r)
    return path


def test_corrupt_data_crc_names_file_offset_rank(tmp_path):
    path = _write(tmp_path / "c.tfrecord", [b"a" * 10, b"b" * 10, b"c" * 10])
    data = bytearray(path.read_bytes())
    data[26 + 12 + 3] ^= 0xFF  # inside record 1's data (record 0 is 12 + 10 + 4 = 26 bytes)
    path.write_bytes(bytes(data))
    with pytest.raises(D.DataLossError, match=r"rank \d+: corrupted record at byte offset 26 in TFRecord file .*c\.tfrecord.*data CRC mismatch"):
        list(D.TFRecordDataset(str(path)))
    it = iter(D.TFRecordDataset(str(path)))
    assert next(it) == b"a" * 10  # records before the damage are still returned


def test_corrupt_length_crc_and_truncation(tmp_path):
    path = _write(tmp_path / "l.tfrecord", [b"x" * 100, b"y" * 100])
    data = bytearray(path.read_bytes())
    data[116 + 2] ^= 0x01  # the second record's length field
    path.write_bytes(bytes(data))
    with pytest.raises(D.DataLossError, match=r"byte offset 116 .*length CRC mismatch"):
        list(D.TFRecordDataset(str(path)))
    path = _write(tmp_path / "t.tfrecord", [b"x" * 100, b"y" * 100])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(D.DataLossError, match=r"truncated record at byte offset 116 in TFRecord file .*t\.tfrecord"):
        list(D.TFRecordDataset(str(path)))
    path.write_bytes(_write(tmp_path / "u.tfrecord", [b"x"]).read_bytes() + b"\x01\x02\x03")
    with pytest.raises(D.DataLossError, match=r"truncated record header .* byte offset 17"):
        list(D.TFRecordDataset(str(path)))


def test_truncated_and_corrupt_gzip(tmp_path):
    path = _write(tmp_path / "g.tfrecord", [os.urandom(5000) for _ in range(5)], "GZIP")
    full = path.read_bytes()
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(D.DataLossError, match=r"g\.tfrecord"):
        list(D.TFRecordDataset(str(path), compression_type="GZIP"))
    path.write_bytes(full[:10] + b"\xff" * 40 + full[50:])
    with pytest.raises(D.DataLossError, match=r"corrupt compressed TFRecord file .*g\.tfrecord"):
        list(D.TFRecordDataset(str(path), compression_type="GZIP"))


def test_missing_file_names_file_and_rank(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"rank \d+: TFRecord file .*absent\.tfrecord.* not found \(byte offset 0\)"):
        list(D.TFRecordDataset(str(tmp_path / "absent.tfrecord")))


def test_crc32c_known_values():
    # RFC 3720 test vector and the classic check value, through google-crc32c (a core dependency)
    assert crcmod.crc32c(b"123456789") == 0xE3069283
    assert crcmod.crc32c(bytes(32)) == 0x8A9136AA
    assert crcmod.masked_crc32c(b"") == (((0 >> 15) | (0 << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert crcmod.IMPLEMENTATION == "google-crc32c (c)"  # its C extension (hardware CRC) is what runs here


def test_crc32c_takes_any_bytes_like_object():
    assert crcmod.crc32c(bytearray(b"123456789")) == crcmod.crc32c(memoryview(b"123456789")) == 0xE3069283
