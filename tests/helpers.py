"""Helpers the tests share: logical-CPU strategies, replica ids, variable copies, a bounded call, DLPack-only arrays."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

import mpistrat as ms

__all__ = ["make", "multi_worker", "rid", "copies", "run_all_reduce", "finishes", "DLPackOnly"]


def make(n: int = 2, **kwargs: Any) -> ms.MirroredStrategy:
    """A ``MirroredStrategy`` over ``n`` logical CPU devices (``/cpu:0`` ... ``/cpu:n-1``)."""
    return ms.MirroredStrategy([f"/cpu:{i}" for i in range(n)], **kwargs)


def multi_worker(local: int = 1) -> ms.MultiWorkerMirroredStrategy:
    """A ``MultiWorkerMirroredStrategy`` over every rank, each with ``local`` logical CPU replicas."""
    return ms.MultiWorkerMirroredStrategy(local_devices=[f"/cpu:{i}" for i in range(local)])


def rid() -> int:
    """The calling replica's ``replica_id_in_sync_group``."""
    return ms.get_replica_context().replica_id_in_sync_group


def copies(v: Any) -> list:
    """Each local copy of the distributed variable ``v`` as a Python list (or number)."""
    return [np.asarray(c.numpy()).tolist() for c in v.values]


def run_all_reduce(strategy: Any, op: Any, value: Any) -> Any:
    """``strategy.run`` of a step that all-reduces ``value`` with ``op`` (what a training step calls)."""
    return strategy.run(lambda: ms.get_replica_context().all_reduce(op, value))


def finishes(body: Callable[[], Any], timeout: float = 10.0) -> tuple[bool, dict]:
    """Run ``body`` in a daemon thread for at most ``timeout`` seconds.

    Returns whether it finished and a dict holding its ``"result"`` or its ``"error"``, so a
    deadlock fails the test instead of hanging the suite.
    """
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = body()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    return (not thread.is_alive()), box


class DLPackOnly:
    """An array that offers only DLPack (``__dlpack__`` and ``__dlpack_device__``), over a NumPy array.

    ``device`` overrides the ``(device_type, device_id)`` it reports.
    """

    def __init__(self, array: np.ndarray, device: tuple | None = None):
        self._array = array
        self._device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple:
        return self._device or self._array.__dlpack_device__()
