"""A worker rank's service loop: it runs the functions the chief schedules and keeps its per-worker datasets."""

from __future__ import annotations

import traceback
from typing import Any

from mpistrat import nest
from mpistrat.distribute.parameter_server.protocol import TAG_CONTROL, TAG_RESULT, Runtime, dumps, loads
from mpistrat.distribute.parameter_server.rpc import wait_message

__all__ = ["serve_worker", "PerWorkerRef"]


class PerWorkerRef:
    """How a per-worker value travels to a worker: its id; the worker puts its own element in its place."""

    def __init__(self, value_id: int) -> None:
        self.value_id = value_id


def _resolve(structure: Any, values: dict) -> Any:
    def one(x: Any) -> Any:
        if isinstance(x, PerWorkerRef):
            if x.value_id not in values:
                raise ValueError(f"per-worker value #{x.value_id} does not exist on this worker")
            return values[x.value_id]
        return x

    return nest.map_structure(one, structure)


def _error_payload(exc: BaseException) -> tuple:
    """An exception as it travels: pickled where it can be, its type name and text otherwise, and the traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled = dumps(exc)
        loads(pickled)
    except Exception:
        pickled = None
    return pickled, f"{type(exc).__name__}: {exc}", text


def serve_worker(rt: Runtime, worker_index: int) -> None:
    """Run the chief's orders in the order they were sent, until it says stop: ``("run", id, payload)``,
    ``("dataset", id, payload)``, ``("iter", dataset id, iterator id)``, ``("stop",)``. Every order is answered."""
    values: dict[int, Any] = {}  # per-worker datasets and iterators, by id
    while True:
        got = wait_message(rt.comm, 0, TAG_CONTROL)
        assert got is not None
        order, _ = got
        kind = order[0]
        if kind == "stop":
            rt.comm.send(("stopped", None, None), dest=0, tag=TAG_RESULT)
            return
        try:
            if kind == "run":
                fn, args, kwargs = loads(order[2])
                args, kwargs = _resolve(args, values), _resolve(kwargs, values)
                rt.worker_index = worker_index
                try:
                    with rt.strategy.scope():  # in the strategy's scope, as the chief schedules it
                        result = fn(*args, **kwargs)
                finally:
                    rt.worker_index = None
                answer: tuple = ("done", order[1], dumps(result))
            elif kind == "dataset":
                values[order[1]] = loads(order[2])()
                answer = ("done", order[1], dumps(None))
            elif kind == "iter":
                values[order[2]] = iter(values[order[1]])
                answer = ("done", order[2], dumps(None))
            else:
                raise ValueError(f"unknown order {kind!r} from the chief")
        except BaseException as exc:  # the chief raises it (its type, this traceback) at its next join/done/schedule
            # SystemExit from a function is its error, not the server's end: the chief would wait for it.
            answer = ("error", order[1], _error_payload(exc))
            if isinstance(exc, KeyboardInterrupt):
                rt.comm.send(answer, dest=0, tag=TAG_RESULT)
                raise
        rt.comm.send(answer, dest=0, tag=TAG_RESULT)
