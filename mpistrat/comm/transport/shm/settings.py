"""The shared-memory transport's settings, checked per rank and then agreed over the ranks.

A rank whose environment differs must not take another path or cut other chunks than its peers, or
the node's synchronisations would never meet: :func:`read_settings` checks each rank's settings before
any collective, :func:`agree_settings` picks the ones every rank uses.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from mpistrat import config

NEVER = 1 << 62  # min_bytes "off": above any max_bytes
SYNC_KINDS = ("barrier", "counter")


class ShmSettings(NamedTuple):
    """One rank's settings; None where the value is measured (``auto``); ``chunk_default``: the chunk is
    the settings' default, given neither as an argument nor otherwise (the transport then sizes it to
    the machine: ``ShmTransport``)."""

    max_bytes: int
    block_bytes: int
    chunk_bytes: int | None
    min_bytes: int | None
    sync: str
    chunk_default: bool = False


def _byte_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"ShmTransport: need {name} >= {minimum} bytes, got {value!r}")
    return int(value)


def read_settings(
    max_bytes: int | None = None,
    block_bytes: int | None = None,
    chunk_bytes: int | str | None = None,
    min_bytes: int | str | None = None,
    sync: str | None = None,
    env: config.Settings | None = None,
) -> ShmSettings:
    """This rank's settings: the arguments, else ``env`` (default ``config.settings()``), checked
    (ValueError names the bad one).

    Each rank takes its constructor arguments, else its ``MPISTRAT_SHM_*`` settings
    (:mod:`mpistrat.config`), and checks them before any collective.

    ``min_bytes`` None (``auto``) leaves the size to the transport's rule; ``chunk_bytes`` None
    (``auto``) leaves it to measurement.
    """
    env = config.settings() if env is None else env
    max_bytes = env.shm_max_bytes if max_bytes is None else max_bytes
    block_bytes = env.shm_block_bytes if block_bytes is None else block_bytes
    chunk_default = (chunk_bytes is None and env.sources.get("shm_chunk_bytes") in ("default", "hardware")
                     and env.shm_chunk_bytes == config.default_chunk_bytes()[0])
    chunk_bytes = env.shm_chunk_bytes if chunk_bytes is None else chunk_bytes
    if isinstance(chunk_bytes, str) and chunk_bytes.strip().lower() == "auto":
        chunk_bytes = None
    min_bytes = env.shm_min_bytes if min_bytes is None else min_bytes
    if isinstance(min_bytes, str):
        word = min_bytes.strip().lower()
        if word not in ("auto", "off"):
            raise ValueError(f"ShmTransport: min_bytes must be a byte count, 'off' or 'auto', got {min_bytes!r}")
        min_bytes = None if word == "auto" else NEVER
    sync = (sync or "counter").strip().lower()
    if sync not in SYNC_KINDS:
        raise ValueError(f"ShmTransport: sync must be 'barrier' or 'counter', got {sync!r}")
    return ShmSettings(
        max_bytes=_byte_count("max_bytes", max_bytes, 0),
        block_bytes=_byte_count("block_bytes", block_bytes, 1),
        chunk_bytes=None if chunk_bytes is None else _byte_count("chunk_bytes (0: no chunks, or 'auto')", chunk_bytes, 0),
        min_bytes=None if min_bytes is None else _byte_count("min_bytes", min_bytes, 0),
        sync=sync,
        chunk_default=chunk_default,
    )


def _smallest(values: Sequence[int | None]) -> int | None:
    given = [v for v in values if v is not None]
    return min(given) if given else None


def agree_settings(per_rank: Sequence[ShmSettings]) -> ShmSettings:
    """The settings every rank uses, from all ranks' (the same list on every rank, so the same answer).

    Sizes: the smallest given over the ranks (a value given on some ranks wins
    over ``auto`` on the others); the chunk is the default's where it is on every
    rank. The synchronisation kind must be the same everywhere: ValueError otherwise.
    """
    kinds = sorted({s.sync for s in per_rank})
    if len(kinds) > 1:
        detail = ", ".join(f"rank {r}: {s.sync}" for r, s in enumerate(per_rank))
        raise ValueError(f"ShmTransport: the ranks chose different sync kinds ({detail}); "
                         "pass the same sync everywhere")
    max_bytes = min(s.max_bytes for s in per_rank)
    min_bytes = _smallest([s.min_bytes for s in per_rank])
    return ShmSettings(
        max_bytes=max_bytes,
        block_bytes=min(s.block_bytes for s in per_rank),
        chunk_bytes=_smallest([s.chunk_bytes for s in per_rank]),
        min_bytes=None if min_bytes is None else min(min_bytes, max_bytes + 1),
        sync=kinds[0],
        chunk_default=all(s.chunk_default for s in per_rank),
    )
