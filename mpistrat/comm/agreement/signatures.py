"""Call signatures of cross-rank collectives: building, hashing and describing them.

The agreement check (:mod:`mpistrat.comm.agreement.guard`) compares fingerprints of
these signatures across ranks and, when they differ, turns the gathered
signatures into one error message.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

__all__ = ["CallKey", "fingerprint", "describe_call", "format_mismatch", "format_ranks"]

# A call signature: (kind, params, arrays); params is a tuple of (name, value)
# pairs, arrays a tuple of (shape, dtype string). Plain tuples: hashable,
# picklable and with a deterministic repr (the fingerprint hashes the repr).
CallKey = tuple


_FP_CACHE: dict = {}
_FP_CACHE_MAX = 4096


def fingerprint(key: CallKey) -> int:
    """A 62-bit hash of a call signature, the same on every rank."""
    h = _FP_CACHE.get(key)
    if h is None:
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        h = int.from_bytes(digest, "little", signed=True) >> 2
        if len(_FP_CACHE) >= _FP_CACHE_MAX:
            _FP_CACHE.clear()
        _FP_CACHE[key] = h
    return h


def _dtype_name(code: str) -> str:
    try:
        return np.dtype(code).name
    except TypeError:
        return str(code)


def _format_array(entry: tuple) -> str:
    # (shape, dtype string) for host arrays, plus a kind name for device ones.
    text = f"{tuple(entry[0])}, {_dtype_name(entry[1])}"
    return text + (f", {entry[2]}" if len(entry) > 2 else "")


def _format_arrays(arrays: tuple, focus: int | None = None, limit: int = 6) -> str:
    if len(arrays) <= limit:
        return "[" + "; ".join(_format_array(a) for a in arrays) + "]"
    if focus is None or focus >= len(arrays):
        shown = "; ".join(_format_array(a) for a in arrays[:3])
        return f"{len(arrays)} arrays [{shown}; ...]"
    return f"{len(arrays)} arrays, #{focus}: [{_format_array(arrays[focus])}]"


def describe_call(key: CallKey, focus: int | None = None) -> str:
    """A short human description of a call signature."""
    kind, params, arrays = key
    text = kind
    if params:
        text += "(" + ", ".join(f"{k}={v}" for k, v in params) + ")"
    if arrays:
        text += " " + _format_arrays(arrays, focus)
    return text


def format_ranks(ranks: Sequence[int]) -> str:
    """Ranks as words, sorted: "rank 3" or "ranks 0, 2"."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _group(values: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.items(), key=lambda item: item[1][0])


def format_mismatch(keys: Sequence[CallKey], seq: int) -> str:
    """The error message for ranks that sent different call signatures."""
    kinds = {k[0] for k in keys}
    where = f"in collective #{seq}"
    if len(kinds) > 1:
        parts = [f"{format_ranks(r)} called {describe_call(k)}" for k, r in _group(keys)]
        return f"Mismatched collectives {where}: " + "; ".join(parts)
    kind = keys[0][0]
    params = {k[1] for k in keys}
    arrays = [k[2] for k in keys]
    counts = {len(a) for a in arrays}
    names = sorted({n for p in params for n, _ in p if len({dict(q).get(n) for q in params}) > 1})
    # Nests of different sizes differ in structure too: their array counts say more.
    if len(params) > 1 and not (names == ["structure"] and len(counts) > 1):
        parts = []
        for p, r in _group([k[1] for k in keys]):
            given = dict(p)
            shown = list(p) + [(n, "(none)") for n in names if n not in given]
            parts.append(f"{format_ranks(r)} sent {', '.join(f'{n}={v}' for n, v in shown) or 'no parameters'}")
        what = "/".join(names) if names else "parameters"
        return f"Mismatched {kind} {what} {where}: " + "; ".join(parts)
    if len(counts) > 1:
        parts = [f"{format_ranks(r)} sent {n} array{'' if n == 1 else 's'}" for n, r in _group([len(a) for a in arrays])]
        return f"Mismatched {kind} array counts {where}: " + "; ".join(parts)
    focus = next(i for i in range(len(arrays[0])) if len({a[i] for a in arrays}) > 1)
    dtypes_differ = len({a[focus][1] for a in arrays}) > 1
    shapes_differ = len({a[focus][0] for a in arrays}) > 1
    if dtypes_differ or shapes_differ:
        what = "shapes and dtypes" if dtypes_differ and shapes_differ else ("dtypes" if dtypes_differ else "shapes")
    else:
        what = "array kinds (host/device)"
    parts = [f"{format_ranks(r)} sent {_format_arrays(a, focus)}" for a, r in _group(arrays)]
    return f"Mismatched {kind} {what} {where}: " + "; ".join(parts)
