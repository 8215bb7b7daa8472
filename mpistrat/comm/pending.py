"""Collectives started now and finished later: one worker thread per communicator runs them in start order."""

from __future__ import annotations

import atexit
import collections
import threading
import weakref
from typing import Any, Callable

__all__ = ["Pending", "OrderedWorker", "run_now"]


class Pending:
    """A collective in flight (Horovod's handle): :meth:`result` waits for it, :meth:`done` never blocks.

    ``result()`` returns the call's result, or raises its error, every time it
    is asked and in every thread that asks.
    """

    __slots__ = ("_finished", "_value", "_error")

    def __init__(self) -> None:
        self._finished = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the call has finished (its result or error is ready); never blocks."""
        return self._finished.is_set()

    def result(self) -> Any:
        """Wait for the call to finish; return its result or raise its error."""
        if not self._finished.is_set():
            self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        """Wait for the call to finish; its error, or None."""
        if not self._finished.is_set():
            self._finished.wait()
        return self._error

    def _settle(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as exc:  # delivered by result(), in the caller's thread
            self._error = exc
        self._finished.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<Pending {state}>"


def run_now(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending:
    """``fn(*args, **kwargs)`` run in this thread, as a finished :class:`Pending` (its error included)."""
    pending = Pending()
    pending._settle(fn, args, kwargs)
    return pending


class OrderedWorker:
    """Runs submitted calls one at a time, in the order they were submitted, on one daemon thread.

    A communicator owns one (made at its first asynchronous call) and submits
    every asynchronous collective to it; every other collective of the
    communicator calls :meth:`drain` first. So collectives run in the order they
    were started, on every rank, and the communicator is used by one thread at a
    time: its worker while the worker has work, else the caller. A call that
    fails does not stop the calls queued after it: every rank queued the same
    ones, and each reports its own outcome.

    The worker's MPI calls run beside the caller's, so it needs
    ``MPI_THREAD_MULTIPLE`` (the communicator checks). At interpreter exit every
    worker finishes its queue before the agreement's exit notice counts the
    checks made (:func:`_finish_at_exit`).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: collections.deque = collections.deque()
        self._wake = threading.Condition(threading.Lock())
        self._last: Pending | None = None
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._stopped = False
        _register(self)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending:
        """Queue ``fn(*args, **kwargs)`` behind everything submitted before; its :class:`Pending`."""
        pending = Pending()
        with self._wake:
            if self._stopped:
                raise RuntimeError(f"{self._name}: no collective can be started after the communicator was closed")
            self._jobs.append((pending, fn, args, kwargs))
            self._last = pending
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._wake.notify()
        return pending

    def drain(self) -> None:
        """Wait until every call submitted so far has finished (at once in the worker itself)."""
        last = self._last
        if last is None or last._finished.is_set() or threading.get_ident() == self._ident:
            return
        last._finished.wait()

    def running_here(self) -> bool:
        """Whether the calling thread is this worker's."""
        return threading.get_ident() == self._ident

    def busy(self) -> bool:
        """Whether a submitted call has not finished yet."""
        last = self._last
        return last is not None and not last._finished.is_set()

    def stop(self) -> None:
        """Finish every submitted call, then end the thread (idempotent)."""
        self.drain()
        with self._wake:
            self._stopped = True
            self._wake.notify()
        thread = self._thread
        if thread is not None and thread.ident != threading.get_ident():
            thread.join()

    def _run(self) -> None:
        self._ident = threading.get_ident()
        jobs, wake = self._jobs, self._wake
        while True:
            with wake:
                while not jobs and not self._stopped:
                    wake.wait()
                if not jobs:
                    return
                pending, fn, args, kwargs = jobs.popleft()
            pending._settle(fn, args, kwargs)
            # Nothing of a finished call stays referenced while idle: a dropped communicator is collected.
            del pending, fn, args, kwargs

    def __repr__(self) -> str:
        return f"<OrderedWorker {self._name} queued={len(self._jobs)} busy={self.busy()}>"


_LIVE: "weakref.WeakSet[OrderedWorker]" = weakref.WeakSet()
_EXIT_HOOK: list[bool] = []


def _register(worker: OrderedWorker) -> None:
    _LIVE.add(worker)
    if not _EXIT_HOOK:
        # threading's exit hooks run in reverse order of registration, before atexit's: this one,
        # registered at the first worker (after the agreement guard registered its exit notice when the
        # communicator module was imported), runs before that notice, which counts the checks made.
        getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)
        _EXIT_HOOK.append(True)


def _finish_at_exit() -> None:
    """At exit: every worker finishes its queue (each call is bounded by its collective's timeout)."""
    for worker in list(_LIVE):
        worker.stop()
