"""The transport table: which transports serve a communicator, per memory kind and implementation.

A new transport is one module (a :class:`~mpistrat.comm.transport.base.Transport` subclass) and one
:func:`register_transport` call.
"""

from __future__ import annotations

import importlib
from typing import Callable, Union

from mpi4py import MPI

from mpistrat.comm.options import CommunicationImplementation, CommunicationOptions
from mpistrat.comm.transport.base import Transport, TransportContext
from mpistrat.comm.transport.cuda import DeviceMpiTransport
from mpistrat.comm.transport.mpi import MpiTransport

__all__ = [
    "HOST",
    "DEVICE",
    "FACTORIES",
    "PREFERENCES",
    "Factory",
    "register_transport",
    "register_backend",
    "BackendFactory",
    "select",
]

HOST, DEVICE = "host", "device"

Factory = Callable[[TransportContext], Union[Transport, None]]

# A name -> a factory ``(TransportContext) -> Transport | None`` (None: it does not apply here, say one
# rank per node) or a ``"module:attr"`` string imported on first use (an ImportError skips it).
FACTORIES: dict[str, Factory | str] = {
    "shm-small": "mpistrat.comm.transport.shm.small:SmallShmTransport.create",
    "shm": "mpistrat.comm.transport.shm.allreduce:ShmTransport.create",
    "mpi": MpiTransport.create,
    "device-mpi": DeviceMpiTransport.create,
    "nccl": "mpistrat.comm.transport.nccl:NcclTransport.create",  # None unless every rank has a GPU of its own
}

# The fallback of each kind: it ends every list of that kind.
FALLBACK = {HOST: "mpi", DEVICE: "device-mpi"}

_I = CommunicationImplementation
# A row names, for one memory kind (HOST: NumPy buckets; DEVICE: CuPy buckets and other
# ``__cuda_array_interface__`` buffers) and one CommunicationImplementation, the transports to try in order.
PREFERENCES: dict[tuple[str, CommunicationImplementation], tuple[str, ...]] = {
    (HOST, _I.AUTO): ("shm-small", "shm", "mpi"),  # shm-small: one synchronisation, on one node
    (HOST, _I.SHM): ("shm", "mpi"),
    (HOST, _I.MPI): ("mpi",),
    (HOST, _I.RING): ("mpi",),
    (HOST, _I.NCCL): ("mpi",),  # NCCL moves device buffers; host buckets take MPI
    (DEVICE, _I.AUTO): ("nccl", "device-mpi"),
    (DEVICE, _I.SHM): ("device-mpi",),
    (DEVICE, _I.MPI): ("device-mpi",),
    (DEVICE, _I.RING): ("device-mpi",),
    (DEVICE, _I.NCCL): ("nccl", "device-mpi"),
}


def register_transport(name: str, factory: Factory | str, implementations: tuple[str, ...] = ("AUTO",),
                       kind: str = HOST) -> None:
    """Add a transport and put it first in ``kind``'s rows of the named implementations."""
    if kind not in FALLBACK:
        raise ValueError(f"kind must be {HOST!r} or {DEVICE!r}, got {kind!r}")
    FACTORIES[name] = factory
    for impl in implementations:
        key = (kind, CommunicationImplementation(impl.upper()))
        rest = PREFERENCES.get(key, (FALLBACK[kind],))
        PREFERENCES[key] = (name,) + tuple(n for n in rest if n != name)


BackendFactory = Callable[[MPI.Comm, CommunicationOptions], Union[Transport, None]]


def register_backend(name: str, factory: BackendFactory | str, implementations: tuple[str, ...] = ("AUTO",)) -> None:
    """:func:`register_transport` for host buffers with the earlier calling convention: the factory
    gets ``(comm, options)`` (the communicator's duplicate and its options) and returns a Transport."""

    def from_context(ctx: TransportContext) -> Transport | None:
        made = _resolve(factory)
        return None if made is None else made(ctx.comm, ctx.options)

    register_transport(name, from_context, implementations, HOST)


def _resolve(factory: Factory | str) -> Factory | None:
    if not isinstance(factory, str):
        return factory
    module, _, path = factory.partition(":")
    try:
        target: object = importlib.import_module(module)
        for attr in path.split("."):
            target = getattr(target, attr)
    except (ImportError, AttributeError):
        return None
    return target  # type: ignore[return-value]


def select(ctx: TransportContext, kind: str) -> list[Transport]:
    """The transports of ``kind`` for ``ctx.options.implementation``, in the order to try them.

    Collective over ``ctx.comm`` (a transport may allocate shared resources).
    The list ends with exactly one transport named as ``kind``'s fallback: the communicator gives
    each bucket to the first transport whose ``enabled`` is true, and the plain MPI transport of
    each kind takes what the others do not.
    """
    fallback = FALLBACK[kind]
    chosen: list[Transport] = []
    for name in PREFERENCES.get((kind, ctx.options.implementation), (fallback,)):
        factory = _resolve(FACTORIES[name]) if name in FACTORIES else None
        transport = factory(ctx) if factory is not None else None
        if transport is None:
            continue
        if not isinstance(transport, Transport):
            raise TypeError(f"transport factory {name!r} returned {type(transport).__name__}, not a Transport")
        chosen.append(transport)
    last = [t for t in chosen if t.name == fallback]
    if not last:
        factory = _resolve(FACTORIES[fallback])
        assert factory is not None
        last = [factory(ctx)]
    for extra in last[1:]:
        extra.close()
    return [t for t in chosen if t.name != fallback] + last[:1]
