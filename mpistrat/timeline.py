"""A Chrome-trace timeline of what each rank did (view in Perfetto or chrome://tracing).

Start it with ``MPISTRAT_TIMELINE=path`` in the environment (it starts when mpistrat is imported) or
:func:`start`; :func:`stop` (also at exit) merges the ranks' files into ``path``. Recording costs one
``if`` when the timeline is off (:func:`enabled`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

from mpistrat import config

__all__ = ["start", "stop", "enabled", "span", "record", "now_us", "merge_files"]

_lock = threading.Lock()
_events: list[dict] | None = None
_path: str | None = None
_rank = 0
_size = 1


def now_us() -> float:
    """Wall-clock time in microseconds (the timeline's clock)."""
    return time.time() * 1e6


def enabled() -> bool:
    """Whether a timeline is being recorded."""
    return _events is not None


def record(name: str, category: str, start_us: float, duration_us: float, **args: Any) -> None:
    """Add one complete event (no-op when the timeline is off).

    Events are complete events (``"ph": "X"``) with microsecond wall-clock
    timestamps, so ranks on one node line up. Categories: ``step`` (a
    ``strategy.run``: function name, local replicas), ``collective``
    (``allreduce``, ``broadcast``, ``allgather``: bytes, arrays, op and buckets
    for all-reduces; ``wait_us``, the time spent waiting for the other ranks to
    arrive, i.e. in the agreement check, and ``transfer_us``, the rest),
    ``check`` (the agreement check before a collective: call, sequence number),
    ``input`` (``next``: the time this rank's replicas waited for their next
    batch from a distributed iterator), ``stall`` (a stall inspector report,
    zero duration). README.md ("Reading the timeline") explains how to read it.
    """
    events = _events
    if events is None:
        return
    event = {"name": name, "cat": category, "ph": "X", "ts": start_us, "dur": max(duration_us, 0.0),
             "pid": _rank, "tid": threading.get_ident() % 1_000_000, "args": args}
    with _lock:
        events.append(event)


@contextlib.contextmanager
def span(name: str, category: str, **args: Any) -> Iterator[dict]:
    """Record the time spent in the ``with`` block; the yielded dict can receive more args."""
    if _events is None:
        yield args
        return
    start = now_us()
    try:
        yield args
    finally:
        record(name, category, start, now_us() - start, **args)


def _world() -> tuple[int, int, Any]:
    try:
        from mpi4py import MPI  # noqa: PLC0415

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD
    except ImportError:
        pass
    return 0, 1, None


def start(path: str) -> None:
    """Start recording; ``path`` is the merged file rank 0 writes at stop."""
    global _events, _path, _rank, _size
    from mpi4py import MPI  # noqa: F401, PLC0415  (initialises MPI so the rank is known)

    _rank, _size, _ = _world()
    _path = os.path.abspath(path)
    with _lock:
        _events = []
    threads = [{"name": "process_name", "ph": "M", "pid": _rank, "tid": 0, "args": {"name": f"rank {_rank}"}},
               {"name": "process_sort_index", "ph": "M", "pid": _rank, "tid": 0, "args": {"sort_index": _rank}}]
    _events.extend(threads)


def _rank_file(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.json"


def _wait_all(comm: Any, timeout: float) -> bool:
    """A barrier that gives up after ``timeout`` seconds (a dead rank must not hang the exit)."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def stop(timeout: float = 30.0) -> str | None:
    """Stop recording, write this rank's file and (rank 0) the merged file; returns the merged path.

    Each rank writes ``path.rank<R>.json``; rank 0 waits (at most ``timeout`` seconds) for the others
    and merges them into ``path``: one process track per rank (pid = rank), one thread track per
    Python thread.
    """
    global _events
    if _events is None:
        return None
    with _lock:
        events, _events = _events, None
    path = _path
    assert path is not None
    rank_path = _rank_file(path, _rank)
    tmp = rank_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events}, f)
    os.replace(tmp, rank_path)
    _, size, comm = _world()
    all_here = _wait_all(comm, timeout) if comm is not None and size > 1 else True
    if _rank != 0:
        return None
    merge_files(path, [_rank_file(path, r) for r in range(size)], complete=all_here)
    return path


def merge_files(path: str, rank_files: list[str], complete: bool = True) -> dict:
    """Merge per-rank trace files into one Chrome-trace JSON at ``path``; returns the merged dict."""
    merged: list[dict] = []
    missing = []
    for f in rank_files:
        try:
            with open(f) as fh:
                merged.extend(json.load(fh)["traceEvents"])
        except (OSError, ValueError):
            missing.append(f)
    document = {"traceEvents": merged, "displayTimeUnit": "ms",
                "otherData": {"ranks": len(rank_files), "missing_rank_files": missing, "complete": complete}}
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(document, fh)
    os.replace(tmp, path)
    for f in rank_files:
        if f not in missing:
            os.remove(f)
    return document


def _start_from_env() -> None:
    path = config.get("timeline")
    if path and not enabled():
        start(path)
        atexit.register(stop)


_start_from_env()
