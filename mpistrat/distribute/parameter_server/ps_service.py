"""A parameter-server rank's service loop: it holds variables and applies each request to them whole."""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from mpistrat.distribute.parameter_server.protocol import TAG_PS, TAG_REPLY, Runtime
from mpistrat.distribute.parameter_server.rpc import BUSY, wait_message

__all__ = ["serve_ps"]

_UPDATES = {"assign_add": np.add, "assign_sub": np.subtract}
_SEND_POLL_SECONDS = 0.5  # how long an answer is pushed before the ps turns to the next request


def _apply(store: dict, request: tuple) -> Any:
    """One request: ``("create", id, array)``, ``("read", id)``, ``("assign"|"assign_add"|"assign_sub", id,
    value, read_value)``; its answer's value. One request at a time: every update is atomic."""
    kind, var_id = request[0], request[1]
    if kind == "create":
        store[var_id] = np.array(request[2], copy=True)
        return None
    current = store.get(var_id)
    if current is None:
        raise KeyError(f"parameter server has no variable #{var_id}")
    if kind == "read":
        return current
    value, read_value = request[2], request[3]
    if kind == "assign":
        new = np.asarray(value, dtype=current.dtype)
    elif kind in _UPDATES:
        new = np.asarray(_UPDATES[kind](current, value)).astype(current.dtype, copy=False)
    else:
        raise ValueError(f"unknown parameter-server request {kind!r}")
    if new.shape != current.shape:
        raise ValueError(f"{kind} would change the variable's shape from {current.shape} to {new.shape}")
    store[var_id] = new if new is not value else new.copy()  # the answer may be pickled later: never aliased
    return store[var_id] if read_value else None


def serve_ps(rt: Runtime) -> None:
    """Answer requests until the chief says stop; each answer goes out before the next request is read."""
    store: dict[int, np.ndarray] = {}
    sends: list[Any] = []
    while True:
        got = wait_message(rt.comm, MPI.ANY_SOURCE, TAG_PS)
        assert got is not None  # no timeout: a ps waits for the job
        (seq, request), source = got
        if request[0] == "stop":
            _finish(sends)
            rt.comm.send((seq, ("ok", None)), dest=source, tag=TAG_REPLY)
            return
        try:
            answer: tuple = ("ok", _apply(store, request))
        except Exception as exc:  # told to the requester, which raises it
            answer = ("error", exc)
        # Sent while polling without sleep for a moment (a large answer moves in pieces); a requester that
        # timed out takes it at its next request, meanwhile this rank serves the others.
        sends[:] = [r for r in sends if not r.Test()]
        send = rt.comm.isend((seq, answer), dest=source, tag=TAG_REPLY)
        if not BUSY.until(send.Test, _SEND_POLL_SECONDS):
            sends.append(send)


def _finish(sends: list) -> None:
    """Answers still in flight at the stop: completed (their receivers drain them) or left to MPI."""
    for request in sends:
        if not request.Test():
            request.Free()
    sends.clear()

