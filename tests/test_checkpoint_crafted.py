"""Crafted checkpoint files: each raises CheckpointError naming the file, on every rank, before data is read."""

from __future__ import annotations

import io
import json
import os
import struct
import tracemalloc
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    latest_checkpoint,
)
from mpistrat.train.checkpoint_file import MAX_MANIFEST_BYTES, MAX_METADATA_DEPTH

MANIFEST = "__manifest__.npy"
W = np.arange(6, dtype=np.float32).reshape(2, 3)


# -- crafting real files ------------------------------------------------------------------
def _checkpoint(w_shape=(2, 3)):
    """The live variables of most cases: 'w/w' (float32) and 'step/step' (int64), filled with ones."""
    w = ms.Variable(np.ones(w_shape, dtype=np.float32), name="w")
    step = ms.Variable(np.int64(1), name="step")
    return Checkpoint(w=w, step=step)


def _saved_members() -> dict:
    """The raw members of a checkpoint of ``_checkpoint`` after setting w = W and step = 7, in the format's
    version 1 (members ``v0``, ``v1``), which the reader still reads; the writer writes version 2, whose
    members are named by variable (``test_crafting_is_faithful`` maps one onto the other)."""
    manifest = {"format": "mpistrat-checkpoint", "version": 1, "metadata": {"epoch": 3},
                "variables": [{"name": "w/w", "shape": [2, 3], "dtype": "<f4"},
                              {"name": "step/step", "shape": [], "dtype": "<i8"}]}
    return {"v0.npy": _npy(W), "v1.npy": _npy(np.int64(7)), MANIFEST: _text_npy(json.dumps(manifest))}


def _npy(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


def _npy_header(shape, descr, fortran=False) -> bytes:
    """A .npy header that says whatever it is told (numpy writes it without checking)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"shape": shape, "descr": descr, "fortran_order": fortran})
    return buffer.getvalue()


def _text_npy(text) -> bytes:
    return _npy(np.frombuffer(text.encode() if isinstance(text, str) else text, dtype=np.uint8))


def _manifest(members: dict) -> dict:
    return json.loads(np.load(io.BytesIO(members[MANIFEST])).tobytes())


def _edit_manifest(members: dict, edit) -> dict:
    manifest = _manifest(members)
    edit(manifest)
    return {**members, MANIFEST: _text_npy(json.dumps(manifest))}


def _zip(path, members, compression=zipfile.ZIP_STORED) -> None:
    """Write ``members`` (a dict, or (name, bytes) pairs, duplicates allowed) as a zip."""
    items = members.items() if isinstance(members, dict) else members
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name"
        with zipfile.ZipFile(path, "w", compression) as z:
            for name, data in items:
                z.writestr(name, data)


def _patch(path, name, **fields) -> None:
    """Overwrite fields of member ``name`` in both its local and its central-directory header.

    Fields: flag, method, crc, csize, usize (the zip format's names, in the order they appear).
    """
    local = {"flag": (6, "<H"), "method": (8, "<H"), "crc": (14, "<I"), "csize": (18, "<I"), "usize": (22, "<I")}
    data = bytearray(Path(path).read_bytes())
    with zipfile.ZipFile(path) as z:
        header_offset = z.getinfo(name).header_offset
        at = z.start_dir
    for key, value in fields.items():
        offset, fmt = local[key]
        struct.pack_into(fmt, data, header_offset + offset, value)
    while data[at:at + 4] == b"PK\x01\x02":  # central directory entries: 46 fixed bytes, then name, extra, comment
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        if data[at + 46:at + 46 + name_len].decode() == name:
            for key, value in fields.items():
                offset, fmt = local[key]
                struct.pack_into(fmt, data, at + offset + 2, value)  # the central entry has 2 more bytes in front
        at += 46 + name_len + extra_len + comment_len
    Path(path).write_bytes(bytes(data))


def _deflate_bomb(header: bytes, mebibytes: int) -> bytes:
    """A raw deflate stream of ``header`` then ``mebibytes`` MiB of zeros, about 1 KiB per MiB.

    After a full flush the compressor starts afresh, so every MiB of zeros
    compresses to the same bytes: compress one and repeat it.
    """
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(header) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH) == block
    return head + block * mebibytes + c.flush()


def _with_raw_deflated(path, members: dict, name: str, stream: bytes, usize: int, crc: int) -> None:
    """Write ``members`` with member ``name`` replaced by the deflate ``stream`` declaring ``usize`` bytes."""
    _zip(path, {**members, name: stream})
    _patch(path, name, method=zipfile.ZIP_DEFLATED, crc=crc, usize=usize)


# -- the cases: how to damage a real checkpoint, and what the error must say -----------------
def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _set_entry(index, key, value):
    return lambda m: m["variables"][index].__setitem__(key, value)


def _manifest_case(edit):
    return lambda path, members: _zip(path, _edit_manifest(members, edit))


def _manifest_text_case(text):
    return lambda path, members: _zip(path, {**members, MANIFEST: _text_npy(text)})


def _member_case(name, data):
    return lambda path, members: _zip(path, {**members, name: data})


def _patch_case(name, **fields):
    def craft(path, members):
        _zip(path, members)
        _patch(path, name, **fields)
    return craft


def _nested(depth):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _truncate(fraction):
    def craft(path, members):
        _zip(path, members)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: int(len(data) * fraction)] if fraction < 1 else data[:-1])
    return craft


def _cut_inside(name, count):
    """Remove ``count`` bytes from the middle of member ``name``'s data, keeping the zip directory."""
    def craft(path, members):
        _zip(path, members)
        with zipfile.ZipFile(path) as z:
            info = z.getinfo(name)
        at = info.header_offset + 30 + len(name) + info.compress_size // 2
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[:at] + data[at + count:])
    return craft


V0 = _npy(W)
CASES = {
    # the four of issue 24
    "header_claims_2**40_elements": (
        _member_case("v0.npy", _npy_header((2**40,), "<f4") + W.tobytes()),
        (r"is inconsistent: 'w/w' is stored with shape \(1099511627776,\) dtype float32 but its manifest says "
         r"\(2, 3\) <f4; not read")),
    "manifest_nested_100000_deep": (
        _manifest_text_case("[" * 100_000 + "]" * 100_000), "is corrupt: its manifest is nested too deeply"),
    "manifest_is_a_json_list": (_manifest_text_case("[1, 2]"),
                                "has a malformed manifest: it is a JSON list, not an object"),
    # the manifest
    "manifest_is_null": (_manifest_text_case("null"), "it is a JSON NoneType, not an object"),
    "manifest_is_not_json": (_manifest_text_case("{format: 1"), "has an unreadable manifest: JSONDecodeError"),
    "manifest_is_not_utf8": (_manifest_text_case(b"\xff\xfe{}"), "has an unreadable manifest: UnicodeDecodeError"),
    "manifest_is_float64": (_member_case(MANIFEST, _npy(np.zeros(3))),
                            r"has an unreadable manifest: ValueError: it holds shape \(3,\) dtype float64"),
    "manifest_is_not_npy": (_member_case(MANIFEST, b"{}"), "has an unreadable manifest: ValueError"),
    "manifest_declares_1_GiB": (_patch_case(MANIFEST, usize=1 << 30),
                                (f"its manifest member declares 1073741824 bytes, over the limit of "
                                 f"{MAX_MANIFEST_BYTES}; not read")),
    "manifest_missing": (lambda path, members: _zip(path, {k: v for k, v in members.items() if k != MANIFEST}),
                         "has no manifest: not an mpistrat checkpoint"),
    "manifest_other_format": (_manifest_case(_set("format", "other")), "has format 'other' version 1"),
    "manifest_version_3": (_manifest_case(_set("version", 3)), "has format 'mpistrat-checkpoint' version 3"),
    "manifest_metadata_is_a_list": (_manifest_case(_set("metadata", [1])), r"'metadata' is \[1\], not an object"),
    "manifest_metadata_200_deep": (_manifest_case(_set("metadata", {"a": _nested(200)})),
                                   f"'metadata' nests lists and objects more than {MAX_METADATA_DEPTH} deep"),
    "manifest_variables_is_an_object": (_manifest_case(_set("variables", {"a": 1})),
                                        r"'variables' is \{'a': 1\}, not a list"),
    "manifest_entry_is_a_number": (_manifest_case(lambda m: m["variables"].__setitem__(0, 5)),
                                   r"variables\[0\] is 5, not an object with 'name', 'shape' and 'dtype'"),
    "manifest_entry_without_dtype": (_manifest_case(lambda m: m["variables"][1].pop("dtype")),
                                     r"variables\[1\] is \{'name': 'step/step', 'shape': \[\]\}, not an object"),
    "manifest_name_is_a_number": (_manifest_case(_set_entry(0, "name", 5)), r"variables\[0\] has name 5, not a string"),
    "manifest_name_twice": (_manifest_case(_set_entry(1, "name", "w/w")), r"variables\[1\] has name 'w/w', used twice"),
    "shape_negative": (_manifest_case(_set_entry(0, "shape", [-2, 3])),
                       r"'w/w' has shape \[-2, 3\], not a list of non-negative integers"),
    "shape_float": (_manifest_case(_set_entry(0, "shape", [2.0, 3])), r"'w/w' has shape \[2.0, 3\], not a list"),
    "shape_string": (_manifest_case(_set_entry(0, "shape", ["2", 3])), r"'w/w' has shape \['2', 3\], not a list"),
    "shape_bool": (_manifest_case(_set_entry(0, "shape", [True, 3])), r"'w/w' has shape \[True, 3\], not a list"),
    "shape_not_a_list": (_manifest_case(_set_entry(0, "shape", "2x3")), r"'w/w' has shape '2x3', not a list"),
    "shape_2**40_in_manifest": (_manifest_case(_set_entry(0, "shape", [2**40])),
                                (r"does not match the live variables: 'w/w': saved shape \(1099511627776,\) "
                                 r"dtype float32, live shape \(2, 3\) dtype float32")),
    "dtype_unknown": (_manifest_case(_set_entry(0, "dtype", "float33")),
                      r"'w/w' has dtype 'float33': not a NumPy dtype \(TypeError"),
    "dtype_structured": (_manifest_case(_set_entry(0, "dtype", "f4,i4")),
                         "'w/w' has dtype 'f4,i4': not a bool, integer, float or complex type"),
    "dtype_object": (_manifest_case(_set_entry(0, "dtype", "|O")), "'w/w' has dtype '|O': not a bool, integer"),
    "dtype_unicode": (_manifest_case(_set_entry(0, "dtype", "<U4")), "'w/w' has dtype '<U4': not a bool, integer"),
    "dtype_not_a_string": (_manifest_case(_set_entry(0, "dtype", 5)), "'w/w' has dtype 5: not a string"),
    "dtype_float64_for_float32": (_manifest_case(_set_entry(0, "dtype", "<f8")),
                                  r"'w/w': saved shape \(2, 3\) dtype float64, live shape \(2, 3\) dtype float32"),
    # member headers and declared sizes
    "header_negative_shape": (_member_case("v0.npy", _npy_header((-2, 3), "<f4") + W.tobytes()),
                              r"'w/w' is stored with shape \(-2, 3\) dtype float32 but its manifest says \(2, 3\)"),
    "header_object_dtype": (_member_case("v0.npy", _npy_header((2, 3), "|O") + bytes(24)),
                            r"'w/w' is stored with shape \(2, 3\) dtype object"),
    "header_garbage": (_member_case("v0.npy", b"hello, world" + bytes(140)),
                       "member 'v0.npy' has no valid .npy header: ValueError"),
    "header_version_9": (_member_case("v0.npy", b"\x93NUMPY\x09\x00" + V0[8:]),
                         "member 'v0.npy' has no valid .npy header: ValueError: .npy format version 9.0"),
    "member_4_bytes_short": (_member_case("v0.npy", V0[:-4]), "member 'v0.npy'"),
    "member_4_bytes_long": (_member_case("v0.npy", V0 + bytes(4)),
                            "member 'v0.npy' has a 128-byte header but declares 156 bytes"),
    "member_declares_4_GiB": (_patch_case("v0.npy", usize=2**32 - 1),
                              (r"member 'v0.npy' declares 4294967295 bytes, but 'w/w' of shape \(2, 3\) dtype "
                               r"float32 takes 24 bytes plus a header of at most 16384; not read")),
    "member_declares_1000_more": (_patch_case("v0.npy", usize=len(V0) + 1000),
                                  "member 'v0.npy' has a 128-byte header but declares 1152 bytes"),
    "member_missing": (lambda path, members: _zip(path, {k: v for k, v in members.items() if k != "v1.npy"}),
                       r"lists 2 variables but members \['v1.npy'\] are missing and \[\] are unexpected"),
    "member_extra": (_member_case("x.npy", V0), r"members \[\] are missing and \['x.npy'\] are unexpected"),
    "member_twice": (lambda path, members: _zip(path, list(members.items()) + [("v0.npy", V0)]),
                     "member 'v0.npy' appears twice"),
    "member_encrypted": (_patch_case("v0.npy", flag=1), "member 'v0.npy' is encrypted"),
    "member_bzip2": (_patch_case("v0.npy", method=zipfile.ZIP_BZIP2),
                     "member 'v0.npy' uses zip compression method 12; only stored"),
    "member_crc_wrong": (_patch_case("v0.npy", crc=0),
                         "is corrupt or truncated: BadZipFile: Bad CRC-32 for file 'v0.npy'"),
    # the zip itself
    "truncated_to_10%": (_truncate(0.1), "is corrupt or truncated: BadZipFile"),
    "truncated_to_50%": (_truncate(0.5), "is corrupt or truncated: BadZipFile"),
    "truncated_to_90%": (_truncate(0.9), "is corrupt or truncated: BadZipFile"),
    "truncated_by_1_byte": (_truncate(1.0), "is corrupt or truncated: BadZipFile"),
    "10_bytes_cut_from_a_member": (_cut_inside("v0.npy", 10), "is corrupt or truncated"),
    "not_a_zip": (lambda path, members: Path(path).write_bytes(b"PK\x03\x04" + bytes(200)), "is corrupt or truncated"),
    "empty_file": (lambda path, members: Path(path).write_bytes(b""), "is corrupt or truncated: BadZipFile"),
}


def _expect(path, pattern, exc):
    message = str(exc.value)
    assert f"Checkpoint file {str(path)!r}" in message, message
    assert exc.match(pattern)
    return message


def _assert_untouched(ckpt):
    for var in ckpt.variables().values():
        assert np.all(np.asarray(var.numpy()) == 1)


# -- one rank ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_file_raises_checkpoint_error_naming_it(tmp_path, case):
    craft, pattern = CASES[case]
    path = tmp_path / "crafted.npz"
    craft(path, _saved_members())
    ckpt = _checkpoint()
    with pytest.raises(CheckpointError) as exc:
        ckpt.restore(path)
    _expect(path, pattern, exc)
    _assert_untouched(ckpt)


def test_crafting_is_faithful(tmp_path):
    """The crafted members are what the writer writes, and restore: every case above fails by its one change."""
    ckpt = _checkpoint()
    ckpt.variables()["w/w"].assign(W)
    ckpt.variables()["step/step"].assign(np.int64(7))
    written = ckpt.write(tmp_path / "written.npz", metadata={"epoch": 3})
    with zipfile.ZipFile(written) as z:
        real = {name: z.read(name) for name in z.namelist()}
    crafted = _saved_members()
    assert sorted(real) == sorted([MANIFEST, "w/w.npy", "step/step.npy"])  # version 2: named members
    assert real["w/w.npy"] == crafted["v0.npy"] and real["step/step.npy"] == crafted["v1.npy"]
    written_manifest = _manifest(real)
    assert written_manifest["version"] == 2 and [e.pop("member") for e in written_manifest["variables"]] == [
        "w/w", "step/step"]
    written_manifest["version"] = 1
    assert written_manifest == _manifest(crafted)
    path = tmp_path / "good.npz"
    _zip(path, crafted)
    ckpt = _checkpoint()
    assert ckpt.restore(path) == {"epoch": 3}
    np.testing.assert_array_equal(ckpt.variables()["w/w"].numpy(), W)
    assert int(ckpt.variables()["step/step"].numpy()) == 7


@pytest.mark.parametrize("variant", ["deflated", "fortran_order", "big_endian", "bool_bytes"])
def test_valid_variants_restore(tmp_path, variant):
    """What other writers may produce and is still exactly the saved values: read, never refused."""
    members = _saved_members()
    path = tmp_path / f"{variant}.npz"
    compression = zipfile.ZIP_STORED
    expect_w = W
    if variant == "deflated":  # what np.savez_compressed writes
        compression = zipfile.ZIP_DEFLATED
    elif variant == "fortran_order":
        members["v0.npy"] = _npy(np.asfortranarray(W))
        assert np.load(io.BytesIO(members["v0.npy"])).flags.f_contiguous
    elif variant == "big_endian":
        members["v0.npy"] = _npy(W.astype(">f4"))
        members = _edit_manifest(members, _set_entry(0, "dtype", ">f4"))
    ckpt = _checkpoint()
    if variant == "bool_bytes":  # any non-zero byte of a bool member is True
        flag = ms.Variable(np.zeros(3, dtype=bool), name="flag")
        ckpt = Checkpoint(flag=flag)
        manifest = {"format": "mpistrat-checkpoint", "version": 1, "metadata": {},
                    "variables": [{"name": "flag/flag", "shape": [3], "dtype": "|b1"}]}
        members = {"v0.npy": _npy_header((3,), "|b1") + bytes([0, 1, 7]), MANIFEST: _text_npy(json.dumps(manifest))}
    _zip(path, members, compression)
    ckpt.restore(path)
    if variant == "bool_bytes":
        value = flag.numpy()
        assert value.dtype == bool and value.tolist() == [False, True, True]
        return
    w = ckpt.variables()["w/w"].numpy()
    np.testing.assert_array_equal(w, expect_w)
    assert w.dtype == np.float32 and w.dtype.isnative and w.flags.c_contiguous


def _bomb(path, honest: bool) -> tuple[int, int]:
    """A checkpoint of 'big/big' (2**20 float32, 4 MiB) whose member is a 4.2 MB deflate stream of 4 GiB.

    ``honest``: the member declares its inflated size and its header the
    shape of 4095 MiB of float32; otherwise it declares the size and header
    of the expected 4 MiB (with a wrong CRC, which only reading reveals).
    """
    elements = (4095 << 18) if honest else (1 << 20)
    header = _npy_header((elements,), "<f4")
    manifest = {"format": "mpistrat-checkpoint", "version": 1, "metadata": {},
                "variables": [{"name": "big/big", "shape": [1 << 20], "dtype": "<f4"}]}
    members = {"v0.npy": b"", MANIFEST: _text_npy(json.dumps(manifest))}
    stream = _deflate_bomb(header, 4095)
    usize = len(header) + 4 * elements
    _with_raw_deflated(path, members, "v0.npy", stream, usize, crc=0)
    return len(stream), usize


def _restore_measuring_memory(ckpt, path):
    """The error restore raises and the peak of memory traced while it ran, in bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as exc:
            ckpt.restore(path)
        return exc, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("declares", ["4GiB", "4MiB"])
def test_member_inflating_to_4_gib_is_never_inflated(tmp_path, declares):
    """Declared honestly it is refused by its size; lying, it is read to the expected byte count and no further."""
    path = tmp_path / "bomb.npz"
    expected = 128 + (4 << 20)
    compressed, usize = _bomb(path, honest=declares == "4GiB")
    assert compressed < 5 << 20 and usize == (4293918848 if declares == "4GiB" else expected)
    big = ms.Variable(np.ones(1 << 20, dtype=np.float32), name="big")
    exc, peak = _restore_measuring_memory(Checkpoint(big=big), path)
    if declares == "4GiB":
        _expect(path, r"member 'v0.npy' declares 4293918848 bytes, but 'big/big' of shape \(1048576,\) dtype "
                      r"float32 takes 4194304 bytes plus a header of at most 16384; not read", exc)
        assert peak < 1 << 20
    else:
        _expect(path, "is corrupt or truncated: BadZipFile: Bad CRC-32 for file 'v0.npy'", exc)
        assert peak < 4 * expected  # the 4 MiB result, 1 MiB chunks and the zip reader's buffers (9 MiB measured)
    assert np.all(big.numpy() == 1)


# -- paths -----------------------------------------------------------------------------------
def test_directory_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    ckpt = _checkpoint()
    manager = CheckpointManager(ckpt, tmp_path / "file")
    message = f"Checkpoint directory {str(tmp_path / 'file')!r} is a file, not a directory"
    for call in (manager.restore_or_initialize, manager.save, lambda: manager.checkpoints,
                 lambda: manager.latest_checkpoint, lambda: latest_checkpoint(tmp_path / "file")):
        with pytest.raises(CheckpointError) as exc:
            call()
        assert str(exc.value) == message
    with pytest.raises(CheckpointError, match=r"Could not write checkpoint .*file/ckpt-1.npz': CheckpointError: "
                                              r"'.*file' or a directory above it is a file, not a directory"):
        manager.save(checkpoint_number=1)
    with pytest.raises(CheckpointError, match=r"Could not write checkpoint .*file/sub/x.npz': CheckpointError: "
                                              r"'.*file/sub' or a directory above it is a file"):
        ckpt.write(tmp_path / "file" / "sub" / "x.npz")
    with pytest.raises(CheckpointError, match=r"file/ckpt-1.npz' does not exist"):
        ckpt.restore(tmp_path / "file" / "ckpt-1.npz")
    with pytest.raises(CheckpointError, match=rf"Checkpoint file {str(tmp_path)!r} is not a regular file"):
        ckpt.restore(tmp_path)
    assert (tmp_path / "file").read_text() == "x"


def test_metadata_limits_are_checked_at_write_and_keep_the_old_file(tmp_path):
    ckpt = _checkpoint()
    path = ckpt.write(tmp_path / "m.npz", metadata={"deep": _nested(MAX_METADATA_DEPTH - 1)})
    assert ckpt.restore(path)["deep"] == _nested(MAX_METADATA_DEPTH - 1)
    before = Path(path).read_bytes()
    with pytest.raises(CheckpointError, match=f"nests lists and dicts more than {MAX_METADATA_DEPTH} deep"):
        ckpt.write(path, metadata={"deep": _nested(MAX_METADATA_DEPTH)})
    with pytest.raises(CheckpointError, match=f"bytes of JSON, over the limit of {MAX_MANIFEST_BYTES}"):
        ckpt.write(path, metadata={"text": "x" * MAX_MANIFEST_BYTES})
    circular: list = []
    circular.append(circular)
    with pytest.raises(CheckpointError, match="nests lists and dicts more than"):
        ckpt.write(path, metadata={"loop": circular})
    assert Path(path).read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.npz"]  # no temporary file left


# -- every rank --------------------------------------------------------------------------------
@pytest.fixture
def shared_dir(mpi_tmp_path):
    """A directory every rank of the test sees (rank 0's tmp_path, from pytest-mpi)."""
    return str(mpi_tmp_path)


@pytest.fixture(scope="module")
def strategy():
    return ms.MultiWorkerMirroredStrategy()


def _same_error_everywhere(comm, path, pattern, exc):
    message = _expect(path, pattern, exc)
    messages = comm.allgather(message)
    assert messages == [messages[0]] * comm.Get_size(), messages


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_file_raises_the_chiefs_error_on_every_rank(comm, shared_dir, strategy, case):
    craft, pattern = CASES[case]
    path = os.path.join(shared_dir, "crafted.npz")
    if comm.Get_rank() == 0:
        craft(path, _saved_members())
    comm.Barrier()
    with strategy.scope():
        ckpt = _checkpoint()
    with pytest.raises(CheckpointError) as exc:
        ckpt.restore(path)
    _same_error_everywhere(comm, path, pattern, exc)
    _assert_untouched(ckpt)


@pytest.mark.mpi(min_size=2)
def test_a_rank_whose_variables_differ_fails_every_rank(comm, shared_dir, strategy):
    path = os.path.join(shared_dir, "good.npz")
    if comm.Get_rank() == 0:
        _zip(path, _saved_members())
    comm.Barrier()
    last = comm.Get_size() - 1
    with strategy.scope():  # mirrored variables agree on shapes when made; a name can still differ
        ckpt = _checkpoint()
        if comm.Get_rank() == last:
            ckpt = Checkpoint(w=ms.Variable(np.ones((2, 3), dtype=np.float32), name="v"),
                              step=ckpt.variables()["step/step"])
        else:
            ms.Variable(np.ones((2, 3), dtype=np.float32), name="v")  # the same creations on every rank
    with pytest.raises(CheckpointError) as exc:
        ckpt.restore(path)
    _same_error_everywhere(comm, path, rf"does not match the live variables on rank {last}: missing from the file: "
                                       r"\['w/v'\]; in the file but not among the live variables: \['w/w'\]", exc)
    _assert_untouched(ckpt)
    with strategy.scope():
        ckpt = _checkpoint()
    assert ckpt.restore(path) == {"epoch": 3}  # the same file restores where the variables agree
    np.testing.assert_array_equal(ckpt.variables()["w/w"].numpy(), W)


@pytest.mark.mpi(min_size=2)
def test_directory_that_is_a_file_fails_every_rank(comm, shared_dir, strategy):
    path = os.path.join(shared_dir, "file")
    if comm.Get_rank() == 0:
        open(path, "w").close()
    comm.Barrier()
    with strategy.scope():
        manager = CheckpointManager(_checkpoint(), path)
    for call in (manager.restore_or_initialize, manager.save):
        with pytest.raises(CheckpointError) as exc:
            call()
        messages = comm.allgather(str(exc.value))
        assert messages == [f"Checkpoint directory {path!r} is a file, not a directory"] * comm.Get_size()


@pytest.mark.mpi(min_size=2)
def test_member_inflating_to_4_gib_fails_every_rank_uninflated(comm, shared_dir, strategy):
    path = os.path.join(shared_dir, "bomb.npz")
    if comm.Get_rank() == 0:
        _bomb(path, honest=True)
    comm.Barrier()
    with strategy.scope():
        big = ms.Variable(np.ones(1 << 20, dtype=np.float32), name="big")
    exc, peak = _restore_measuring_memory(Checkpoint(big=big), path)
    _same_error_everywhere(comm, path, r"member 'v0.npy' declares 4293918848 bytes, but 'big/big'", exc)
    assert peak < 1 << 20
    assert np.all(big.numpy() == 1)
