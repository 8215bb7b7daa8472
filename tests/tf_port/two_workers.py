"""Two-worker strategies for TF's two-worker test cases: COMM_WORLD split into pairs of ranks.

TF's ``multi_worker_mirrored_2x1_*`` and ``2x2_*`` combinations run on exactly
two workers (a chief and one worker) and their expected values depend on it.
Under ``mpiexec -n 2`` the pair is the whole job; under ``-n 4`` the ranks form
two independent pairs, each running the same two-worker case. With one rank or
an odd number of ranks the case is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import mpistrat as ms

__all__ = ["pair_comm", "task_type", "two_worker_strategy"]

_PAIR: dict = {}


def pair_comm() -> Any:
    """This rank's two-rank communicator (made once per process, collectively over COMM_WORLD)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size < 2 or world.size % 2:
        pytest.skip(f"TF's case runs on two workers: needs an even number of ranks, got {world.size}")
    if "comm" not in _PAIR:
        _PAIR["comm"] = world.Split(world.rank // 2, world.rank)
    return _PAIR["comm"]


def two_worker_strategy(local_devices: Sequence[str] = ("/cpu:0",)) -> Any:
    """A MultiWorkerMirroredStrategy over this rank's pair, with ``local_devices`` on each worker."""
    from mpistrat.cluster_resolver import MPIClusterResolver

    return ms.MultiWorkerMirroredStrategy(cluster_resolver=MPIClusterResolver(pair_comm()),
                                          local_devices=list(local_devices))


def task_type() -> str:
    """TF's task type of this rank in its pair's 2x1 cluster: the chief, then the worker."""
    return "chief" if pair_comm().rank == 0 else "worker"
