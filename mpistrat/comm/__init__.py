"""Bytes between MPI ranks: the only door through which code outside ``mpistrat.comm`` reaches it.

Names are imported on first use, so that ``import mpistrat`` and the options load no MPI. Inside:
``communicator`` (plan -> agreement -> execute), ``agreement/``, ``transport/`` and ``runtime/``;
docs/internals.md draws the layers.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "RankCommunicator": "mpistrat.comm.communicator",
    "CommunicationOptions": "mpistrat.comm.options",
    "CommunicationImplementation": "mpistrat.comm.options",
    "reproducible_sum": "mpistrat.comm.deterministic",
    "CollectiveError": "mpistrat.comm.errors",
    "CollectiveMismatchError": "mpistrat.comm.errors",
    "CollectiveTimeoutError": "mpistrat.comm.errors",
    "CommunicatorBrokenError": "mpistrat.comm.errors",
    "PeerExitedError": "mpistrat.comm.errors",
    "Transport": "mpistrat.comm.transport.base",
    "TransportContext": "mpistrat.comm.transport.base",
    "AgreementHook": "mpistrat.comm.transport.base",
    "NO_AGREEMENT": "mpistrat.comm.transport.base",
    "register_transport": "mpistrat.comm.transport.table",
    "register_backend": "mpistrat.comm.transport.table",
    "node_layout": "mpistrat.comm.runtime.topology",
    "Waiter": "mpistrat.comm.runtime.waiter",
    "SPIN_POLLS": "mpistrat.comm.runtime.waiter",
    "OVERSUBSCRIBED_YIELDS": "mpistrat.comm.runtime.waiter",
    "release_dropped": "mpistrat.comm.runtime.lifetime",
    "install_abort_on_exception": "mpistrat.comm.runtime.abort",
    "abort_world": "mpistrat.comm.runtime.abort",
    "record_ranks": "mpistrat.comm.runtime.abort",
    "mpi_cuda_support": "mpistrat.comm.transport.cuda",
    "loaded_mpi_library": "mpistrat.comm.transport.cuda",
}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'mpistrat.comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
