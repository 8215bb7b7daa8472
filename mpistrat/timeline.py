"""A Chrome-trace timeline of what each rank did (view in Perfetto or chrome://tracing).

Start it with ``MPISTRAT_TIMELINE=path`` in the environment (it starts when the program makes its first
strategy or communicator: :func:`start_from_environment`; the ``python -m mpistrat`` tools never start
it) or :func:`start`. Each rank streams its events as they happen to ``path.rank<R>.jsonl``, one JSON event
per line, through a bounded buffer flushed when it fills, every :data:`FLUSH_SECONDS` by a timer, at
:func:`stop` and on the abort path (:func:`flush`), so a job that is killed leaves every rank's events
up to about a second before the kill. :func:`stop` (also at exit) merges the ranks' files into
``path``; ``python -m mpistrat timeline merge`` merges what a killed job left. Recording costs one
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

__all__ = ["start", "start_from_environment", "stop", "flush", "enabled", "span", "record", "now_us", "merge_files", "read_events",
           "FLUSH_SECONDS", "BUFFER_EVENTS"]

FLUSH_SECONDS = 1.0  # the timer's period: what a killed rank may lose
BUFFER_EVENTS = 4096  # events held before a write, whatever the timer

_lock = threading.Lock()  # guards the buffer (held only to append or swap it)
_write_lock = threading.Lock()  # orders the writes to the file (held while encoding and writing)
_events: list[dict] | None = None  # the buffer: events not yet written (None: not recording)
_file: Any = None  # this rank's open .jsonl file
_timer: threading.Event | None = None  # set to stop the flush timer
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
    if _events is None:
        return
    event = {"name": name, "cat": category, "ph": "X", "ts": start_us, "dur": max(duration_us, 0.0),
             "pid": _rank, "tid": threading.get_ident() % 1_000_000, "args": args}
    with _lock:  # the buffer read and appended under the lock: a flush may swap it at any time
        events = _events
        if events is None:
            return
        events.append(event)
        full = len(events) >= BUFFER_EVENTS
    if full:
        flush()


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
    """Start recording; ``path`` is the merged file rank 0 writes at stop (ranks stream ``path.rank<R>.jsonl``)."""
    global _events, _path, _rank, _size, _file, _timer
    from mpi4py import MPI  # noqa: F401, PLC0415  (initialises MPI so the rank is known)

    _rank, _size, _ = _world()
    _path = os.path.abspath(path)
    _file = open(_rank_file(_path, _rank), "w", encoding="utf-8")  # noqa: SIM115 - closed by stop()
    with _lock:
        _events = [{"name": "process_name", "ph": "M", "pid": _rank, "tid": 0, "args": {"name": f"rank {_rank}"}},
                   {"name": "process_sort_index", "ph": "M", "pid": _rank, "tid": 0, "args": {"sort_index": _rank}}]
    flush()
    _timer = threading.Event()
    threading.Thread(target=_flush_every, args=(_timer,), name="mpistrat-timeline-flush", daemon=True).start()
    atexit.register(stop)  # unregistered by stop(): a program that never calls stop() still merges


def _flush_every(stopped: threading.Event) -> None:
    while not stopped.wait(FLUSH_SECONDS):
        flush()


def flush() -> None:
    """Write the buffered events to this rank's file now (the timer, a full buffer, the abort path)."""
    global _events
    with _write_lock:  # writes in the order the buffers were taken
        with _lock:  # swap the buffer; recording goes on meanwhile
            events, out = _events, _file
            if not events or out is None:
                return
            _events = []
        try:
            out.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
            out.flush()
        except (OSError, ValueError):  # a closed file, a full disk: the timeline must not end the program
            pass


def _rank_file(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.jsonl"


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
    """Stop recording, write what is buffered and (rank 0) merge the ranks' files; returns the merged path.

    Rank 0 waits (at most ``timeout`` seconds) for the others and merges their files into ``path``:
    one process track per rank (pid = rank), one thread track per Python thread.
    """
    global _events, _file, _timer
    if _events is None:
        return None
    atexit.unregister(stop)
    if _timer is not None:
        _timer.set()
    flush()
    with _write_lock, _lock:
        _events = None
        out, _file, _timer = _file, None, None
    if out is not None:
        out.close()
    path = _path
    assert path is not None
    size = _size  # the job's size when recording started (after the program's MPI.Finalize the world says 1)
    _, _, comm = _world()
    all_here = _wait_all(comm, timeout) if comm is not None and size > 1 else size == 1
    if _rank != 0:
        return None
    merge_files(path, [_rank_file(path, r) for r in range(size)], complete=all_here)
    return path


def read_events(rank_file: str) -> list[dict]:
    """The events of one rank's file (``.jsonl``; a last line cut off by a kill is left out)."""
    events = []
    with open(rank_file, encoding="utf-8") as fh:
        for line in fh:
            try:
                events.append(json.loads(line))
            except ValueError:
                break  # the line a kill cut short: nothing after it was written
    return events


def merge_files(path: str, rank_files: list[str], complete: bool = True, remove: bool = True) -> dict:
    """Merge per-rank files into one Chrome-trace JSON at ``path`` (atomically); returns the merged dict.

    ``remove``: delete the rank files merged (a job's own stop does; ``timeline merge`` keeps them).
    """
    merged: list[dict] = []
    missing = []
    for f in rank_files:
        try:
            merged.extend(read_events(f))
        except OSError:
            missing.append(f)
    document = {"traceEvents": merged, "displayTimeUnit": "ms",
                "otherData": {"ranks": len(rank_files), "missing_rank_files": missing, "complete": complete}}
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(document, fh)
    os.replace(tmp, path)
    if remove:
        for f in rank_files:
            if f not in missing:
                os.remove(f)
    return document


def start_from_environment() -> None:
    """Start recording to ``MPISTRAT_TIMELINE`` if it is set and nothing records yet (strategies and
    communicators call it when made; the ``python -m mpistrat`` tools do not, so ``timeline merge``
    never overwrites the files a killed job left)."""
    if _events is None:
        path = config.get("timeline")
        if path:
            start(path)
