"""Running one step on a rank's local replicas: a thread per replica, meeting at a ``Rendezvous``.

The meeting's function (a merge function, a reduction) always runs in replica
0's thread, the one that called ``strategy.run``, so no replica thread but
that one calls MPI (an asynchronous reduction runs on the communicator's own
worker); a replica that raises aborts the whole step. Reductions started
asynchronously in a step are finished when its replicas have returned.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

from mpistrat.distribute import context
from mpistrat.distribute.in_flight import InFlightReduction

__all__ = ["ReplicaGroup", "Rendezvous", "ReplicaAbortedError", "CollectiveOrderError"]

# How long an interrupted step waits for the other replicas before the group is rebuilt.
INTERRUPT_GRACE_SECONDS = 1.0


class ReplicaAbortedError(RuntimeError):
    """Raised in a replica when another replica of the same step failed."""


class CollectiveOrderError(RuntimeError):
    """Replicas called different collectives, or a different number of them."""


class Rendezvous:
    """A reusable meeting point for ``n`` replica threads.

    Each replica calls :meth:`meet` with its payload; once all are there,
    replica 0 runs its ``fn(payloads)`` (a list in replica order) and every
    replica gets its entry of the returned list.
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
        self._outcome: tuple[Any, BaseException | None] = (None, None)
        self._abort: BaseException | None = None
        self._meeting = False  # replica 0 is running a meeting's function (holding the lock)
        self.in_flight: list[InFlightReduction] = []  # reductions the step started asynchronously

    def start_step(self) -> None:
        """Forget a previous step's state (called before each ``run``)."""
        with self._cond:
            self._reset()

    def end_step(self) -> None:
        """Drop the step's outcome and error once every replica has returned.

        The replica threads keep the group, and so this rendezvous, alive: an
        outcome or error kept after the step (merge results often hold
        variables, tracebacks hold replica contexts, both hold the strategy)
        would keep the strategy from ever being garbage-collected, and with it
        its threads and communicator.
        """
        with self._cond:
            self._reset()

    def track(self, reduction: InFlightReduction) -> None:
        """Keep a reduction started in this step (by the meeting's function) until the step ends."""
        self.in_flight.append(reduction)

    def finish_in_flight(self) -> None:
        """Wait for the step's reductions still in flight; raise the first error no replica was given."""
        reductions, self.in_flight = self.in_flight, []
        first = None
        for reduction in reductions:  # every one, so none is left running past the step
            error = reduction.unread_error()
            if error is not None and first is None:
                first = error
        if first is not None:
            first.add_note("Raised at the end of strategy.run: the experimental_all_reduce_async that failed "
                           "was never asked for its result().")
            raise first

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
        if 0 < self._arrived < self.n and self._arrived + self._finished == self.n and self._abort is None:
            waiting = [i for i, k in enumerate(self._kinds) if k is not None]
            kind = next(k for k in self._kinds if k is not None)
            self._abort = CollectiveOrderError(
                f"Replica(s) {waiting} wait in {kind} but the other replicas returned from the "
                "replica function without calling it: every replica must call the same collectives "
                "(all_reduce, all_gather, merge_call, variable creation) in the same order."
            )

    def _stopped_waiting(self, local_id: int, kind: str) -> BaseException:
        if isinstance(self._abort, CollectiveOrderError):
            return self._abort
        return ReplicaAbortedError(
            f"Replica {local_id} stopped waiting in {kind}: another replica raised "
            f"{type(self._abort).__name__}: {self._abort}")

    def _run_meeting(self, fn: Callable[[list], Sequence[Any]]) -> None:
        """Replica 0, with everyone here: run ``fn`` and publish the outcome (lock held)."""
        kinds, payloads = self._kinds, self._payloads
        self._payloads = [None] * self.n
        self._kinds = [None] * self.n
        self._arrived = 0
        results: Any = None
        error: BaseException | None = None
        if any(k != kinds[0] for k in kinds):
            error = CollectiveOrderError(
                "Replicas called different collectives at the same point: "
                + ", ".join(f"replica {i}: {k}" for i, k in enumerate(kinds))
                + ". Every replica must call the same collectives in the same order."
            )
        else:
            self._meeting = True
            try:
                results = fn(payloads)
            except BaseException as exc:  # re-raised in every replica
                error = exc
            finally:
                self._meeting = False
        self._outcome = (results, error)
        self._generation += 1
        self._cond.notify_all()

    def meet(self, local_id: int, kind: str, payload: Any, fn: Callable[[list], Sequence[Any]]) -> Any:
        """Deposit ``payload``; when all replicas are here replica 0 runs its ``fn``; return our result."""
        if self.n == 1:  # alone: nobody to wait for or wake (only the calling thread uses this rendezvous)
            return fn([payload])[0]
        with self._cond:
            if self._meeting:  # only the thread running the meeting's function holds the lock now
                raise CollectiveOrderError(
                    f"{kind} was called from inside the function of another meeting of the replicas (a merge "
                    "function or a reduction): the other replicas wait in that meeting, so they cannot join this "
                    "one. Call collectives from the replica function itself.")
            if self._abort is not None:
                raise ReplicaAbortedError("Another replica failed in this step") from self._abort
            generation = self._generation
            self._payloads[local_id] = payload
            self._kinds[local_id] = kind
            self._arrived += 1
            self._check_stranded()
            if local_id == 0:
                while self._arrived < self.n and self._abort is None:
                    self._cond.wait()
                if self._arrived < self.n:
                    raise self._stopped_waiting(local_id, kind) from self._abort
                self._run_meeting(fn)
            else:
                if self._arrived == self.n:
                    self._cond.notify_all()  # replica 0 may be waiting for us
                while self._generation == generation and self._abort is None:
                    self._cond.wait()
                if self._generation == generation:
                    raise self._stopped_waiting(local_id, kind) from self._abort
            results, error = self._outcome
        if error is not None:
            if local_id == 0:
                raise error
            raise ReplicaAbortedError(f"{kind} failed in replica 0: {type(error).__name__}: {error}") from error
        return results[local_id]


class _Step:
    """One step's outcome: per-replica results and errors, the count of replicas still running, and the
    rendezvous its replicas meet at (a replica thread left behind by an interrupt reports to its own step's,
    never to the one a rebuilt group uses next)."""

    def __init__(self, num_local: int):
        self.rendezvous = Rendezvous(num_local)
        self.results: list[Any] = [None] * num_local
        self.errors: list[BaseException | None] = [None] * num_local
        self.pending = 0
        self.lock = threading.Lock()
        self.all_done = threading.Event()

    def reset(self, pending: int) -> None:
        n = len(self.results)
        self.results = [None] * n
        self.errors = [None] * n
        self.pending = pending
        self.all_done.clear()

    def worker_done(self) -> None:
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.all_done.set()


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
            step = job[0]
            self.group._run_one(self.local_id, *job)
            del job  # do not keep the last step's function and arguments alive
            step.worker_done()


class ReplicaGroup:
    """Runs a function once per local replica, each with its replica context and device.

    Replica 0 runs in the calling thread; the group owns one persistent
    thread for each other local replica and the ``Rendezvous`` where they
    meet for collectives and ``merge_call``. As tf.distribute runs merge
    functions in the main thread, the meeting's function runs in replica 0's
    thread: its device is current there, and MPI is only called from it.

    A replica that raises aborts the group: every replica waiting at a
    meeting point raises too, and ``run`` re-raises the original exception,
    so a failure never leaves threads waiting for ever. An exception that
    reaches the calling thread while it waits for the other replicas (Ctrl-C)
    aborts the step too; if the replicas do not wind down at once, the group
    starts fresh threads and a fresh meeting point for the next step, so
    nothing of the interrupted step leaks into it.

    A group runs one step at a time. A ``strategy.run`` issued while one of
    the strategy's replicas is inside a step (from a ``merge_call``'s merge
    function) needs a group of its own: :meth:`in_step` tells the strategy
    so, for every group sharing the strategy's ``step_marker``.
    """

    def __init__(self, num_local: int, step_marker: threading.local | None = None):
        self.num_local = num_local
        self._threads: list[_ReplicaThread] = []
        self._step = _Step(num_local)
        self.rendezvous: Rendezvous = self._step.rendezvous  # where the next (or current) step's replicas meet
        self._lock = threading.Lock()
        self._marker = step_marker if step_marker is not None else threading.local()

    def _ensure_threads(self) -> None:
        if not self._threads:
            self._threads = [_ReplicaThread(self, i) for i in range(1, self.num_local)]
            for t in self._threads:
                t.start()

    def in_step(self) -> bool:
        """Whether the calling thread is running a replica of a group sharing this group's marker."""
        return getattr(self._marker, "depth", 0) > 0

    def _run_one(self, local_id: int, step: _Step, fn: Callable, frames: list, device_scope: Any,
                 call_args: tuple) -> None:
        try:
            step.results[local_id] = self._call_in_replica(fn, frames, device_scope, call_args)
            step.rendezvous.replica_finished()
        except BaseException as exc:
            step.errors[local_id] = exc
            step.rendezvous.abort(exc)

    def _wait_for_replicas(self, step: _Step) -> None:
        try:
            step.all_done.wait()
        except BaseException as exc:  # e.g. KeyboardInterrupt in the calling thread
            step.rendezvous.abort(exc)
            if not step.all_done.wait(INTERRUPT_GRACE_SECONDS):
                self._rebuild()
            raise

    def _rebuild(self) -> None:
        """Leave the interrupted step to its threads; the next step gets fresh threads and state."""
        self.close()
        self._step = _Step(self.num_local)
        self.rendezvous = self._step.rendezvous

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
        with (its ReplicaContext must meet at ``self.rendezvous``),
        ``device_scopes[i]`` a context manager making its device current, and
        ``args_per_replica[i]`` its ``(args, kwargs)``.
        """
        with self._lock:
            if self.num_local == 1:
                return [self._run_lone(fn, frames_per_replica[0], device_scopes[0], args_per_replica[0])]
            step = self._step
            step.rendezvous.start_step()
            step.reset(self.num_local - 1)
            if self.num_local > 1:
                self._ensure_threads()
                for i in range(1, self.num_local):
                    self._threads[i - 1].jobs.put(
                        (step, fn, frames_per_replica[i], device_scopes[i], args_per_replica[i]))
            self._run_one(0, step, fn, frames_per_replica[0], device_scopes[0], args_per_replica[0])
            if self.num_local > 1:
                self._wait_for_replicas(step)
            errors = [(i, e) for i, e in enumerate(step.errors) if e is not None]
            results = step.results
            try:
                if not errors and step.rendezvous.in_flight:
                    step.rendezvous.finish_in_flight()
            finally:
                step.reset(0)
                step.rendezvous.end_step()  # every replica has returned: nobody reads it any more
            if errors:
                # Prefer the error that started it over the consequences in other replicas.
                primary = [(i, e) for i, e in errors if not isinstance(e, ReplicaAbortedError)]
                _, exc = (primary or errors)[0]
                raise exc
            return results

    def run_alone(self, fn: Callable, frame: Any, device_scope: Any, args: Sequence[Any], kwargs: dict) -> Any:
        """:meth:`run` for a group of one replica: ``fn(*args, **kwargs)`` in the calling thread with
        ``frame`` pushed and ``device_scope`` (None: no device to make current) entered; its result,
        not a list."""
        with self._lock:
            return self._run_lone(fn, (frame,), device_scope, (args, kwargs))

    def _run_lone(self, fn: Callable, frames: Sequence[Any], device_scope: Any, call_args: tuple) -> Any:
        """The one replica's call, then the step's reductions still in flight are finished (their unread
        errors raised); a failed call leaves them to the communicator's order."""
        rendezvous = self._step.rendezvous
        try:
            result = self._call_in_replica(fn, frames, device_scope, call_args)
        except BaseException:
            rendezvous.in_flight = []
            raise
        if rendezvous.in_flight:
            rendezvous.finish_in_flight()
        return result

    def _call_in_replica(self, fn: Callable, frames: Sequence[Any], device_scope: Any, call_args: tuple) -> Any:
        """Call ``fn(*call_args[0], **call_args[1])`` in this thread with ``frames`` on its context stack
        and ``device_scope`` (None: no device to make current) entered; the stack is as before after."""
        stack = context.thread_stack()
        depth = len(stack)
        stack.extend(frames)
        marker = self._marker
        marker.depth = getattr(marker, "depth", 0) + 1
        try:
            if device_scope is None:
                return fn(*call_args[0], **call_args[1])
            with device_scope:
                return fn(*call_args[0], **call_args[1])
        finally:
            marker.depth -= 1
            del stack[depth:]

    def close(self) -> None:
        """Stop the replica threads (each after its current job)."""
        for t in self._threads:
            t.jobs.put(None)
        self._threads = []
