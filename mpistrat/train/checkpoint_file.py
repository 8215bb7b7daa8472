"""The checkpoint file: one ``.npz`` written atomically, read only after its manifest and headers check out.

The reader trusts nothing in the file. It opens the zip, reads the manifest
(at most :data:`MAX_MANIFEST_BYTES`), checks its structure and compares its
names, shapes and dtypes with the live variables; then it checks every
member's declared size and ``.npy`` header against the expected array, and
only then reads the data, in bounded chunks and never past the expected byte
count. Every failure is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import tempfile
import urllib.parse
import zipfile
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_DEPTH",
    "CheckpointError",
    "check_variables",
    "fsync_directory",
    "member_name",
    "read_manifest",
    "read_saved",
    "read_file",
    "write_file",
]

FORMAT = "mpistrat-checkpoint"
VERSION = 2  # 2: members named by variable name (member_name); 1: members v0..vN, still read
_READ_VERSIONS = (1, 2)
MANIFEST = "__manifest__"
MAX_MANIFEST_BYTES = 16 << 20
"""The largest manifest (names, shapes, dtypes, user metadata) written or read, in bytes of JSON."""
MAX_METADATA_DEPTH = 100
"""How deeply lists and dicts may nest in user metadata (deeper JSON would exhaust the parser's stack)."""

_MANIFEST_MEMBER = f"{MANIFEST}.npy"
_MAX_NPY_HEADER = 16 << 10  # magic, length field and header; numpy itself refuses headers over 10,000 characters
_CHUNK = 1 << 20  # data is read (and inflated) at most this much at a time
_KINDS = "biufc"  # bool, signed, unsigned, float, complex: what a variable holds
_METHODS = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED})  # zipfile inflates these in bounded steps

Expected = Mapping[str, "tuple[tuple[int, ...], np.dtype]"]


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, corrupt, or does not match the live variables."""


# -- member names --------------------------------------------------------------------------
def member_name(name: str) -> str:
    """The zip member (without ``.npy``) that holds variable ``name``, so that ``np.load(path)[name]`` finds a
    plain one: the name itself where it is a path of letters, digits, ``_``, ``-`` and ``.`` segments;
    every other character (``%`` too) percent-escaped as its UTF-8 bytes (``urllib.parse.quote``); where
    a segment would be empty, ``.`` or ``..``, the whole name escaped flat (``/`` and ``.`` too); the
    manifest's own name with its first character escaped. Different names always give different members
    (no escaped output is another name's plain or path output), and a name always the same one."""
    path = urllib.parse.quote(name, safe="/_-.")
    if any(seg in ("", ".", "..") for seg in path.split("/")):
        return urllib.parse.quote(name, safe="_-").replace(".", "%2E")
    return "%5F" + path[1:] if path == MANIFEST else path


# -- write -------------------------------------------------------------------------------
def fsync_directory(path: str) -> None:
    """fsync a directory, so that a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, names: list, arrays: list, metadata: dict) -> None:
    """Write the checkpoint atomically: a temporary file, fsynced, renamed into place, the directory fsynced."""
    if _too_deep(metadata):
        raise CheckpointError(f"the metadata for {path!r} nests lists and dicts more than {MAX_METADATA_DEPTH} deep")
    manifest = {
        "format": FORMAT, "version": VERSION, "metadata": metadata,
        "variables": [{"name": n, "member": member_name(n), "shape": list(a.shape), "dtype": a.dtype.str}
                      for n, a in zip(names, arrays)],
    }
    text = json.dumps(manifest).encode()
    if len(text) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"the manifest of {path!r} would be {len(text)} bytes of JSON, over the limit of "
                              f"{MAX_MANIFEST_BYTES} (names and metadata too large)")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(f"{directory!r} or a directory above it is a file, not a directory") from None
    members = {member_name(n): a for n, a in zip(names, arrays)}
    members[MANIFEST] = np.frombuffer(text, dtype=np.uint8)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **members)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


# -- read --------------------------------------------------------------------------------
def read_manifest(path: str) -> dict:
    """The checked manifest of checkpoint ``path`` (names, shapes, dtypes, metadata), no data read."""
    if not os.path.isfile(path):
        raise CheckpointError(f"Checkpoint file {path!r} does not exist or is not a regular file")
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            return _read_manifest(path, z, _members(path, z))
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - as read_file: the error names the file
        raise CheckpointError(f"Checkpoint file {path!r} is corrupt or truncated: {type(exc).__name__}: "
                              f"{exc}") from None


def read_saved(path: str) -> tuple[dict, dict]:
    """The manifest and ``{name: array}`` of checkpoint ``path`` as saved, checked against its own manifest."""
    manifest = read_manifest(path)
    expected = {e["name"]: (tuple(e["shape"]), np.dtype(e["dtype"])) for e in manifest["variables"]}
    manifest, arrays = read_file(path, expected)
    return manifest, {e["name"]: a for e, a in zip(manifest["variables"], arrays)}


def read_file(path: str, expected: Expected) -> tuple[dict, list]:
    """The manifest and arrays of checkpoint ``path`` (native byte order), checked against ``expected`` first.

    ``expected`` maps each live variable's name to its shape and dtype. Any
    problem, in the file or against ``expected``, raises CheckpointError
    naming the file.
    """
    if not os.path.exists(path):
        raise CheckpointError(f"Checkpoint file {path!r} does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"Checkpoint file {path!r} is not a regular file")
    try:
        with open(path, "rb") as f, zipfile.ZipFile(f) as z:
            infos = _members(path, z)
            manifest = _read_manifest(path, z, infos)
            check_variables(path, manifest, expected)
            entries = manifest["variables"]
            members = _members_of(manifest)
            _require_members(path, infos, members)
            layouts = [_check_header(path, z, infos[m], entry) for m, entry in zip(members, entries)]
            arrays = [_read_data(z, infos[m], entry, *layout) for m, entry, layout in zip(members, entries, layouts)]
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"Checkpoint file {path!r} is corrupt: its manifest is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - a reader's contract: whatever the bytes do, the error names the file
        raise CheckpointError(f"Checkpoint file {path!r} is corrupt or truncated: {type(exc).__name__}: "
                              f"{exc}") from None
    return manifest, arrays


def _members(path: str, z: zipfile.ZipFile) -> dict:
    """Member name -> ZipInfo, refusing duplicates, encryption and methods that inflate unboundedly."""
    infos: dict = {}
    for info in z.infolist():
        if info.filename in infos:
            raise CheckpointError(f"Checkpoint file {path!r} is corrupt: member {info.filename!r} appears twice")
        if info.flag_bits & 0x1:
            raise CheckpointError(f"Checkpoint file {path!r}: member {info.filename!r} is encrypted")
        if info.compress_type not in _METHODS:
            raise CheckpointError(f"Checkpoint file {path!r}: member {info.filename!r} uses zip compression method "
                                  f"{info.compress_type}; only stored (0) or deflated (8) members are read")
        infos[info.filename] = info
    if _MANIFEST_MEMBER not in infos:
        raise CheckpointError(f"Checkpoint file {path!r} has no manifest: not an mpistrat checkpoint")
    return infos


def _members_of(manifest: dict) -> list[str]:
    """The zip member of each variable of a checked manifest: ``v<i>.npy`` in version 1, by name in version 2."""
    if manifest["version"] == 1:
        return [f"v{i}.npy" for i in range(len(manifest["variables"]))]
    return [member_name(e["name"]) + ".npy" for e in manifest["variables"]]


def _require_members(path: str, infos: dict, members: list[str]) -> None:
    wanted = {_MANIFEST_MEMBER} | set(members)
    missing, extra = sorted(wanted - infos.keys()), sorted(infos.keys() - wanted)
    if missing or extra:
        raise CheckpointError(f"Checkpoint file {path!r} is corrupt: its manifest lists {len(members)} variables "
                              f"but members {missing} are missing and {extra} are unexpected")


def _read_npy_header(stream: BinaryIO) -> tuple[tuple, bool, np.dtype]:
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(stream)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(stream)
    raise ValueError(f".npy format version {version[0]}.{version[1]} is not read (1.0 and 2.0 are)")


def _read_manifest(path: str, z: zipfile.ZipFile, infos: dict) -> dict:
    info = infos[_MANIFEST_MEMBER]
    if info.file_size > MAX_MANIFEST_BYTES + _MAX_NPY_HEADER:
        raise CheckpointError(f"Checkpoint file {path!r}: its manifest member declares {info.file_size} bytes, "
                              f"over the limit of {MAX_MANIFEST_BYTES}; not read")
    with z.open(info) as stream:
        raw = stream.read(info.file_size)
    try:
        buffer = io.BytesIO(raw)
        shape, _, dtype = _read_npy_header(buffer)
        body = raw[buffer.tell():]
        if dtype != np.uint8 or len(shape) != 1 or shape[0] != len(body):
            raise ValueError(f"it holds shape {shape} dtype {dtype} in {len(body)} bytes, not the JSON text as "
                             "a 1-D uint8 array")
        manifest = json.loads(body.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"Checkpoint file {path!r} has an unreadable manifest: {type(exc).__name__}: {exc}") \
            from None
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: str, manifest: Any) -> None:
    """Raise unless ``manifest`` has the structure this module writes."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"Checkpoint file {path!r} has a malformed manifest: {what}")

    if not isinstance(manifest, dict):
        raise bad(f"it is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT or manifest.get("version") not in _READ_VERSIONS:
        raise CheckpointError(f"Checkpoint file {path!r} has format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}; expected {FORMAT!r} version "
                              f"{' or '.join(map(str, _READ_VERSIONS))}")
    if not isinstance(manifest.get("metadata"), dict):
        raise bad(f"'metadata' is {_short(manifest.get('metadata'))}, not an object")
    if _too_deep(manifest["metadata"]):
        raise bad(f"'metadata' nests lists and objects more than {MAX_METADATA_DEPTH} deep")
    entries = manifest.get("variables")
    if not isinstance(entries, list):
        raise bad(f"'variables' is {_short(entries)}, not a list")
    seen: set = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not {"name", "shape", "dtype"} <= entry.keys():
            raise bad(f"variables[{i}] is {_short(entry)}, not an object with 'name', 'shape' and 'dtype'")
        name, shape, dtype = entry["name"], entry["shape"], entry["dtype"]
        if not isinstance(name, str) or name in seen:
            why = "used twice" if name in seen else "not a string"
            raise bad(f"variables[{i}] has name {_short(name)}, {why}")
        seen.add(name)
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"{name!r} has shape {_short(shape)}, not a list of non-negative integers")
        problem = _dtype_problem(dtype)
        if problem is not None:
            raise bad(f"{name!r} has dtype {_short(dtype)}: {problem}")


def _dtype_problem(code: Any) -> str | None:
    """Why ``code`` does not name a numeric dtype, or None when it does."""
    if not isinstance(code, str):
        return "not a string"
    try:
        dtype = np.dtype(code)
    except Exception as exc:  # noqa: BLE001 - np.dtype's errors for odd strings vary by type
        return f"not a NumPy dtype ({type(exc).__name__}: {exc})"
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
        return "not a bool, integer, float or complex type"
    return None


def _too_deep(value: Any) -> bool:
    """Whether lists, tuples and dicts nest in ``value`` more than MAX_METADATA_DEPTH deep (no recursion)."""
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            if level == MAX_METADATA_DEPTH:
                return True
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=")


def check_variables(path: str, manifest: dict, expected: Expected, rank: int | None = None) -> None:
    """Raise unless the manifest's names, shapes and dtypes (any byte order) are the live variables' ones."""
    saved = {e["name"]: e for e in manifest["variables"]}
    problems = []
    missing = [n for n in expected if n not in saved]
    unexpected = [n for n in saved if n not in expected]
    if missing:
        problems.append(f"missing from the file: {missing}")
    if unexpected:
        problems.append(f"in the file but not among the live variables: {unexpected}")
    for name, (shape, dtype) in expected.items():
        entry = saved.get(name)
        if entry is None:
            continue
        saved_shape, saved_dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
        if saved_shape != tuple(shape) or _native(saved_dtype) != _native(np.dtype(dtype)):
            problems.append(f"{name!r}: saved shape {saved_shape} dtype {saved_dtype.name}, live shape "
                            f"{tuple(shape)} dtype {np.dtype(dtype).name}")
    if problems:
        where = "" if rank is None else f" on rank {rank}"
        raise CheckpointError(f"Checkpoint file {path!r} does not match the live variables{where}: "
                              + "; ".join(problems))


def _check_header(path: str, z: zipfile.ZipFile, info: zipfile.ZipInfo, entry: dict) -> tuple[int, bool]:
    """The header length and Fortran flag of a member whose declared size and header fit ``entry``."""
    dtype = np.dtype(entry["dtype"])
    nbytes = math.prod(entry["shape"]) * dtype.itemsize
    header = info.file_size - nbytes
    if not 0 < header <= _MAX_NPY_HEADER:
        raise CheckpointError(
            f"Checkpoint file {path!r}: member {info.filename!r} declares {info.file_size} bytes, but "
            f"{entry['name']!r} of shape {tuple(entry['shape'])} dtype {dtype.name} takes {nbytes} bytes plus a "
            f"header of at most {_MAX_NPY_HEADER}; not read")
    with z.open(info) as stream:
        raw = stream.read(header)
    try:
        buffer = io.BytesIO(raw)
        shape, fortran, stored = _read_npy_header(buffer)
    except (ValueError, EOFError, SyntaxError, TypeError) as exc:
        raise CheckpointError(f"Checkpoint file {path!r}: member {info.filename!r} has no valid .npy header: "
                              f"{type(exc).__name__}: {exc}") from None
    if shape != tuple(entry["shape"]) or stored != dtype:
        raise CheckpointError(
            f"Checkpoint file {path!r} is inconsistent: {entry['name']!r} is stored with shape {shape} dtype "
            f"{stored} but its manifest says {tuple(entry['shape'])} {entry['dtype']}; not read")
    if buffer.tell() != header:
        raise CheckpointError(
            f"Checkpoint file {path!r} is inconsistent: member {info.filename!r} has a {buffer.tell()}-byte header "
            f"but declares {info.file_size} bytes, which leaves {header} bytes before the data; not read")
    return header, fortran


def _read_data(z: zipfile.ZipFile, info: zipfile.ZipInfo, entry: dict, header: int, fortran: bool) -> np.ndarray:
    """The member's array, read in chunks of at most ``_CHUNK`` bytes up to its expected size (CRC checked)."""
    dtype = np.dtype(entry["dtype"])
    shape = tuple(entry["shape"])
    buffer = np.empty(math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    view = memoryview(buffer)
    with z.open(info) as stream:
        stream.read(header)
        done = 0
        while done < len(buffer):
            chunk = stream.read(min(_CHUNK, len(buffer) - done))
            if not chunk:
                raise EOFError(f"member {info.filename!r} ends after {done} of {len(buffer)} data bytes")
            view[done:done + len(chunk)] = chunk
            done += len(chunk)
        stream.read(1)  # reaching the end checks the CRC-32
    if dtype.kind == "b":
        flat = buffer != 0  # one byte per bool; any non-zero byte is True
    else:
        flat = buffer.view(dtype).astype(_native(dtype), copy=False)
    array = flat.reshape(shape, order="F" if fortran else "C")
    return array if array.flags.c_contiguous else array.copy(order="C")
