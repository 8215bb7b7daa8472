"""CRC-32C (Castagnoli) checksums, plain and masked as TFRecord stores them.

``google-crc32c`` (a core dependency) computes them: its C extension uses the CPU's CRC
instructions, and it carries its own pure-Python fallback where the extension is missing
(``IMPLEMENTATION`` says which runs).
"""

from __future__ import annotations

import google_crc32c

__all__ = ["crc32c", "masked_crc32c", "IMPLEMENTATION"]

_MASK_DELTA = 0xA282EAD8

IMPLEMENTATION = f"google-crc32c ({google_crc32c.implementation})"


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (bytes, or any bytes-like object: the C extension takes only read-only ones)."""
    return google_crc32c.value(data if type(data) is bytes else bytes(data))


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C: ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32)."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF
