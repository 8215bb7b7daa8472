"""MultiWorkerMirroredStrategy: synchronous replicas across MPI ranks, one rank per worker.

A worker's local replicas (its GPUs, else ``/cpu:0``, or ``local_devices``)
behave exactly as in MirroredStrategy; reductions add one cross-rank stage
(``RankCommunicator``). Global replica id = rank x local replicas + local id.
Rank 0 is the chief: variables start from its values and only it checkpoints.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpistrat import logs
from mpistrat.distribute.cross_device_ops import select_cross_device_ops
from mpistrat.distribute.strategy import Strategy, StrategyExtended

__all__ = ["MultiWorkerMirroredStrategy"]


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over MPI ranks (collective over the resolver's communicator).

    Args:
      cluster_resolver: an ``MPIClusterResolver`` or ``SlurmClusterResolver``;
        default: Slurm inside a matching Slurm step, else MPI over COMM_WORLD.
      communication_options: ``mpistrat.experimental.CommunicationOptions``
        (bucket size, timeout, implementation).
      local_devices: this rank's replica devices (mpistrat extension), e.g.
        ``["/cpu:0", "/cpu:1"]``; default: the GPUs bound to this rank, else
        ``["/cpu:0"]``. Every rank must have the same number.
    """

    def __init__(self, cluster_resolver: Any = None, communication_options: Any = None,
                 local_devices: Sequence[str] | None = None):
        from mpi4py import MPI  # noqa: PLC0415

        from mpistrat.cluster.resolvers import default_cluster_resolver  # noqa: PLC0415
        from mpistrat.comm import (  # noqa: PLC0415
            CommunicationOptions,
            RankCommunicator,
            install_abort_on_exception,
            record_ranks,
        )

        resolver = cluster_resolver if cluster_resolver is not None else default_cluster_resolver()
        comm = getattr(resolver, "comm", None) or MPI.COMM_WORLD
        options = communication_options if communication_options is not None else CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise ValueError(f"communication_options must be a CommunicationOptions, got {type(options).__name__}")
        if local_devices is None:
            local_devices = resolver.local_devices() if hasattr(resolver, "local_devices") else ["/cpu:0"]
        local_devices = list(local_devices)
        counts = comm.allgather(len(local_devices))
        if len(set(counts)) != 1:
            detail = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            raise ValueError(f"Every worker needs the same number of local devices; got {detail}")
        self._cluster_resolver = resolver
        communicator = RankCommunicator(comm, options)  # checks every rank's settings, on every rank
        logs.set_rank(comm.Get_rank(), comm.Get_size())  # mpistrat's log records name this rank
        record_ranks(comm)  # host and PID of every rank: MPISTRAT_PRINT_RANKS=1 prints them; named if one goes missing
        if comm.Get_size() > 1:
            install_abort_on_exception()
        super().__init__(StrategyExtended(
            self, local_devices,
            cross_device_ops=select_cross_device_ops(local_devices),
            communicator=communicator,
            worker_index=comm.Get_rank(),
            num_workers=comm.Get_size(),
            job="worker",
        ))

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver this strategy was built from."""
        return self._cluster_resolver

    def __deepcopy__(self, memo: dict) -> "MultiWorkerMirroredStrategy":
        """Refused, as TF's eager MultiWorkerMirroredStrategy does (its communicator is one collective resource)."""
        raise ValueError("MultiWorkerMirroredStrategy cannot be deep copied in eager mode.")

    def __repr__(self) -> str:
        ext = self._extended
        return (f"<MultiWorkerMirroredStrategy worker {ext._worker_index}/{ext._num_workers} "
                f"devices={list(ext._local_devices)}>")
