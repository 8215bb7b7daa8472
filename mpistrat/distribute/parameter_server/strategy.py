"""ParameterServerStrategy: the chief's strategy, whose variables live on the ps ranks, and its worker-side twin."""

from __future__ import annotations

import atexit
import itertools
from typing import Any, Callable

import numpy as np

from mpistrat import config
from mpistrat.cluster.resolvers import ClusterSpec
from mpistrat.distribute import partitioners, variables
from mpistrat.distribute.input_options import InputContext
from mpistrat.distribute.one_device import OneDeviceStrategy
from mpistrat.distribute.parameter_server import protocol, rpc
from mpistrat.distribute.parameter_server.remote_variable import RemoteVariable
from mpistrat.distribute.sharded_variable import ShardedVariable
from mpistrat.distribute.strategy import Strategy, StrategyExtended

__all__ = ["ParameterServerStrategy", "roles_of", "worker_strategy"]

_CPU = "/cpu:0"


def roles_of(cluster_resolver: Any) -> protocol.Roles:
    """The job's roles from a cluster resolver, with TensorFlow's checks (``ParameterServerStrategyV2``)."""
    jobs = ClusterSpec(cluster_resolver.cluster_spec()).as_dict()
    if not jobs:
        raise ValueError("Cluster spec must be non-empty in `tf.distribute.cluster_resolver.ClusterResolver`.")
    unknown = sorted(set(jobs) - set(protocol.JOBS))
    if unknown:
        raise ValueError(f"Disallowed task type found in cluster spec: {unknown[0]!r} (a parameter-server job has "
                         "the jobs chief, ps and worker)")
    if len(jobs.get("chief", ())) != 1:
        raise ValueError("ParameterServerStrategy needs exactly one chief (the coordinator, MPI rank 0)")
    count = {job: len(tasks) for job, tasks in jobs.items()}
    if count.get("ps", 0) < 1:
        raise ValueError("There must be at least one ps.")
    if count.get("worker", 0) < 1:
        raise ValueError("There must be at least one worker.")
    return protocol.Roles(count["ps"], count["worker"])


class _ParameterServerExtended(StrategyExtended):
    _distributed_variables = True  # variables made in scope() go to the ps ranks

    def __init__(self, container: Any, roles: protocol.Roles, variable_partitioner: Callable | None) -> None:
        super().__init__(container, [_CPU])
        self._roles = roles
        self._variable_partitioner = variable_partitioner
        self._var_ids = itertools.count(1)
        self._next_ps = itertools.cycle(range(roles.num_ps))  # round-robin, as TF places them

    def _create_variable(self, kwargs: dict) -> Any:
        sync, agg, trainable = variables._validate(kwargs)
        name = kwargs["name"] if kwargs["name"] is not None else f"Variable_{next(self._var_ids)}"
        initial = variables._initial_array(kwargs["initial_value"], kwargs["dtype"], _CPU)
        host = np.asarray(initial)
        if kwargs["shape"] is not None and tuple(kwargs["shape"]) != host.shape:
            raise ValueError(f"Variable {name}: initial value has shape {host.shape}, not the given shape "
                             f"{tuple(kwargs['shape'])}")
        made = dict(trainable=trainable, synchronization=sync, aggregation=agg, constraint=kwargs["constraint"])
        partitioner = self._variable_partitioner
        if partitioner is not None and host.ndim > 0:
            num = partitioners.num_shards_for(partitioner(shape=host.shape, dtype=host.dtype), host.shape[0])
            if num > 1:
                offsets = partitioners.shard_offsets(host.shape[0], num)
                shards = [self._place(host[offsets[i]:offsets[i + 1]], f"{name}/part_{i}", made) for i in range(num)]
                return ShardedVariable(shards, name=name)
        return self._place(host, name, made)

    def _place(self, array: np.ndarray, name: str, made: dict) -> RemoteVariable:
        """A variable of ``array`` on the next ps in turn."""
        ps = next(self._next_ps)
        var = RemoteVariable(next(self._var_ids), ps, name, array.shape, array.dtype, **made)
        rt = protocol.runtime()
        rpc.call(rt, self._roles.rank_of("ps", ps), ("create", var._var_id, array), f"creating variable {name!r}")
        return var


class ParameterServerStrategy(Strategy):
    """TensorFlow's ``ParameterServerStrategy`` on MPI ranks: rank 0 is the chief (the coordinator, where this is
    created), then the ps ranks, then the workers (``MPIClusterResolver(num_ps=P)``, or Slurm's resolver with
    ``jobs={"chief": 1, "ps": P, "worker": W}``). Those other ranks run ``Server(...).join()``.

    Variables created in ``scope()`` live on the ps ranks, placed round-robin; with ``variable_partitioner``
    they are split along axis 0 into a ``ShardedVariable`` as TF splits them. Functions run on the workers
    through ``ms.coordinator.ClusterCoordinator(strategy).schedule``. ``timeout_seconds`` (an mpistrat
    extension; default ``MPISTRAT_TIMEOUT_SECONDS``): how long a request to a ps waits for its answer before
    :class:`~mpistrat.errors.UnavailableError`.
    """

    def __init__(self, cluster_resolver: Any, variable_partitioner: Callable | None = None,
                 timeout_seconds: float | None = None) -> None:
        roles = roles_of(cluster_resolver)
        task_type = getattr(cluster_resolver, "task_type", None)
        if task_type not in (None, "chief"):
            raise RuntimeError(
                f"ParameterServerStrategy is created on the chief (the coordinator, rank 0), not on this "
                f"{task_type} task {cluster_resolver.task_id}: there, run "
                "ms.Server(cluster_resolver.cluster_spec(), job_name=cluster_resolver.task_type, "
                "task_index=cluster_resolver.task_id).join()")
        timeout = float(config.get("timeout_seconds") if timeout_seconds is None else timeout_seconds)
        rt = protocol.start(roles, timeout)
        if rt.comm.Get_rank() != 0:
            raise RuntimeError("ParameterServerStrategy is created on MPI rank 0 (the chief) only")
        self._cluster_resolver = cluster_resolver
        self._roles = roles
        self._closed = False
        self._coordinator: Any = None
        super().__init__(_ParameterServerExtended(self, roles, variable_partitioner))
        rt.strategy = self
        atexit.register(self._shutdown)

    def __reduce__(self) -> tuple:
        return (worker_strategy, ())  # in a scheduled function, the strategy is the worker's own

    @property
    def cluster_resolver(self) -> Any:
        return self._cluster_resolver

    def _shutdown(self) -> None:
        """End the job's service: the coordinator's pending work first, then every worker and ps stops (their
        ``Server.join()`` returns). Called at exit; once."""
        if self._closed:
            return
        self._closed = True
        if self._coordinator is not None:
            self._coordinator._drain()
        rt = protocol.runtime()
        for rank in self._roles.worker_ranks:
            rt.comm.send(("stop",), dest=rank, tag=protocol.TAG_CONTROL)
        for rank in self._roles.worker_ranks:
            while True:
                got = rpc.wait_message(rt.comm, rank, protocol.TAG_RESULT, rt.timeout_seconds)
                if got is None or got[0][0] == "stopped":
                    break
        for rank in self._roles.ps_ranks:
            try:
                rpc.call(rt, rank, ("stop",), "stopping the parameter server")
            except Exception:  # a stopped ps: the job ends without it
                pass

    def __repr__(self) -> str:
        return f"<ParameterServerStrategy ps={self._roles.num_ps} workers={self._roles.num_workers}>"


class _WorkerExtended(StrategyExtended):
    _distributed_variables = True  # variables are the chief's to create

    def _create_variable(self, kwargs: dict) -> Any:
        raise RuntimeError(
            f"variable {kwargs.get('name') or ''!r} created in a function scheduled on a worker: a "
            "ParameterServerStrategy's variables are created on the chief, in strategy.scope(), before "
            "scheduling (an optimizer's too: optimizer.build(model.trainable_variables) there)")


class _WorkerStrategy(OneDeviceStrategy):
    """The strategy a scheduled function sees on a worker: one replica on its CPU, its datasets this worker's
    shard (``InputContext(num_workers, worker_index, 1)``, as TF's workers build them); it creates no
    variables (they are the chief's)."""

    def __init__(self) -> None:
        self._device = _CPU
        Strategy.__init__(self, _WorkerExtended(self, [_CPU]))

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        rt = protocol.runtime()
        index = rt.worker_index if rt.worker_index is not None else _worker_index_of(rt)
        return self.experimental_distribute_dataset(dataset_fn(InputContext(rt.roles.num_workers, index, 1)), options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def __repr__(self) -> str:
        return "<ParameterServerStrategy (worker side)>"


def _worker_index_of(rt: protocol.Runtime) -> int:
    return rt.roles.worker_ranks.index(rt.comm.Get_rank())


_worker: _WorkerStrategy | None = None


def worker_strategy() -> _WorkerStrategy:
    """This worker's strategy (what a pickled ``ParameterServerStrategy`` becomes on a worker)."""
    global _worker
    if _worker is None:
        _worker = _WorkerStrategy()
    return _worker
