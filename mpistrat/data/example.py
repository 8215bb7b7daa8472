"""``tf.train.Example`` protos without protobuf: decode into NumPy arrays, and encode.

Wire format (proto3): ``Example{features=1: Features}``, ``Features{feature=1:
map<string, Feature>}``, ``Feature{bytes_list=1 | float_list=2 | int64_list=3}``,
each list ``{value=1: repeated}`` (floats and int64s packed or not).
Decoded values: bytes -> object array of ``bytes``, float -> float32, int64 -> int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["decode_example", "encode_example", "parse_single_example", "FixedLenFeature", "VarLenFeature"]


class _Corrupt(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> "tuple[int, int]":
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise _Corrupt(f"truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _Corrupt(f"varint longer than 10 bytes at byte {pos}")


def _fields(buf: bytes, start: int = 0, end: Optional[int] = None):
    """Yield (field_number, wire_type, value) where value is an int or a (start, end) span."""
    pos = start
    end = len(buf) if end is None else end
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 2:
            n, pos = _varint(buf, pos)
            if pos + n > end:
                raise _Corrupt(f"length-delimited field {field} runs past the end ({pos}+{n} > {end})")
            yield field, wire, (pos, pos + n)
            pos += n
        elif wire == 5:
            if pos + 4 > end:
                raise _Corrupt("truncated fixed32")
            yield field, wire, (pos, pos + 4)
            pos += 4
        elif wire == 1:
            if pos + 8 > end:
                raise _Corrupt("truncated fixed64")
            yield field, wire, (pos, pos + 8)
            pos += 8
        else:
            raise _Corrupt(f"unsupported wire type {wire} for field {field}")


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _decode_list(buf: bytes, kind: int, start: int, end: int) -> np.ndarray:
    if kind == 1:
        return np.array([bytes(buf[a:b]) for f, w, (a, b) in _fields(buf, start, end) if f == 1], dtype=object)
    if kind == 2:
        parts = []
        for f, w, v in _fields(buf, start, end):
            if f != 1:
                continue
            a, b = v
            parts.append(np.frombuffer(buf[a:b], dtype="<f4"))  # packed (wire 2) or one fixed32 (wire 5)
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    values = []
    for f, w, v in _fields(buf, start, end):
        if f != 1:
            continue
        if w == 0:
            values.append(_signed64(v))
        else:
            a, b = v
            pos = a
            while pos < b:
                x, pos = _varint(buf, pos)
                values.append(_signed64(x))
    return np.array(values, dtype=np.int64)


def decode_example(serialized: bytes) -> "dict[str, np.ndarray]":
    """Decode one serialized ``tf.train.Example`` into ``{name: 1-D array}``."""
    buf = bytes(serialized)
    out: dict = {}
    try:
        for f, w, span in _fields(buf):
            if f != 1 or w != 2:
                continue
            for f2, w2, entry in _fields(buf, *span):
                if f2 != 1 or w2 != 2:
                    continue
                key, value = b"", np.zeros(0, np.float32)
                for f3, w3, v in _fields(buf, *entry):
                    if f3 == 1 and w3 == 2:
                        key = buf[v[0]:v[1]]
                    elif f3 == 2 and w3 == 2:
                        value = np.zeros(0, np.float32)
                        for kind, w4, lst in _fields(buf, *v):
                            if kind in (1, 2, 3) and w4 == 2:
                                value = _decode_list(buf, kind, *lst)
                out[key.decode("utf-8")] = value
    except _Corrupt as exc:
        raise ValueError(f"Could not parse a tf.train.Example ({len(buf)} bytes): {exc}") from None
    return out


def _key(field: int, wire: int) -> bytes:
    return _encode_varint((field << 3) | wire)


def _encode_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _encode_varint(len(payload)) + payload


def _encode_feature(value: Any) -> bytes:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value if isinstance(value, (list, tuple)) else [value])
    arr = arr.reshape(-1)
    if arr.dtype.kind in "SOU" or (arr.size and isinstance(arr.flat[0], (bytes, str))):
        items = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in arr.tolist()]
        return _ld(1, b"".join(_ld(1, x) for x in items))
    if arr.dtype.kind == "f":
        packed = arr.astype("<f4").tobytes()
        return _ld(2, _ld(1, packed) if arr.size else b"")
    if arr.dtype.kind in "iub":
        packed = b"".join(_encode_varint(int(x)) for x in arr.astype(np.int64).tolist())
        return _ld(3, _ld(1, packed) if arr.size else b"")
    raise TypeError(f"Cannot encode a feature of dtype {arr.dtype} (bytes, float or int only)")


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize ``{name: bytes | str | floats | ints}`` as a ``tf.train.Example`` (keys sorted)."""
    entries = b"".join(
        _ld(1, _ld(1, name.encode("utf-8")) + _ld(2, _encode_feature(features[name]))) for name in sorted(features)
    )
    return _ld(1, entries)


@dataclass(frozen=True)
class FixedLenFeature:
    """A feature of fixed shape, as ``tf.io.FixedLenFeature`` (dtype: np.float32, np.int64 or object/bytes)."""

    shape: tuple
    dtype: Any
    default_value: Any = None


@dataclass(frozen=True)
class VarLenFeature:
    """A feature of any length, returned as a 1-D array (dense, unlike TF's SparseTensor)."""

    dtype: Any


def _kind(dtype: Any) -> str:
    if dtype in (bytes, str, object) or np.dtype(dtype).kind in "SOU":
        return "bytes"
    return np.dtype(dtype).kind


def parse_single_example(serialized: bytes, features: Mapping[str, Any]) -> "dict[str, np.ndarray]":
    """Parse one Example by a feature spec, as ``tf.io.parse_single_example``."""
    raw = decode_example(serialized)
    out = {}
    for name, spec in features.items():
        value = raw.get(name)
        want = _kind(spec.dtype)
        target = object if want == "bytes" else np.dtype(spec.dtype)
        if value is None or (value.size == 0 and name not in raw):
            if isinstance(spec, VarLenFeature):
                out[name] = np.zeros(0, dtype=target)
                continue
            if spec.default_value is None:
                raise ValueError(f"Feature {name!r} is required but missing from the Example")
            value = np.broadcast_to(np.asarray(spec.default_value, dtype=target), spec.shape).copy()
            out[name] = value
            continue
        got = "bytes" if value.dtype == object else value.dtype.kind
        if got != want and value.size:
            raise ValueError(f"Feature {name!r} has type {value.dtype} in the Example but the spec asks for {spec.dtype}")
        value = value.astype(target)
        if isinstance(spec, FixedLenFeature):
            size = int(np.prod(spec.shape)) if len(spec.shape) else 1
            if value.size != size:
                raise ValueError(
                    f"Feature {name!r}: expected {size} values for shape {tuple(spec.shape)}, got {value.size}"
                )
            value = value.reshape(spec.shape)
        out[name] = value
    return out
