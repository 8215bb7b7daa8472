"""Where each rank lives: its node (real or pretend), the cross-node ranks and the machine's cores.

:func:`topology` makes the one split a communicator uses for everything: nodes (:func:`node_layout`),
the machine's ranks and cores, and how its waits poll (:class:`~mpistrat.comm.runtime.waiter.Waiter`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpi4py import MPI

from mpistrat import config
from mpistrat.comm.errors import allgather_checked
from mpistrat.comm.runtime.waiter import SPIN_POLLS, Waiter, default_yields, ranks_outnumber_cores

__all__ = ["NodeLayout", "Topology", "node_layout", "resolve_pretend_nodes", "topology"]


@dataclass
class NodeLayout:
    """A rank's place: its node's communicator and the cross-node communicator.

    ``cross_comm`` joins the ranks with the same ``local_rank`` on every node
    (``comm.Split(color=local_rank)``), the communicator of hierarchical
    collectives.
    """

    comm: MPI.Comm
    node_comm: MPI.Comm
    cross_comm: MPI.Comm
    node_index: int
    num_nodes: int
    local_rank: int
    local_size: int
    pretend: bool

    def free(self) -> None:
        """Free the communicators this layout created."""
        for c in (self.cross_comm, self.node_comm):
            if c != MPI.COMM_NULL:
                c.Free()
        self.node_comm = self.cross_comm = MPI.COMM_NULL


def resolve_pretend_nodes(size: int, pretend_nodes: int | None) -> int | None:
    """The pretend node count for a communicator of ``size`` ranks (no MPI call): ``pretend_nodes``,
    else ``MPISTRAT_PRETEND_NODES`` capped at ``size``; ValueError for an explicit count above ``size``."""
    if pretend_nodes is None:
        env = config.get("pretend_nodes")
        return None if env is None else min(env, size)  # the setting applies to sub-communicators too
    if pretend_nodes > size:
        raise ValueError(f"pretend_nodes={pretend_nodes} is more than the {size} ranks of the communicator")
    return pretend_nodes


def node_layout(comm: MPI.Comm | None = None, pretend_nodes: int | None = None) -> NodeLayout:
    """Split ``comm`` into nodes (collective over ``comm``).

    By shared memory (``Split_type(COMM_TYPE_SHARED)``), or, with pretend nodes, into contiguous
    blocks of ranks, each treated as a node, so multi-node paths run on one machine. With
    ``pretend_nodes=K`` (default from ``MPISTRAT_PRETEND_NODES``, capped
    at the communicator's size), rank r of n is on pretend node ``r * K // n``;
    an explicit K must not exceed n.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    error = None
    try:
        pretend_nodes = resolve_pretend_nodes(size, pretend_nodes)
    except ValueError as exc:
        error = exc
    # Every rank agrees on the count (a rank raising alone would leave the others in the split).
    pretend_nodes = allgather_checked(comm, pretend_nodes, error, "MPISTRAT_PRETEND_NODES")[0]
    if pretend_nodes is not None:
        color = rank * pretend_nodes // size
        node_comm = comm.Split(color=color, key=rank)
    else:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    # Node index: number the nodes by their lowest rank.
    leaders = comm.allgather(rank if local_rank == 0 else -1)
    leader_ranks = sorted(r for r in leaders if r >= 0)
    my_leader = node_comm.bcast(rank if local_rank == 0 else None, root=0)
    node_index = leader_ranks.index(my_leader)
    cross_comm = comm.Split(color=local_rank, key=node_index)
    return NodeLayout(
        comm=comm,
        node_comm=node_comm,
        cross_comm=cross_comm,
        node_index=node_index,
        num_nodes=len(leader_ranks),
        local_rank=local_rank,
        local_size=local_size,
        pretend=pretend_nodes is not None,
    )


@dataclass
class Topology:
    """A communicator's one split: its nodes, and the machine its waits share cores on.

    ``machine_size``: the ranks of ``comm`` on this machine (pretend nodes share
    it); ``oversubscribed``: they outnumber the cores they may run on together.
    """

    layout: NodeLayout
    machine_size: int
    oversubscribed: bool
    waiter: Waiter

    @property
    def one_machine(self) -> bool:
        """Whether every rank of the communicator is on this machine."""
        return self.machine_size == self.layout.comm.Get_size()

    def free(self) -> None:
        """Free the layout's communicators."""
        self.layout.free()


def topology(comm: MPI.Comm, pretend_nodes: int | None = None) -> Topology:
    """Split ``comm`` once (collective): its node layout, the machine's ranks and cores, the waiter."""
    layout = node_layout(comm, pretend_nodes)
    if not layout.pretend:  # the node is the machine
        machine_size, oversubscribed = layout.local_size, ranks_outnumber_cores(layout.node_comm)
    else:
        machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            machine_size, oversubscribed = machine.Get_size(), ranks_outnumber_cores(machine)
        finally:
            machine.Free()
    # The machine's ranks, not its pretend node's, compete for its cores: a rank spins only where every
    # rank has a core of its own (ranks bound one to a core each included), so a spin never keeps the
    # rank it waits for off the CPU.
    waiter = Waiter(0 if oversubscribed else SPIN_POLLS, default_yields(oversubscribed))
    return Topology(layout, machine_size, oversubscribed, waiter)
