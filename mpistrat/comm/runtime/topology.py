"""Where ranks live: node communicators, local rank, node index.

``node_layout(comm)`` splits a communicator by shared memory
(``Split_type(COMM_TYPE_SHARED)``). For testing multi-node logic on one
machine, ``pretend_nodes=K`` (or ``MPISTRAT_PRETEND_NODES=K``) instead cuts the
ranks into K contiguous blocks, each treated as a node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mpi4py import MPI

__all__ = ["NodeLayout", "node_layout", "pretend_nodes_from_env"]


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

    @property
    def uniform(self) -> bool:
        """Whether every node has the same number of ranks."""
        return self.comm.Get_size() == self.local_size * self.num_nodes and self._sizes_equal

    _sizes_equal: bool = True

    def free(self) -> None:
        """Free the communicators this layout created."""
        for c in (self.cross_comm, self.node_comm):
            if c != MPI.COMM_NULL:
                c.Free()
        self.node_comm = self.cross_comm = MPI.COMM_NULL


def pretend_nodes_from_env() -> int | None:
    """``MPISTRAT_PRETEND_NODES`` as an int, or None when unset/empty."""
    text = os.environ.get("MPISTRAT_PRETEND_NODES", "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"MPISTRAT_PRETEND_NODES must be a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"MPISTRAT_PRETEND_NODES must be a positive integer, got {value}")
    return value


def resolve_pretend_nodes(size: int, pretend_nodes: int | None) -> int | None:
    """The pretend node count for a communicator of ``size`` ranks (no MPI call): ``pretend_nodes``,
    else ``MPISTRAT_PRETEND_NODES`` capped at ``size``; ValueError for an explicit count above ``size``."""
    if pretend_nodes is None:
        env = pretend_nodes_from_env()
        return None if env is None else min(env, size)  # the env applies to sub-communicators too
    if pretend_nodes > size:
        raise ValueError(f"pretend_nodes={pretend_nodes} is more than the {size} ranks of the communicator")
    return pretend_nodes


def node_layout(comm: MPI.Comm | None = None, pretend_nodes: int | None = None) -> NodeLayout:
    """Split ``comm`` into nodes (collective over ``comm``).

    With ``pretend_nodes=K`` (default from ``MPISTRAT_PRETEND_NODES``, capped
    at the communicator's size), rank r of n is on pretend node ``r * K // n``;
    an explicit K must not exceed n.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    pretend_nodes = resolve_pretend_nodes(size, pretend_nodes)
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
    sizes = comm.allgather(local_size)
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
        _sizes_equal=len(set(sizes)) == 1,
    )
