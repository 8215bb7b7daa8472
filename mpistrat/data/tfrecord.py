"""TFRecord files: reader and writer with TensorFlow's framing.

Each record is ``uint64 length | uint32 masked_crc32c(length) | data | uint32
masked_crc32c(data)`` (little endian). A file may be compressed as a whole with
GZIP or ZLIB (``compression_type``), as ``tf.io.TFRecordOptions`` does. Corrupt
or truncated files raise :class:`~mpistrat.data.errors.DataLossError` naming the
file, the byte offset (in the uncompressed stream) and the rank.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Iterator, Optional, Union

from mpistrat.data.crc32c import crc32c, masked_crc32c
from mpistrat.data.errors import DataLossError, rank_label

__all__ = ["TFRecordOptions", "TFRecordWriter", "tf_record_iterator", "normalize_compression"]

_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")
_LEN = struct.Struct("<Q")
_CHUNK = 1 << 20
_MASK_DELTA = 0xA282EAD8
_WBITS = {"": None, "GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}


def normalize_compression(compression_type: Optional[str]) -> str:
    """``None``/"" -> "", "gzip" -> "GZIP", "zlib" -> "ZLIB"; anything else raises."""
    ct = (compression_type or "").upper()
    if ct not in _WBITS:
        raise ValueError(f"Unsupported compression_type {compression_type!r}; expected '', 'GZIP' or 'ZLIB'.")
    return ct


class TFRecordOptions:
    """Writer options, as ``tf.io.TFRecordOptions`` (compression type and level)."""

    def __init__(self, compression_type: Optional[str] = None, compression_level: Optional[int] = None):
        self.compression_type = normalize_compression(compression_type)
        self.compression_level = -1 if compression_level is None else int(compression_level)


def _open(path: str, mode: str):
    try:
        return open(path, mode)
    except FileNotFoundError:
        raise FileNotFoundError(f"{rank_label()}: TFRecord file {path!r} not found (byte offset 0)") from None
    except OSError as exc:
        raise OSError(f"{rank_label()}: cannot open TFRecord file {path!r} (byte offset 0): {exc}") from exc


def _chunks(f, path: str, wbits: Optional[int]) -> Iterator[bytes]:
    if wbits is None:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return
            yield block
    d = zlib.decompressobj(wbits)
    consumed = 0
    while True:
        block = f.read(_CHUNK)
        if not block:
            break
        try:
            out = d.decompress(block)
            # Concatenated gzip members (as `cat a.gz b.gz`) continue with a new stream.
            while d.eof and d.unused_data:
                rest = d.unused_data
                if out:
                    yield out
                d = zlib.decompressobj(wbits)
                out = d.decompress(rest)
        except zlib.error as exc:
            raise DataLossError(
                f"{rank_label()}: corrupt compressed TFRecord file {path!r} near compressed byte offset "
                f"{consumed}: {exc}"
            ) from None
        consumed += len(block)
        if out:
            yield out
    tail = d.flush()
    if tail:
        yield tail
    if not d.eof:
        raise DataLossError(
            f"{rank_label()}: truncated compressed TFRecord file {path!r}: the compressed stream ends early "
            f"at compressed byte offset {consumed}"
        )


def tf_record_iterator(path: Union[str, os.PathLike], compression_type: Optional[str] = None) -> Iterator[bytes]:
    """Yield the records of one TFRecord file, checking both CRCs of every record."""
    path = os.fspath(path)
    wbits = _WBITS[normalize_compression(compression_type)]
    with _open(path, "rb") as f:
        buf = b""
        pos = 0  # position in buf
        base = 0  # stream offset of buf[0]
        chunks = _chunks(f, path, wbits)
        exhausted = False

        def fill(need: int) -> bool:
            nonlocal buf, pos, base, exhausted
            parts = [buf[pos:]]
            have = len(parts[0])
            while have < need and not exhausted:
                block = next(chunks, None)
                if block is None:
                    exhausted = True
                    break
                parts.append(block)
                have += len(block)
            base += pos
            buf = b"".join(parts)
            pos = 0
            return have >= need

        crc = crc32c
        unpack = _HEADER.unpack_from
        unpack_footer = _FOOTER.unpack_from
        while True:
            if len(buf) - pos < 12 and not fill(12):
                if len(buf) - pos == 0:
                    return
                raise DataLossError(
                    f"{rank_label()}: truncated record header in TFRecord file {path!r} at byte offset "
                    f"{base + pos}: {len(buf) - pos} of 12 header bytes present"
                )
            end = len(buf)
            # Tight loop over the records wholly inside the buffer (masked CRC inlined).
            while end - pos >= 12:
                length, length_crc = unpack(buf, pos)
                c = crc(buf[pos:pos + 8])
                if ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                    raise DataLossError(
                        f"{rank_label()}: corrupted record at byte offset {base + pos} in TFRecord file {path!r}: "
                        "length CRC mismatch"
                    )
                start = pos + 12
                stop = start + length
                if stop + 4 > end:
                    break
                data = buf[start:stop]
                c = crc(data)
                if ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF != unpack_footer(buf, stop)[0]:
                    raise DataLossError(
                        f"{rank_label()}: corrupted record at byte offset {base + pos} in TFRecord file {path!r}: "
                        "data CRC mismatch"
                    )
                pos = stop + 4
                yield data
            if end - pos < 12:
                continue
            (length,) = _LEN.unpack_from(buf, pos)
            need = 12 + length + 4
            if not fill(need):
                raise DataLossError(
                    f"{rank_label()}: truncated record at byte offset {base + pos} in TFRecord file {path!r}: "
                    f"needs {need} bytes, {len(buf) - pos} present"
                )


class TFRecordWriter:
    """Write records to a TFRecord file, as ``tf.io.TFRecordWriter`` (a context manager)."""

    def __init__(self, path: Union[str, os.PathLike], options: "TFRecordOptions | str | None" = None):
        if not isinstance(options, TFRecordOptions):
            options = TFRecordOptions(options)
        self.path = os.fspath(path)
        self._file = open(self.path, "wb")
        wbits = _WBITS[options.compression_type]
        # TensorFlow's ZlibCompressionOptions: default level, DEFLATED, 15 window bits, memLevel 9.
        self._z = None if wbits is None else zlib.compressobj(options.compression_level, zlib.DEFLATED, wbits, 9)

    def _emit(self, data: bytes) -> None:
        self._file.write(data if self._z is None else self._z.compress(data))

    def write(self, record: bytes) -> None:
        """Append one record (bytes-like)."""
        if self._file is None:
            raise ValueError(f"TFRecordWriter for {self.path!r} is closed")
        record = bytes(record)
        header = _LEN.pack(len(record))
        self._emit(header + _FOOTER.pack(masked_crc32c(header)) + record + _FOOTER.pack(masked_crc32c(record)))

    def flush(self) -> None:
        """Flush buffered bytes to the file (a full flush of the compressor for compressed files)."""
        if self._z is not None:
            self._file.write(self._z.flush(zlib.Z_FULL_FLUSH))
        self._file.flush()

    def close(self) -> None:
        """Finish the compressed stream and close the file."""
        if self._file is None:
            return
        if self._z is not None:
            self._file.write(self._z.flush(zlib.Z_FINISH))
        self._file.close()
        self._file = None

    def __enter__(self) -> "TFRecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
