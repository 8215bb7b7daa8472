"""Settings of the shared-memory all-reduce backend: read per rank, then agreed over the ranks.

Each rank reads its constructor arguments, else its environment
(``MPISTRAT_SHM_*``), and checks them before any collective
(:func:`read_settings`). The ranks then agree (:func:`agree_settings` on the
all-gathered settings): a rank whose environment differs must not take
another path or cut other chunks than its peers, or the node's
synchronisations would never meet.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Sequence

import numpy as np

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_BLOCK_BYTES = 256 << 10
# Single arrays longer than this go chunk by chunk (``auto``: measured; see shm_calibration): with the
# pushed reduce-scatter, 1 MiB chunks beat one pass at 4 and 16 MiB, 2 and 4 ranks, in both of the
# project VM's modes, while the measurement, taken once, could pick either in a mode that then changed.
DEFAULT_CHUNK_BYTES = 1 << 20
NEVER = 1 << 62  # min_bytes "off": above any max_bytes
SYNC_KINDS = ("barrier", "counter")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)i?b?\s*$", re.IGNORECASE)


class ShmSettings(NamedTuple):
    """One rank's settings; None where the value is measured (``auto``)."""

    max_bytes: int
    block_bytes: int
    chunk_bytes: int | None
    min_bytes: int | None
    sync: str


def parse_bytes(text: str, what: str) -> int:
    """``"4096"``, ``"256K"``, ``"64MiB"``, ``"1G"`` as a byte count."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{what} must be a byte count such as 4096, 256K or 64M, got {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def _env_bytes(name: str, default: int | None) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text or text.lower() == "auto":
        return default
    return parse_bytes(text, name)


def _byte_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"ShmAllreduceBackend: need {name} >= {minimum} bytes, got {value!r}")
    return int(value)


def read_settings(
    max_bytes: int | None = None,
    block_bytes: int | None = None,
    chunk_bytes: int | str | None = None,
    min_bytes: int | str | None = None,
    sync: str | None = None,
) -> ShmSettings:
    """This rank's settings: the arguments, else the environment, checked (ValueError names the bad one)."""
    if max_bytes is None:
        max_bytes = _env_bytes("MPISTRAT_SHM_MAX_BYTES", DEFAULT_MAX_BYTES)
    if block_bytes is None:
        block_bytes = _env_bytes("MPISTRAT_SHM_BLOCK_BYTES", DEFAULT_BLOCK_BYTES)
    if isinstance(chunk_bytes, str) and chunk_bytes.strip().lower() == "auto":
        chunk_bytes = None
    elif chunk_bytes is None:
        text = os.environ.get("MPISTRAT_SHM_CHUNK_BYTES", "").strip()
        chunk_bytes = None if text.lower() == "auto" else _env_bytes("MPISTRAT_SHM_CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
    if min_bytes is None:
        off = os.environ.get("MPISTRAT_SHM_MIN_BYTES", "").strip().lower() == "off"
        min_bytes = NEVER if off else _env_bytes("MPISTRAT_SHM_MIN_BYTES", None)
    sync = sync or os.environ.get("MPISTRAT_SHM_SYNC", "").strip().lower() or "auto"
    if sync == "auto":
        sync = "counter"  # measured at least as fast as Barrier at every size, 2 and 4 ranks
    if sync not in SYNC_KINDS:
        raise ValueError(f"ShmAllreduceBackend: sync must be 'barrier', 'counter' or 'auto', got {sync!r}")
    return ShmSettings(
        max_bytes=_byte_count("max_bytes", max_bytes, 0),
        block_bytes=_byte_count("block_bytes", block_bytes, 1),
        chunk_bytes=None if chunk_bytes is None else _byte_count("chunk_bytes (0: no chunks, or 'auto')", chunk_bytes, 0),
        min_bytes=None if min_bytes is None else _byte_count("min_bytes", min_bytes, 0),
        sync=sync,
    )


def _smallest(values: Sequence[int | None]) -> int | None:
    given = [v for v in values if v is not None]
    return min(given) if given else None


def agree_settings(per_rank: Sequence[ShmSettings]) -> ShmSettings:
    """The settings every rank uses, from all ranks' (the same list on every rank, so the same answer).

    Sizes: the smallest given over the ranks (a value given on some ranks wins
    over ``auto`` on the others). The synchronisation kind must be the same
    everywhere: ValueError otherwise.
    """
    kinds = sorted({s.sync for s in per_rank})
    if len(kinds) > 1:
        detail = ", ".join(f"rank {r}: {s.sync}" for r, s in enumerate(per_rank))
        raise ValueError(f"ShmAllreduceBackend: the ranks chose different sync kinds ({detail}); "
                         "set MPISTRAT_SHM_SYNC the same everywhere")
    max_bytes = min(s.max_bytes for s in per_rank)
    min_bytes = _smallest([s.min_bytes for s in per_rank])
    return ShmSettings(
        max_bytes=max_bytes,
        block_bytes=min(s.block_bytes for s in per_rank),
        chunk_bytes=_smallest([s.chunk_bytes for s in per_rank]),
        min_bytes=None if min_bytes is None else min(min_bytes, max_bytes + 1),
        sync=kinds[0],
    )
