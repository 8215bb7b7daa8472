"""``ClusterCoordinator``: the chief schedules functions on free workers and gives back ``RemoteValue``s."""

from __future__ import annotations

import collections
import itertools
import sys
from typing import Any, Callable

from mpi4py import MPI

from mpistrat import nest
from mpistrat.distribute.parameter_server import protocol, rpc
from mpistrat.distribute.parameter_server.worker_service import PerWorkerRef
from mpistrat.errors import CancelledError

__all__ = ["ClusterCoordinator", "RemoteValue", "PerWorkerValues", "experimental_get_current_worker_index"]

_PENDING, _DONE, _FAILED, _CANCELLED = range(4)


class RemoteValue:
    """The value a scheduled function will return (TF's ``RemoteValue``): ``fetch()`` waits for it."""

    def __init__(self, coordinator: "ClusterCoordinator") -> None:
        self._coordinator = coordinator
        self._state = _PENDING
        self._value: Any = None

    def _set(self, state: int, value: Any) -> None:
        self._state, self._value = state, value

    def fetch(self) -> Any:
        """The function's return value, waiting for it; its error if it failed; ``CancelledError`` if it was
        cancelled (an earlier function failed before it started)."""
        while self._state == _PENDING:
            self._coordinator._progress(block=True)
        if self._state == _DONE:
            return self._value
        if self._state == _CANCELLED:
            raise CancelledError("The corresponding function is cancelled. Please reschedule the function.")
        raise self._value

    get = fetch  # TF's get() gives a tensor; here both give the value

    def _cancel(self) -> None:
        if self._state == _PENDING:
            self._set(_CANCELLED, None)


class PerWorkerValues:
    """One value per worker (TF's ``PerWorkerValues``): ``iter()`` of a per-worker dataset. Passed to a scheduled
    function, each worker gets its own."""

    def __init__(self, value_id: int) -> None:
        self._ref = PerWorkerRef(value_id)


PerWorkerValue = PerWorkerValues


class PerWorkerIterator(PerWorkerValues):
    """``iter()`` of a per-worker dataset: each worker's own iterator. ``next`` is called on it inside a scheduled
    function, where it is that worker's iterator; on the chief it has no element to give."""

    def __iter__(self) -> "PerWorkerIterator":
        return self

    def __next__(self) -> Any:
        raise TypeError("a per-worker iterator gives its elements on the workers: pass it to a function scheduled "
                        "with ClusterCoordinator.schedule and call next() on it there")


class PerWorkerDataset:
    """A dataset made on every worker by ``ClusterCoordinator.create_per_worker_dataset``; ``iter()`` gives a
    per-worker iterator."""

    def __init__(self, coordinator: "ClusterCoordinator", value_id: int) -> None:
        self._coordinator = coordinator
        self._id = value_id

    def __iter__(self) -> PerWorkerIterator:
        iterator_id = next(self._coordinator._ids)
        self._coordinator._on_every_worker(("iter", self._id, iterator_id), "iter(per-worker dataset)")
        return PerWorkerIterator(iterator_id)


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function (TF's
    ``tf.distribute.coordinator.experimental_get_current_worker_index``)."""
    index = protocol.runtime().worker_index
    if index is None:
        raise ValueError("Cannot retrieve the worker index. `get_worker_idx_and_num_workers` should be called "
                         "from within a tf.function being executed on a worker. This method should only be called "
                         "from either a dataset_fn that is passed into `distribute_datasets_from_function`, or a "
                         "tf.function that is scheduled by `ClusterCoordinator.schedule`.")
    return index


def _disallow_remote_value_as_input(structured: Any) -> None:
    def check(x: Any) -> Any:
        if isinstance(x, RemoteValue):
            raise ValueError("`tf.distribute.experimental.coordinator.RemoteValue` used as an input to scheduled "
                             "function is not yet supported.")
        return x

    nest.map_structure(check, structured)


def _as_ref(structured: Any) -> Any:
    return nest.map_structure(lambda x: x._ref if isinstance(x, PerWorkerValues) else x, structured)


class ClusterCoordinator:
    """Schedules functions on the workers of a ``ParameterServerStrategy`` (TF's ``ClusterCoordinator``).

    ``schedule(fn, args, kwargs)`` returns a :class:`RemoteValue` at once; ``fn`` runs on a free worker
    (its arguments and the objects it refers to travel by value; variables as handles to their ps).
    ``join()`` waits for every scheduled function; ``done()`` asks without waiting. An exception in a
    function is raised, once, by the next ``join``, ``done`` or ``schedule`` (its own type, the worker's
    traceback in a note); the functions not started by then are cancelled (their values raise
    ``CancelledError``). ``staleness`` (an mpistrat extension, stale-synchronous parallel): with ``s``, no
    worker starts its function ``k + s + 1`` before every worker has finished its function ``k``
    (``0``: synchronous rounds; None, the default: TF's asynchronous scheduling).
    """

    def __init__(self, strategy: Any, staleness: int | None = None) -> None:
        from mpistrat.distribute.parameter_server.strategy import ParameterServerStrategy  # noqa: PLC0415

        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError("Only `tf.distribute.experimental.ParameterServerStrategy` is supported to work with "
                             f"`tf.distribute.experimental.coordinator.ClusterCoordinator` currently, got {strategy!r}")
        if strategy._coordinator is not None:
            raise ValueError("ParameterServerStrategy already has a ClusterCoordinator: make one per strategy")
        if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"staleness must be None or an integer >= 0, got {staleness!r}")
        self.strategy = strategy
        self._rt = protocol.runtime()
        self._workers = strategy._roles.worker_ranks
        self._staleness = staleness
        self._queue: collections.deque = collections.deque()  # (id, payload, RemoteValue) not started
        self._running: dict[int, tuple[int, RemoteValue | None]] = {}  # worker rank -> (id, value) in flight
        self._started = dict.fromkeys(self._workers, 0)
        self._finished = dict.fromkeys(self._workers, 0)
        self._error: BaseException | None = None
        self._ids = itertools.count(1)
        strategy._coordinator = self

    # -- TF's API ------------------------------------------------------------------------
    def schedule(self, fn: Callable, args: Any = None, kwargs: Any = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for a free worker; its :class:`RemoteValue` at once."""
        if not callable(fn):
            raise ValueError("Function passed to `ClusterCoordinator.schedule` must be a callable object.")
        self._raise_pending()
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        _disallow_remote_value_as_input((args, kwargs))
        payload = protocol.dumps((fn, _as_ref(args), _as_ref(kwargs)))
        value = RemoteValue(self)
        self._queue.append((next(self._ids), payload, value))
        self._progress(block=False)
        return value

    def join(self) -> None:
        """Wait until every scheduled function has finished; raise the first error not raised yet."""
        while self._queue or self._running:
            self._progress(block=True)
        self._raise_pending()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises the first error not raised yet)."""
        self._progress(block=False)
        self._raise_pending()
        return not self._queue and not self._running

    def fetch(self, val: Any) -> Any:
        """``val`` with each :class:`RemoteValue` in it replaced by its fetched value."""
        return nest.map_structure(lambda x: x.fetch() if isinstance(x, RemoteValue) else x, val)

    def create_per_worker_dataset(self, dataset_fn: Callable) -> PerWorkerDataset:
        """``dataset_fn()`` called on every worker (its dataset that worker's); ``iter()`` of the result gives
        per-worker iterators to pass to scheduled functions."""
        if not callable(dataset_fn):
            raise ValueError("dataset_fn must be callable")
        value_id = next(self._ids)
        self._on_every_worker(("dataset", value_id, protocol.dumps(dataset_fn)), "create_per_worker_dataset")
        return PerWorkerDataset(self, value_id)

    # -- the loop -----------------------------------------------------------------------
    def _may_start(self, rank: int) -> bool:
        if self._staleness is None:
            return True
        return self._started[rank] <= min(self._finished.values()) + self._staleness

    def _progress(self, block: bool) -> None:
        """Collect the answers that arrived (waiting for one when ``block`` and work is out), then give
        queued functions to free workers."""
        comm = self._rt.comm
        while True:
            got = None
            if block and self._running:
                got = rpc.wait_message(comm, MPI.ANY_SOURCE, protocol.TAG_RESULT)
                block = False
            elif comm.iprobe(source=MPI.ANY_SOURCE, tag=protocol.TAG_RESULT):
                got = rpc.wait_message(comm, MPI.ANY_SOURCE, protocol.TAG_RESULT)
            if got is None:
                break
            self._answer(*got)
        for rank in self._workers:
            if not self._queue:
                break
            if rank not in self._running and self._may_start(rank):
                closure_id, payload, value = self._queue.popleft()
                comm.send(("run", closure_id, payload), dest=rank, tag=protocol.TAG_CONTROL)
                self._running[rank] = (closure_id, value)
                self._started[rank] += 1

    def _answer(self, answer: tuple, rank: int) -> None:
        status, _, payload = answer
        _, value = self._running.pop(rank)
        self._finished[rank] += 1
        if status == "done":
            if value is not None:
                value._set(_DONE, protocol.loads(payload))
            return
        error = _remote_error(payload, rank)
        if value is not None:
            value._set(_FAILED, error)
        if self._error is None:
            self._error = error
        while self._queue:  # TF: pending functions are cancelled once one has failed
            self._queue.popleft()[2]._cancel()

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _on_every_worker(self, order: tuple, what: str) -> None:
        """Send ``order`` to every worker (after the work queued before it) and wait for all to have done it."""
        self.join()
        comm = self._rt.comm
        for rank in self._workers:
            comm.send(order, dest=rank, tag=protocol.TAG_CONTROL)
            self._running[rank] = (0, None)
            self._started[rank] += 1
        while self._running:
            self._progress(block=True)
        self._raise_pending()

    def _drain(self) -> None:
        """At shutdown: drop the functions not started, wait for those running."""
        while self._queue:
            self._queue.popleft()[2]._cancel()
        while self._running:
            self._progress(block=True)


def _remote_error(payload: tuple, rank: int) -> BaseException:
    """The exception a worker sent: its own type where it unpickles, with the worker's traceback attached."""
    pickled, summary, text = payload
    error: BaseException
    try:
        error = protocol.loads(pickled) if pickled is not None else RuntimeError(summary)
    except Exception:
        error = RuntimeError(summary)
    note = f"raised in a scheduled function on MPI rank {rank}; its traceback there:\n{text}"
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:  # pragma: no cover - Python 3.10
        error.__cause__ = RuntimeError(note)
    return error
