"""A bounded background producer thread: the engine of ``Dataset.prefetch`` and per-device prefetch."""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator

__all__ = ["BackgroundProducer", "ByteBudget", "live_producer_threads"]

_END = object()
_POLL = 0.05  # seconds between checks of the stop flag / the thread's life while blocked
_live: "weakref.WeakSet[BackgroundProducer]" = weakref.WeakSet()
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


def _is_terminal(item: Any) -> bool:
    return item is _END or isinstance(item, _Failure)


def _take_slot(slots: queue.SimpleQueue, stop: threading.Event) -> bool:
    """Wait for a free slot; False when told to stop."""
    while True:
        try:
            slots.get(timeout=_POLL)
        except queue.Empty:
            if stop.is_set():
                return False
            continue
        return not stop.is_set()


class ByteBudget:
    """A bound on the bytes of the items waiting for the consumer (shared by the thread and the consumer).

    The thread may always hold ``min_items`` items; beyond that it waits
    until the queued items and the next one fit in ``max_bytes``. Sizes are
    kept in hand-over order, so the consumer returns each item's bytes when it
    takes the item.
    """

    def __init__(self, max_bytes: int, min_items: int, sizeof: Callable[[Any], int]):
        self.max_bytes = int(max_bytes)
        self.min_items = max(1, int(min_items))
        self.sizeof = sizeof
        self.used = 0
        self.blocked = False  # the thread waits for the consumer to free bytes
        self._sizes: collections.deque = collections.deque()
        self._cond = threading.Condition()

    def acquire(self, item: Any, stop: threading.Event) -> bool:
        """Thread side: wait until ``item`` fits; False when told to stop."""
        size = self.sizeof(item)
        with self._cond:
            while (len(self._sizes) >= self.min_items and self.used + size > self.max_bytes
                   and not stop.is_set()):
                self.blocked = True
                self._cond.wait(_POLL)
            self.blocked = False
            if stop.is_set():
                return False
            self.used += size
            self._sizes.append(size)
        return True

    def release(self) -> None:
        """Consumer side: the oldest item was taken."""
        with self._cond:
            if self._sizes:
                self.used -= self._sizes.popleft()
            self._cond.notify()


def _run(make_iterator: Callable[[], Iterator], items: queue.SimpleQueue, slots: queue.SimpleQueue,
         stop: threading.Event, budget: "ByteBudget | None") -> None:
    it = None
    try:
        it = make_iterator()
        for item in it:
            if not _take_slot(slots, stop):
                return
            if budget is not None and not budget.acquire(item, stop):
                return
            items.put(item)
        items.put(_END)
    except BaseException as exc:  # handed to the consumer, raised there
        if not stop.is_set():
            items.put(_Failure(exc))
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass


class BackgroundProducer:
    """Iterate ``make_iterator()`` in a background thread, at most ``buffer_size`` items ahead
    (and, with a ``budget``, at most its bytes beyond its ``min_items``).

    A daemon thread pulls items from the iterator and hands them over through
    two C-level queues (``queue.SimpleQueue``): one carries the items, the
    other ``buffer_size`` slot tokens, and the thread takes a token before
    each item. So at most ``buffer_size`` items wait for the consumer (one
    more may be in the making), and a hand-over costs two C calls, no
    Python-level condition variable. The thread holds no reference to its
    owner, so an abandoned owner is garbage collected and stops it;
    ``close()`` stops the thread and joins it; an exception in the producer
    is handed to the consumer at the point it occurred; an ``atexit`` hook
    stops any producer still running so the interpreter never waits on one.

    The consumer methods (``next``, ``wait_ready``, ``peek``) are for one
    consumer thread; ``close`` may be called from anywhere.
    """

    def __init__(self, make_iterator: Callable[[], Iterator], buffer_size: int, name: str = "mpistrat-prefetch",
                 budget: "ByteBudget | None" = None):
        if buffer_size < 1:
            raise ValueError(f"BackgroundProducer needs buffer_size >= 1, got {buffer_size}")
        self._buffer_size = int(buffer_size)
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._slots: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self._buffer_size):
            self._slots.put(None)
        self._local: collections.deque = collections.deque()  # taken from the thread, not yet handed out
        self._local_data = 0  # data items (not the end or a failure) in _local
        self._stop = threading.Event()
        self._done = False
        self._budget = budget
        self._thread = threading.Thread(target=_run, args=(make_iterator, self._items, self._slots, self._stop, budget),
                                        name=name, daemon=True)
        self._thread.start()
        _live.add(self)
        _threads.add(self._thread)

    # -- the consumer side --------------------------------------------------------------
    def _receive(self, block: bool, deadline: float | None = None) -> bool:
        """Move one item from the thread into ``_local``; False when none came (non-blocking, or past
        ``deadline`` on the monotonic clock)."""
        while True:
            try:
                if not block:
                    item = self._items.get_nowait()
                elif deadline is None:
                    item = self._items.get(timeout=_POLL)
                else:
                    item = self._items.get(timeout=min(_POLL, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if not block or (deadline is not None and time.monotonic() >= deadline):
                    return False
                if not self._thread.is_alive() and self._items.empty():
                    self._local.append(_Failure(RuntimeError("the prefetch thread ended without a result")))
                    return True
                continue
            self._local.append(item)
            if not _is_terminal(item):
                self._local_data += 1
            return True

    def _terminal_received(self) -> bool:
        return bool(self._local) and _is_terminal(self._local[-1])

    def __iter__(self) -> "BackgroundProducer":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if not self._local:
            self._receive(block=True)
        item = self._local.popleft()
        if _is_terminal(item):
            self._finish()
            if isinstance(item, _Failure):
                raise item.exc
            raise StopIteration
        self._local_data -= 1
        if self._budget is not None:
            self._budget.release()
        self._slots.put(None)  # its slot is free again
        return item

    def wait_ready(self, count: int, patience: float | None = None) -> int:
        """Block until ``count`` items are ready, the buffer (or byte budget) is full, or the producer
        has finished; with ``patience`` (seconds), stop waiting for more than one item after that
        long. Return the number of items (not counting the end or a failure) that ``next`` will
        return without waiting."""
        if self._done:
            return 0
        count = min(int(count), self._buffer_size)
        deadline = None
        while self._local_data < count and not self._terminal_received():
            if self._local_data >= 1:
                if self._budget is not None and self._budget.blocked:
                    break  # the thread waits for us: everything it made is on its way
                if patience is not None:
                    deadline = deadline if deadline is not None else time.monotonic() + patience
                    if not self._receive(block=True, deadline=deadline):
                        break
                    continue
                if self._budget is not None:  # a poll at a time: the thread may block on the budget meanwhile
                    self._receive(block=True, deadline=time.monotonic() + _POLL)
                    continue
            self._receive(block=True)
        while self._receive(block=False):  # whatever else is ready, without waiting
            pass
        return self._local_data

    @property
    def depth(self) -> int:
        """The most items that may wait for the consumer (``buffer_size``, raised by ``grow``)."""
        return self._buffer_size

    def grow(self, extra: int) -> None:
        """Let the thread run ``extra`` more items ahead (consumer thread only)."""
        if extra > 0 and not self._done:
            self._buffer_size += extra
            for _ in range(extra):
                self._slots.put(None)

    def peek(self) -> Any:
        """The next item if one is ready (not taken; None when nothing is ready or at the end)."""
        if not self._local and not self._done:
            self._receive(block=False)
        item = self._local[0] if self._local else None
        return None if item is None or _is_terminal(item) else item

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
        self._slots.put(None)  # wakes a thread waiting for a slot: it sees the stop flag
        self._local.clear()
        self._local_data = 0
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        try:
            self._stop.set()
            self._slots.put(None)
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
