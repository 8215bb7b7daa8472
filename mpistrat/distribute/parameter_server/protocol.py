"""The parameter-server job's wire: its roles, its communicator, its message tags, values pickled by value."""

from __future__ import annotations

import dataclasses
from typing import Any

import cloudpickle

__all__ = ["Roles", "TAG_PS", "TAG_REPLY", "TAG_CONTROL", "TAG_RESULT", "Runtime", "runtime", "start", "dumps", "loads"]

# Requests to a ps rank, its replies, the chief's orders to a worker, a worker's answers to the chief.
TAG_PS, TAG_REPLY, TAG_CONTROL, TAG_RESULT = 7101, 7102, 7103, 7104
JOBS = ("chief", "ps", "worker")  # ranks are given to the jobs in this order: chief 0, then ps, then workers


@dataclasses.dataclass(frozen=True)
class Roles:
    """Which MPI rank holds which task: rank 0 the chief, the next ``num_ps`` the ps, the rest workers."""

    num_ps: int
    num_workers: int

    @property
    def ps_ranks(self) -> list[int]:
        return list(range(1, 1 + self.num_ps))

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(1 + self.num_ps, 1 + self.num_ps + self.num_workers))

    def rank_of(self, job: str, index: int) -> int:
        """The MPI rank of task ``index`` of ``job``."""
        counts = {"chief": 1, "ps": self.num_ps, "worker": self.num_workers}
        if job not in counts:
            raise ValueError(f"unknown job {job!r}: a parameter-server job has the jobs {', '.join(JOBS)}")
        if not 0 <= index < counts[job]:
            raise ValueError(f"task {index} of job {job!r} does not exist: the job has {counts[job]}")
        return {"chief": 0, "ps": 1, "worker": 1 + self.num_ps}[job] + index


@dataclasses.dataclass
class Runtime:
    """This rank's part in the job: the communicator of its messages, the roles, the request timeout."""

    comm: Any
    roles: Roles
    timeout_seconds: float
    worker_index: int | None = None  # while a scheduled function runs on this worker
    strategy: Any = None  # the chief's ParameterServerStrategy, or a worker's own strategy


_runtime: Runtime | None = None


def start(roles: Roles, timeout_seconds: float) -> Runtime:
    """This rank's runtime, made once (collective the first time: every rank of the job calls it, the chief from
    ``ParameterServerStrategy``, the others from ``Server``), so the job's messages never meet other traffic."""
    global _runtime
    if _runtime is None:
        from mpi4py import MPI  # noqa: PLC0415

        world = MPI.COMM_WORLD
        expected = 1 + roles.num_ps + roles.num_workers
        if world.Get_size() != expected:
            raise ValueError(f"the cluster has {expected} tasks (1 chief, {roles.num_ps} ps, {roles.num_workers} "
                             f"workers) but MPI started {world.Get_size()} ranks: one rank per task")
        _runtime = Runtime(world.Dup(), roles, timeout_seconds)
    elif _runtime.roles != roles:
        raise ValueError(f"this rank already serves a parameter-server job of {_runtime.roles}, not {roles}")
    return _runtime


def runtime() -> Runtime:
    """This rank's runtime; RuntimeError before ``Server`` or ``ParameterServerStrategy`` made it."""
    if _runtime is None:
        raise RuntimeError("no parameter-server job on this rank: create ParameterServerStrategy on the chief and "
                           "Server(...) on the ps and worker ranks first")
    return _runtime


def dumps(value: Any) -> bytes:
    """``value`` pickled by value (functions and classes of ``__main__`` included): the job's ranks trust each other."""
    return cloudpickle.dumps(value)


def loads(data: bytes) -> Any:
    return cloudpickle.loads(data)
