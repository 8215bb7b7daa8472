"""Running a function on a rank's local replicas, and meeting points between them.

A ``ReplicaGroup`` runs replica 0 in the calling thread and owns one
persistent thread for each other local replica and a ``Rendezvous`` where replicas meet for collectives and
``merge_call``. A replica that raises aborts the group: every replica waiting
at a meeting point raises too, and ``run`` re-raises the original exception,
so a failure never leaves threads waiting for ever.

A group runs one step at a time. A ``strategy.run`` issued while one of the
group's replicas is inside a step (from a ``merge_call``'s merge function)
needs a group of its own: :meth:`ReplicaGroup.in_step` tells the strategy so.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

from mpistrat import context

__all__ = ["ReplicaGroup", "Rendezvous", "ReplicaAbortedError", "CollectiveOrderError"]


class ReplicaAbortedError(RuntimeError):
    """Raised in a replica when another replica of the same step failed."""


class CollectiveOrderError(RuntimeError):
    """Replicas called different collectives, or a different number of them."""


class Rendezvous:
    """A reusable meeting point for ``n`` replica threads.

    Each replica calls :meth:`meet` with its payload; the last to arrive runs
    ``fn(payloads)`` (a list in replica order) and every replica gets its
    entry of the returned list.
    """

    def __init__(self, n: int):
        self.n = n
        self._cond = threading.Condition()
        self._reset()

    def _reset(self) -> None:
        self._payloads: list[Any] = [None] * self.n
        self._kinds: list[str | None] = [None] * self.n
        self._arrived = 0
        self._finished = 0
        self._generation = 0
        self._outcome: tuple[Any, BaseException | None, int] = (None, None, -1)
        self._abort: BaseException | None = None

    def start_step(self) -> None:
        """Forget a previous step's state (called before each ``run``)."""
        with self._cond:
            self._reset()

    def abort(self, error: BaseException) -> None:
        """Wake every waiting replica with an error."""
        with self._cond:
            if self._abort is None:
                self._abort = error
            self._cond.notify_all()

    def replica_finished(self) -> None:
        """A replica's function returned; waiters may now be stranded."""
        with self._cond:
            self._finished += 1
            self._check_stranded()
            self._cond.notify_all()

    def _check_stranded(self) -> None:
        if self._arrived and self._arrived + self._finished == self.n and self._abort is None:
            waiting = [i for i, k in enumerate(self._kinds) if k is not None]
            kind = next(k for k in self._kinds if k is not None)
            self._abort = CollectiveOrderError(
                f"Replica(s) {waiting} wait in {kind} but the other replicas returned from the "
                "replica function without calling it: every replica must call the same collectives "
                "(all_reduce, all_gather, merge_call) in the same order."
            )

    def meet(self, local_id: int, kind: str, payload: Any, fn: Callable[[list], Sequence[Any]]) -> Any:
        """Deposit ``payload``; when all replicas are here, ``fn`` runs once; return our result."""
        with self._cond:
            if self._abort is not None:
                raise ReplicaAbortedError("Another replica failed in this step") from self._abort
            generation = self._generation
            self._payloads[local_id] = payload
            self._kinds[local_id] = kind
            self._arrived += 1
            if self._arrived == self.n:
                kinds = list(self._kinds)
                payloads = list(self._payloads)
                self._payloads = [None] * self.n
                self._kinds = [None] * self.n
                self._arrived = 0
                error: BaseException | None = None
                results: Any = None
                if len(set(kinds)) != 1:
                    error = CollectiveOrderError(
                        "Replicas called different collectives at the same point: "
                        + ", ".join(f"replica {i}: {k}" for i, k in enumerate(kinds))
                        + ". Every replica must call the same collectives in the same order."
                    )
                else:
                    try:
                        results = fn(payloads)
                    except BaseException as exc:  # re-raised in every replica below
                        error = exc
                self._outcome = (results, error, local_id)
                self._generation += 1
                self._cond.notify_all()
            else:
                self._check_stranded()
                while self._generation == generation and self._abort is None:
                    self._cond.wait()
                if self._generation == generation:
                    if isinstance(self._abort, CollectiveOrderError):
                        raise self._abort
                    raise ReplicaAbortedError(
                        f"Replica {local_id} stopped waiting in {kind}: another replica raised "
                        f"{type(self._abort).__name__}: {self._abort}") from self._abort
            results, error, runner = self._outcome
        if error is not None:
            if runner == local_id:
                raise error
            raise ReplicaAbortedError(
                f"{kind} failed in replica {runner}: {type(error).__name__}: {error}"
            ) from error
        return results[local_id]


class _ReplicaThread(threading.Thread):
    def __init__(self, group: "ReplicaGroup", local_id: int):
        super().__init__(name=f"mpistrat-replica-{local_id}", daemon=True)
        self.group = group
        self.local_id = local_id
        self.jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.group._run_one(self.local_id, *job)
            del job
            self.group._worker_done()  # do not keep the last step's function and arguments alive


class ReplicaGroup:
    """Runs a function once per local replica, each with its replica context and device."""

    def __init__(self, num_local: int):
        self.num_local = num_local
        self.rendezvous = Rendezvous(num_local)
        self._threads: list[_ReplicaThread] = []
        self._pending = 0
        self._lock_done = threading.Lock()
        self._all_done = threading.Event()
        self._results: list[Any] = [None] * num_local
        self._errors: list[BaseException | None] = [None] * num_local
        self._lock = threading.Lock()
        self._in_step = threading.local()

    def _ensure_threads(self) -> None:
        if not self._threads:
            self._threads = [_ReplicaThread(self, i) for i in range(1, self.num_local)]
            for t in self._threads:
                t.start()

    def in_step(self) -> bool:
        """Whether the calling thread is running one of this group's replicas right now."""
        return getattr(self._in_step, "active", False)

    def _run_one(self, local_id: int, fn: Callable, frames: list, device_scope: Any, call_args: tuple) -> None:
        saved = context.thread_stack()
        context.set_thread_stack(saved + list(frames))
        self._in_step.active = True
        try:
            with device_scope:
                self._results[local_id] = fn(*call_args[0], **call_args[1])
            self.rendezvous.replica_finished()
        except BaseException as exc:
            self._errors[local_id] = exc
            self.rendezvous.abort(exc)
        finally:
            self._in_step.active = False
            context.set_thread_stack(saved)

    def _worker_done(self) -> None:
        with self._lock_done:
            self._pending -= 1
            if self._pending == 0:
                self._all_done.set()

    def run(
        self,
        fn: Callable,
        frames_per_replica: Sequence[list],
        device_scopes: Sequence[Any],
        args_per_replica: Sequence[tuple],
    ) -> list:
        """Call ``fn`` once per replica; return the results in replica order.

        Replica 0 runs in the calling thread, the others in their persistent
        threads. ``frames_per_replica[i]`` is the context stack replica i runs
        with, ``device_scopes[i]`` a context manager making its device current,
        and ``args_per_replica[i]`` its ``(args, kwargs)``.
        """
        with self._lock:
            self.rendezvous.start_step()
            self._results = [None] * self.num_local
            self._errors = [None] * self.num_local
            if self.num_local > 1:
                self._ensure_threads()
                self._pending = self.num_local - 1
                self._all_done.clear()
                for i in range(1, self.num_local):
                    self._threads[i - 1].jobs.put((fn, frames_per_replica[i], device_scopes[i], args_per_replica[i]))
            self._run_one(0, fn, frames_per_replica[0], device_scopes[0], args_per_replica[0])
            if self.num_local > 1:
                self._all_done.wait()
            errors = [(i, e) for i, e in enumerate(self._errors) if e is not None]
            results, self._results = self._results, [None] * self.num_local
            self._errors = [None] * self.num_local
            if errors:
                # Prefer the error that started it over the consequences in other replicas.
                primary = [(i, e) for i, e in errors if not isinstance(e, ReplicaAbortedError)]
                _, exc = (primary or errors)[0]
                raise exc
            return results

    def close(self) -> None:
        """Stop the replica threads."""
        for t in self._threads:
            t.jobs.put(None)
        self._threads = []
