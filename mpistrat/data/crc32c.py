"""CRC-32C (Castagnoli) checksums, plain and masked as TFRecord stores them.

Uses ``google-crc32c`` (hardware accelerated) when installed, else the ``crc32c``
package, else a pure-Python table implementation that is correct but far slower:
install ``google-crc32c`` (``pip install mpistrat[data]``) for real workloads.
Set ``MPISTRAT_CRC32C=python`` to force the fallback (for tests).
"""

from __future__ import annotations

import warnings
from typing import Callable

from mpistrat import config

__all__ = ["crc32c", "masked_crc32c", "crc32c_python", "IMPLEMENTATION"]

_MASK_DELTA = 0xA282EAD8
_POLY = 0x82F63B78  # reversed Castagnoli polynomial


def _make_table() -> list:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c_python(data: bytes) -> int:
    """CRC-32C of ``data`` in pure Python (the slow fallback)."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in bytes(data):
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _forced_python() -> bool:
    """Whether ``MPISTRAT_CRC32C=python`` asks for the pure-Python CRC (read at import: a malformed
    value warns and keeps the default instead of making ``import mpistrat.data`` fail)."""
    try:
        return config.get("crc32c") == "python"
    except ValueError as exc:
        warnings.warn(f"{exc}; using the default", RuntimeWarning, stacklevel=2)
        return False


def _select() -> "tuple[Callable[[bytes], int], str]":
    if not _forced_python():
        try:
            import google_crc32c  # noqa: PLC0415

            return google_crc32c.value, f"google-crc32c ({google_crc32c.implementation})"
        except ImportError:
            pass
        try:
            import crc32c as _crc32c_pkg  # noqa: PLC0415

            return _crc32c_pkg.crc32c, "crc32c"
        except ImportError:
            pass
    return crc32c_python, "pure Python (slow; pip install google-crc32c)"


crc32c, IMPLEMENTATION = _select()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C: ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32)."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF
