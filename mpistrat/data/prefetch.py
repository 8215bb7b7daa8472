"""A bounded background producer: the engine of ``Dataset.prefetch`` and per-device prefetch.

A daemon thread pulls items from an iterator and puts them into a bounded
queue. The thread holds no reference to its owner, so an abandoned owner is
garbage collected and closes it; ``close()`` stops the thread and joins it; an
exception in the producer is handed to the consumer at the point it occurred;
an ``atexit`` hook stops any producer still running so the interpreter never
waits on one at exit.
"""

from __future__ import annotations

import atexit
import collections
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

__all__ = ["BackgroundProducer", "live_producer_threads"]

_END = object()
_POLL = 0.05
_live: "weakref.WeakSet[BackgroundProducer]" = weakref.WeakSet()
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


class _Empty(Exception):
    pass


class _Buffer:
    """A FIFO bounded by an item count and (optionally) a byte count; one item always fits."""

    def __init__(self, max_items: int, max_bytes: Optional[int], size_fn: Optional[Callable[[Any], int]]):
        self._cv = threading.Condition()
        self._items: collections.deque = collections.deque()
        self._bytes = 0
        self._max_items, self._max_bytes, self._size_fn = max_items, max_bytes, size_fn
        self._terminal = False  # the last item is the end marker or a failure
        self._blocked = False  # the producer waits for room

    def put(self, item: Any, stop: threading.Event) -> bool:
        size = self._size_fn(item) if self._size_fn is not None and not isinstance(item, _Failure) and item is not _END else 0
        with self._cv:
            while not stop.is_set() and self._items and (
                len(self._items) >= self._max_items
                or (self._max_bytes is not None and self._bytes + size > self._max_bytes)
            ):
                if not self._blocked:
                    self._blocked = True
                    self._cv.notify_all()
                self._cv.wait(_POLL)
            self._blocked = False
            if stop.is_set():
                return False
            self._terminal = item is _END or isinstance(item, _Failure)
            self._items.append((item, size))
            self._bytes += size
            self._cv.notify_all()
            return True

    def get(self, timeout: Optional[float]) -> Any:
        with self._cv:
            if not self._items:
                if timeout == 0:
                    raise _Empty
                self._cv.wait(timeout)
                if not self._items:
                    raise _Empty
            item, size = self._items.popleft()
            self._bytes -= size
            if not self._items:
                self._terminal = False
            self._cv.notify_all()
            return item

    def peek(self) -> Any:
        """The first item without taking it (None when empty)."""
        with self._cv:
            return self._items[0][0] if self._items else None

    def wait_for(self, count: int, alive: Callable[[], bool]) -> int:
        """Wait until ``count`` data items are ready, the producer is blocked on a full buffer or has
        finished; return how many data items (not end/failure markers) are ready."""
        with self._cv:
            while True:
                ready = len(self._items) - (1 if self._terminal else 0)
                if ready >= count or self._blocked or self._terminal or not alive():
                    return ready
                self._cv.wait(_POLL)

    def empty(self) -> bool:
        with self._cv:
            return not self._items

    def clear(self) -> None:
        with self._cv:
            self._items.clear()
            self._bytes = 0
            self._cv.notify_all()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _run(make_iterator: Callable[[], Iterator], q: _Buffer, stop: threading.Event) -> None:
    it = None

    def put(item: Any) -> bool:
        return q.put(item, stop)

    try:
        it = make_iterator()
        for item in it:
            if not put(item):
                return
        put(_END)
    except BaseException as exc:  # handed to the consumer, raised there
        put(_Failure(exc))
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass


class BackgroundProducer:
    """Iterate ``make_iterator()`` in a background thread, at most ``buffer_size`` items ahead."""

    def __init__(self, make_iterator: Callable[[], Iterator], buffer_size: int, name: str = "mpistrat-prefetch",
                 max_bytes: Optional[int] = None, size_fn: Optional[Callable[[Any], int]] = None):
        if buffer_size < 1:
            raise ValueError(f"BackgroundProducer needs buffer_size >= 1, got {buffer_size}")
        self._queue = _Buffer(buffer_size, max_bytes, size_fn)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_run, args=(make_iterator, self._queue, self._stop), name=name, daemon=True)
        self._thread.start()
        _live.add(self)
        _threads.add(self._thread)

    def __iter__(self) -> "BackgroundProducer":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except _Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finish()
                    raise RuntimeError("the prefetch thread ended without a result") from None
        return self._unwrap(item)

    def wait_ready(self, count: int) -> int:
        """Block until ``count`` items are ready, the buffer is full, or the producer has finished;
        return the number of items (not counting the end or a failure) that ``next`` will return
        without waiting."""
        if self._done:
            return 0
        return self._queue.wait_for(count, self._thread.is_alive)

    def peek(self) -> Any:
        """The next item if one is ready (not taken; None when nothing is ready or at the end)."""
        item = self._queue.peek()
        return None if item is _END or isinstance(item, _Failure) else item

    def _unwrap(self, item: Any) -> Any:
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish()
            raise item.exc
        return item

    def _finish(self) -> None:
        self._done = True
        self.close()

    @property
    def thread(self) -> threading.Thread:
        """The producer thread (for tests and diagnostics)."""
        return self._thread

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer thread, drop buffered items and wait for the thread to end."""
        self._done = True
        self._stop.set()
        self._queue.clear()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:
            pass


def live_producer_threads() -> list:
    """The producer threads still running (tests use this to check nothing leaks)."""
    return [t for t in list(_threads) if t.is_alive()]


@atexit.register
def _stop_all() -> None:
    for producer in list(_live):
        producer._stop.set()
    for producer in list(_live):
        producer.close(timeout=1.0)
