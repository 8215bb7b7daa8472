"""``Server``: what a ps or worker rank of a parameter-server job runs until the chief is done."""

from __future__ import annotations

from typing import Any

from mpistrat.config import get as setting
from mpistrat.cluster.resolvers import ClusterSpec
from mpistrat.distribute.parameter_server import protocol as wire
from mpistrat.distribute.parameter_server.ps_service import serve_ps
from mpistrat.distribute.parameter_server.strategy import worker_strategy
from mpistrat.distribute.parameter_server.worker_service import serve_worker

__all__ = ["Server"]


class Server:
    """TensorFlow's ``tf.distribute.Server`` for a ps or worker task of a parameter-server job on MPI.

    ``server_or_cluster_def``: the cluster spec (a ``ClusterSpec`` or its dict), with ``job_name`` and
    ``task_index`` naming this task, as TF's tutorial passes them from the cluster resolver. Ranks are
    the tasks in the order chief, ps, worker; this rank must be the task named. ``start()`` (done on
    creation unless ``start=False``) joins the job's communicator: collective, every rank of the job
    does it once (the chief by creating ``ParameterServerStrategy``). ``join()`` serves until the
    chief finishes, then returns (TF's never returns). ``protocol`` and ``config`` are accepted for
    TF's signature and ignored: messages go over MPI.
    """

    def __init__(self, server_or_cluster_def: Any, job_name: str | None = None, task_index: int | None = None,
                 protocol: str | None = None, config: Any = None, start: bool = True) -> None:
        del protocol, config  # TF's gRPC settings: MPI carries the messages
        jobs = ClusterSpec(server_or_cluster_def).as_dict()
        if job_name is None:
            if len(jobs) != 1:
                raise ValueError(f"job_name must be given for a cluster of several jobs ({', '.join(jobs)})")
            job_name = next(iter(jobs))
        if job_name not in ("ps", "worker"):
            raise ValueError(f"Server runs a ps or worker task, not {job_name!r}: on the chief, create "
                             "ParameterServerStrategy and a ClusterCoordinator instead")
        self._roles = protocol_roles(jobs)
        self._job, self._index = job_name, int(task_index or 0)
        self._rank = self._roles.rank_of(self._job, self._index)
        self._runtime: wire.Runtime | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Join the job (collective with every rank of it, once)."""
        if self._runtime is None:
            rt = wire.start(self._roles, float(setting("timeout_seconds")))
            if rt.comm.Get_rank() != self._rank:
                raise ValueError(f"this is MPI rank {rt.comm.Get_rank()}, but task {self._index} of job "
                                 f"{self._job!r} is rank {self._rank} (ranks go to chief, ps, worker in that order)")
            self._runtime = rt

    @property
    def target(self) -> str:
        """Where this task is reached (an MPI rank: ``"mpi://rank<R>"``)."""
        return f"mpi://rank{self._rank}"

    def join(self) -> None:
        """Serve the job until the chief has finished (its strategy's shutdown at exit), then return."""
        self.start()
        assert self._runtime is not None
        if self._job == "ps":
            serve_ps(self._runtime)
        else:
            self._runtime.strategy = worker_strategy()
            serve_worker(self._runtime, self._index)


def protocol_roles(jobs: dict) -> wire.Roles:
    """The roles of a cluster spec's jobs (one chief, the ps, the workers)."""
    if len(jobs.get("chief", ())) != 1 or not jobs.get("ps") or not jobs.get("worker"):
        raise ValueError("a parameter-server cluster has one chief, at least one ps and at least one worker; got "
                         + ", ".join(f"{job}: {len(tasks)}" for job, tasks in jobs.items()))
    return wire.Roles(len(jobs["ps"]), len(jobs["worker"]))
