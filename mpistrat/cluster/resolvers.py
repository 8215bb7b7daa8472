"""Cluster resolvers: who this rank is, where its peers are, which GPUs it uses.

``ClusterSpec`` and ``ClusterResolver`` as TensorFlow's; ``MPIClusterResolver``
(one MPI rank = one worker), ``SlurmClusterResolver`` (read from a Slurm step's
environment, with no MPI import), ``default_cluster_resolver`` (Slurm inside a
matching Slurm step, else MPI) and ``gpu_binding`` (the GPUs a rank uses).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from mpistrat.cluster.hostlist import expand_hostlist, expand_tasks_per_node

__all__ = [
    "ClusterSpec",
    "ClusterResolver",
    "MPIClusterResolver",
    "SlurmClusterResolver",
    "default_cluster_resolver",
    "local_devices_for",
    "gpu_binding",
    "warn_shared_gpus",
    "format_master_url",
    "in_slurm_step",
    "node_gpu_ids",
]

DEFAULT_PORT_BASE = 8888


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``"host:port"`` -> ``"rpc://host:port"`` (unchanged without rpc_layer)."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


class ClusterSpec:
    """Job names mapped to task addresses (``tf.train.ClusterSpec``).

    ``cluster`` is a dict whose values are lists of addresses (task i is the
    i-th) or dicts ``{task_index: address}``, or another ClusterSpec.
    """

    def __init__(self, cluster: "Mapping[str, Any] | ClusterSpec | None" = None):
        self._jobs: dict[str, dict[int, str]] = {}
        if cluster is None:
            return
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, Mapping):
            raise TypeError(f"ClusterSpec needs a dict of job name -> tasks, got {type(cluster).__name__}")
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise TypeError(f"Job names must be non-empty strings, got {job!r}")
            if isinstance(tasks, Mapping):
                entries = dict(tasks)
            elif isinstance(tasks, Sequence) and not isinstance(tasks, str):
                entries = dict(enumerate(tasks))
            else:
                raise TypeError(f"Tasks of job {job!r} must be a list or a dict of addresses, got {tasks!r}")
            for index, address in entries.items():
                if not isinstance(index, int) or index < 0:
                    raise TypeError(f"Task index in job {job!r} must be an int >= 0, got {index!r}")
                if not isinstance(address, str):
                    raise TypeError(f"Address of task {index} in job {job!r} must be a string, got {address!r}")
            self._jobs[job] = dict(sorted(entries.items()))

    @property
    def jobs(self) -> list[str]:
        """The job names."""
        return list(self._jobs)

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except KeyError:
            raise ValueError(f"No such job in cluster: {job_name!r} (jobs: {self.jobs})") from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks job ``job_name`` has."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of a job, sorted."""
        return list(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of one task."""
        tasks = self._job(job_name)
        try:
            return tasks[task_index]
        except KeyError:
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}") from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """Addresses by index (None for missing indices), as TensorFlow."""
        tasks = self._job(job_name)
        if not tasks:
            return []
        return [tasks.get(i) for i in range(max(tasks) + 1)]

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Jobs as lists when their indices are 0..n-1, else as dicts."""
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = list(tasks) == list(range(len(tasks)))
            out[job] = list(tasks.values()) if dense else dict(tasks)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


class ClusterResolver:
    """Base class: ``task_type``, ``task_id``, ``rpc_layer``, ``cluster_spec()``,
    ``master()``, ``num_accelerators()``, ``environment``, plus mpistrat's
    ``local_gpus()``, ``local_devices()`` and ``comm`` (the MPI communicator
    whose ranks are the tasks; None means ``COMM_WORLD``).

    Addresses: MPI needs no ports, but TensorFlow's API speaks of
    ``host:port`` addresses, so both resolvers describe task i on a node as
    ``hostname:(port_base + i)`` where i is the task's position on its node
    (TensorFlow's Slurm convention; ``port_base`` defaults to 8888). The port
    is a placeholder: nothing listens on it. In a Slurm step both resolvers
    therefore give the same ``cluster_spec()``.
    """

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    comm: Any = None

    def cluster_spec(self) -> ClusterSpec:
        """The cluster's jobs and task addresses."""
        raise NotImplementedError

    def local_gpus(self) -> list[int]:
        """Indices (as this process sees them) of the GPUs bound to this task."""
        raise NotImplementedError

    def local_devices(self) -> list[str]:
        """Device strings this task should use: its GPUs, else ``["/cpu:0"]``."""
        gpus = self.local_gpus()
        return [f"/gpu:{i}" for i in gpus] if gpus else ["/cpu:0"]

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """``{"GPU": n}``: the GPUs bound to this task (0 when none)."""
        del task_type, task_id, config_proto
        return {"GPU": len(self.local_gpus())}

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """Address of a task (default: this one), prefixed with ``rpc_layer://``."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self.rpc_layer)

    @property
    def environment(self) -> str:
        """Always ``""`` (TensorFlow uses "google" only for its own systems)."""
        return ""

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)``."""
        return self.task_type, self.task_id


def gpu_binding(local_rank: int, local_size: int, num_gpus: int,
                gpus_per_task: int | None = None) -> list[int]:
    """GPU indices for the ``local_rank``-th of ``local_size`` tasks on a node with ``num_gpus`` GPUs.

    For the k-th of L tasks on a node that has n GPUs, with g GPUs per task
    when given:

    * n == 0: no GPU, the task uses ``/cpu:0``.
    * g given: GPUs ``[k*g, (k+1)*g)``; ``L*g > n`` is an error.
    * g not given, L >= n: one GPU, ``k % n`` (several tasks share a GPU when
      there are more tasks than GPUs).
    * g not given, L < n: a block of ``g = n // L`` GPUs, ``[k*g, (k+1)*g)``,
      so every task gets the same number of replicas; the last ``n % L`` GPUs
      stay unused.

    The resolvers pass as L the largest number of tasks on any node, so all
    tasks get equally many GPUs. ``mpiexec -n 4`` on a 4-GPU node gives each
    rank one GPU; one process on a 4-GPU node gets all four.
    """
    if local_size < 1 or not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank must be in [0, {local_size}), got {local_rank}")
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if gpus_per_task is not None:
        if gpus_per_task < 0:
            raise ValueError(f"gpus_per_task must be >= 0, got {gpus_per_task}")
        if local_size * gpus_per_task > num_gpus:
            raise RuntimeError(
                f"Requested more GPUs per node than available: {local_size} tasks per node x "
                f"{gpus_per_task} GPUs per task > {num_gpus} GPUs per node."
            )
        return list(range(local_rank * gpus_per_task, (local_rank + 1) * gpus_per_task))
    if num_gpus == 0:
        return []
    if local_size >= num_gpus:
        return [local_rank % num_gpus]
    per_task = num_gpus // local_size
    return list(range(local_rank * per_task, (local_rank + 1) * per_task))


def warn_shared_gpus(local_rank: int, local_size: int, num_gpus: int, gpus_per_task: int | None) -> bool:
    """Warn (once per node: from its first task) when ``local_size`` tasks share ``num_gpus`` fewer GPUs.

    The binding is round-robin then (:func:`gpu_binding`), which works, but is slower than one GPU per
    task and rules out NCCL between the ranks that share a GPU. Returns whether the GPUs are shared.
    """
    shared = gpus_per_task is None and 0 < num_gpus < local_size
    if shared and local_rank == 0:
        warnings.warn(
            f"{local_size} tasks on this node share {num_gpus} GPU(s): task k uses GPU k % {num_gpus} "
            "(round-robin). Replicas on a shared GPU run one after another, and all-reduces between ranks "
            "on one GPU go through MPI (NCCL needs a GPU per rank). Start one task per GPU for full speed.",
            RuntimeWarning,
            stacklevel=3,
        )
    return shared


# --------------------------------------------------------------------------- GPUs on this node

def _cuda_visible_list() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list (``[]`` when set empty), None when unset."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def node_gpu_ids() -> list[str]:
    """The GPUs this process may use, without starting CUDA.

    ``CUDA_VISIBLE_DEVICES`` when set; else ``nvidia-smi --list-gpus``; else
    the entries of ``/proc/driver/nvidia/gpus``; else none.
    """
    visible = _cuda_visible_list()
    if visible is not None:
        return visible
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            count = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
            return [str(i) for i in range(count)]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def _warn_if_cuda_loaded() -> None:
    if "cupy" in sys.modules:
        warnings.warn(
            "CUDA_VISIBLE_DEVICES was changed after CuPy was imported; if CUDA was already "
            "initialised in this process the change has no effect. Create the cluster resolver "
            "before using CuPy.",
            RuntimeWarning,
            stacklevel=3,
        )


# --------------------------------------------------------------------------- Slurm

def _slurm_var(name: str) -> str:
    key = "SLURM_" + name
    try:
        return os.environ[key]
    except KeyError:
        raise RuntimeError(f"{key} not found in environment. Not running inside a SLURM step?") from None


def _slurm_int(name: str) -> int:
    text = _slurm_var(name)
    try:
        return int(text)
    except ValueError:
        raise RuntimeError(f"SLURM_{name} must be an integer, got {text!r}") from None


def in_slurm_step() -> bool:
    """Whether the environment describes a Slurm job step (``srun`` task)."""
    return all(f"SLURM_{n}" in os.environ for n in ("PROCID", "STEP_NUM_TASKS", "STEP_NODELIST"))


class SlurmClusterResolver(ClusterResolver):
    """A cluster resolver for a Slurm job step (TensorFlow's arguments and behaviour).

    Reads ``SLURM_PROCID``, and when not given as arguments
    ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``,
    ``SLURM_STEP_TASKS_PER_NODE`` and ``SLURM_LOCALID``. Ranks go to jobs in
    sorted job-name order (``{"ps": 1, "worker": 2}``: rank 0 is ps 0). With
    ``auto_set_gpu`` it sets ``CUDA_VISIBLE_DEVICES`` to this task's GPUs when
    created (and again on ``cluster_spec()``, as TensorFlow): create it before
    anything starts CUDA. ``comm`` (an mpistrat extension) is carried for the
    strategy: the MPI communicator whose ranks are these tasks. It imports no
    MPI.

    Differences from TensorFlow's ``SlurmClusterResolver`` (all on purpose):
    nodes keep the order of ``SLURM_STEP_NODELIST`` (TensorFlow sorts names
    as strings, which puts ``n10`` before ``n9`` and no longer matches Slurm's
    task ids); the own task's GPUs use ``SLURM_LOCALID`` when set (right for
    any ``--distribution``); when ``CUDA_VISIBLE_DEVICES`` already lists the
    node's GPUs (as Slurm sets it for ``--gres``/``--gpus``), a task's GPUs
    are taken from that list instead of renumbered from 0; an empty
    ``CUDA_VISIBLE_DEVICES`` counts as no GPU; a node without GPUs (or
    without ``nvidia-smi``) gives 0 GPUs instead of an error, and then
    ``CUDA_VISIBLE_DEVICES`` is left alone.
    """

    def __init__(self, jobs: Mapping[str, int] | None = None, port_base: int = DEFAULT_PORT_BASE,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: int | Mapping[str, int] | None = None, auto_set_gpu: bool = True,
                 rpc_layer: str = "grpc", *, comm: Any = None):
        self._rank = _slurm_int("PROCID")
        if jobs is None:
            jobs = {"worker": _slurm_int("STEP_NUM_TASKS")}
        if not isinstance(jobs, Mapping) or not jobs:
            raise ValueError(f"jobs must be a non-empty dict of job name -> number of tasks, got {jobs!r}")
        for name, count in jobs.items():
            if not isinstance(count, int) or count < 0:
                raise ValueError(f"Number of tasks of job {name!r} must be an int >= 0, got {count!r}")
        self._jobs = dict(jobs)
        self._port_base = int(port_base)

        if tasks_per_node is None:
            self._task_configuration = self._resolve_task_configuration()
        elif isinstance(tasks_per_node, Mapping):
            self._task_configuration = {str(h): int(n) for h, n in tasks_per_node.items()}
        else:
            self._task_configuration = {h: int(tasks_per_node) for h in self._resolve_hostlist()}
        if not self._task_configuration:
            raise RuntimeError("The Slurm step has no nodes (empty task configuration).")
        max_tasks_per_node = max(self._task_configuration.values())
        num_tasks = sum(self._task_configuration.values())

        visible = node_gpu_ids()
        if gpus_per_node is None:
            gpus_per_node = len(visible)
        if gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, got {gpus_per_node}")
        # Map GPU numbers through the visible list when it covers the node's GPUs.
        self._gpu_names = visible if len(visible) >= gpus_per_node else [str(i) for i in range(gpus_per_node)]
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._max_tasks_per_node = max_tasks_per_node
        self._auto_set_gpu = auto_set_gpu
        self.rpc_layer = rpc_layer
        self.comm = comm

        if sum(self._jobs.values()) != num_tasks:
            raise RuntimeError(
                f"Requested {sum(self._jobs.values())} tasks (jobs={self._jobs}) but the Slurm step "
                f"has {num_tasks} tasks ({self._task_configuration})."
            )
        if not 0 <= self._rank < num_tasks:
            raise RuntimeError(f"SLURM_PROCID={self._rank} is outside the step's {num_tasks} tasks.")

        # Tasks in node order, each with its position on its node.
        self._task_list: list[tuple[str, int]] = [
            (host, i) for host, n in self._task_configuration.items() for i in range(n)
        ]
        # Checks the GPU request for every position (raises if too many GPUs are asked for).
        self._gpu_allocation = [self._gpus_at(i) for _, i in self._task_list]
        local_id = os.environ.get("SLURM_LOCALID")
        self._local_id = int(local_id) if local_id is not None and local_id.isdigit() else self._task_list[self._rank][1]
        self._own_gpus = self._gpus_at(self._local_id)
        warn_shared_gpus(self._local_id, self._max_tasks_per_node, self._gpus_per_node, self._gpus_per_task)

        self.task_type, self.task_id = None, None
        start = 0
        for name, count in sorted(self._jobs.items()):
            if start <= self._rank < start + count:
                self.task_type, self.task_id = name, self._rank - start
            start += count
        self._set_visible_devices()

    # Resolution from the environment (TensorFlow's method names).
    def _resolve_hostlist(self) -> list[str]:
        return expand_hostlist(_slurm_var("STEP_NODELIST"))

    def _resolve_task_configuration(self) -> dict[str, int]:
        hosts = self._resolve_hostlist()
        counts = expand_tasks_per_node(_slurm_var("STEP_TASKS_PER_NODE"))
        if len(hosts) != len(counts):
            raise RuntimeError(
                f"SLURM_STEP_NODELIST names {len(hosts)} nodes but SLURM_STEP_TASKS_PER_NODE "
                f"gives {len(counts)} counts ({os.environ.get('SLURM_STEP_TASKS_PER_NODE')!r})."
            )
        return dict(zip(hosts, counts))

    def _gpus_at(self, position: int) -> list[str]:
        local_size = max(self._max_tasks_per_node, position + 1)
        ids = gpu_binding(position, local_size, self._gpus_per_node, self._gpus_per_task)
        return [self._gpu_names[i] for i in ids]

    def _set_visible_devices(self) -> None:
        if not self._auto_set_gpu or self._gpus_per_node == 0:
            return
        value = ",".join(self._own_gpus)
        if os.environ.get("CUDA_VISIBLE_DEVICES") != value:
            _warn_if_cuda_loaded()
        os.environ["CUDA_VISIBLE_DEVICES"] = value

    def cluster_spec(self) -> ClusterSpec:
        """Jobs over the step's tasks, ``host:port_base+position`` each."""
        tasks = [f"{host}:{self._port_base + i}" for host, i in self._task_list]
        cluster, start = {}, 0
        for name, count in sorted(self._jobs.items()):
            cluster[name] = tasks[start:start + count]
            start += count
        self._set_visible_devices()
        return ClusterSpec(cluster)

    def gpu_allocation(self) -> list[str]:
        """``CUDA_VISIBLE_DEVICES`` value of every task, by rank."""
        return [",".join(g) for g in self._gpu_allocation]

    @property
    def local_rank(self) -> int:
        """This task's position on its node (``SLURM_LOCALID``)."""
        return self._local_id

    def local_gpus(self) -> list[int]:
        """With ``auto_set_gpu`` the process sees only its GPUs: 0..g-1."""
        if self._auto_set_gpu and self._gpus_per_node:
            return list(range(len(self._own_gpus)))
        return [self._gpu_names.index(name) for name in self._own_gpus]

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """``{"GPU": GPUs per task}``."""
        del task_type, task_id, config_proto
        return {"GPU": len(self._own_gpus)}


# --------------------------------------------------------------------------- MPI

class MPIClusterResolver(ClusterResolver):
    """One MPI rank = one "worker" task (collective over ``comm`` when created); with ``num_ps=P`` (or
    ``MPISTRAT_NUM_PS``) a parameter-server job: rank 0 the "chief", ranks 1..P "ps", the rest "worker".

    ``comm`` defaults to ``COMM_WORLD``; pass a sub-communicator to run a
    strategy on part of the job. Local rank and node come from
    ``mpistrat.comm.node_layout`` (shared-memory split, or
    ``MPISTRAT_PRETEND_NODES``); host names from ``MPI.Get_processor_name()``.
    GPUs: ``gpus_per_node`` defaults to what CuPy sees (counted on first use);
    binding as in ``gpu_binding``. Unlike the Slurm resolver it never changes
    ``CUDA_VISIBLE_DEVICES``: ranks select their GPU by index.
    """

    def __init__(self, comm: Any = None, port_base: int = DEFAULT_PORT_BASE,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 rpc_layer: str | None = None, num_ps: int | None = None):
        from mpi4py import MPI  # noqa: PLC0415  (lazy: importing mpi4py.MPI initialises MPI)

        from mpistrat import config  # noqa: PLC0415

        from mpistrat.comm import node_layout  # noqa: PLC0415

        self.comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(self.comm, MPI.Comm) or self.comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py communicator, got {comm!r}")
        layout = node_layout(self.comm)
        try:
            self.local_rank, self.local_size = layout.local_rank, layout.local_size
            self.node_index, self.num_nodes = layout.node_index, layout.num_nodes
        finally:
            layout.free()
        self.hostname = MPI.Get_processor_name()
        rows = self.comm.allgather((self.hostname, self.local_rank, self.local_size))
        self.hostnames = [r[0] for r in rows]
        self._local_ranks = [r[1] for r in rows]
        self._max_local_size = max(r[2] for r in rows)
        self.num_ps = int(config.get("num_ps") or 0) if num_ps is None else int(num_ps)
        size, rank = len(rows), self.comm.Get_rank()
        if self.num_ps < 0 or (self.num_ps and size < self.num_ps + 2):
            unwired = _singleton_in_step_error(MPI.COMM_WORLD.Get_size(), MPI.Get_library_version())
            if unwired is not None:  # srun started the tasks, but each is alone in its MPI world
                raise unwired
            raise ValueError(f"num_ps={self.num_ps} needs at least {self.num_ps + 2} ranks (a chief, the ps and a "
                             f"worker); this job has {size}")
        if self.num_ps:  # a parameter-server job: rank 0 the chief, then the ps, then the workers
            self.task_type, self.task_id = (("chief", 0) if rank == 0 else ("ps", rank - 1)
                                            if rank <= self.num_ps else ("worker", rank - 1 - self.num_ps))
        else:
            self.task_type, self.task_id = "worker", rank
        self.rpc_layer = rpc_layer
        self._port_base = int(port_base)
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._gpus: list[int] | None = None

    @property
    def num_workers(self) -> int:
        """Number of ranks in the communicator."""
        return len(self.hostnames)

    def cluster_spec(self) -> ClusterSpec:
        """``{"worker": [host:port_base+local_rank of each rank]}`` (ports are placeholders); with ``num_ps``,
        ``{"chief": [rank 0], "ps": [the next num_ps ranks], "worker": [the rest]}``."""
        addresses = [f"{h}:{self._port_base + lr}" for h, lr in zip(self.hostnames, self._local_ranks)]
        if not self.num_ps:
            return ClusterSpec({"worker": addresses})
        return ClusterSpec({"chief": addresses[:1], "ps": addresses[1:1 + self.num_ps],
                            "worker": addresses[1 + self.num_ps:]})

    def local_gpus(self) -> list[int]:
        """This rank's GPU indices (CuPy numbering)."""
        if self._gpus is None:
            n = self._gpus_per_node
            if n is None:
                from mpistrat.devices import num_gpus  # noqa: PLC0415

                n = num_gpus()
            self._gpus = gpu_binding(self.local_rank, self._max_local_size, n, self._gpus_per_task)
            warn_shared_gpus(self.local_rank, self._max_local_size, n, self._gpus_per_task)
        return list(self._gpus)


# --------------------------------------------------------------------------- choice

def _singleton_in_step_error(world_size: int, mpi_library: str) -> RuntimeError | None:
    """The error for a process alone in its MPI world inside a Slurm step of several tasks (the MPI did
    not connect to Slurm's process manager, so every task would train alone), or None."""
    if world_size != 1 or not in_slurm_step():
        return None
    try:
        tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
    except ValueError:
        return None
    if tasks <= 1:
        return None
    library = mpi_library.splitlines()[0].strip() if mpi_library else "this MPI"
    hint = ("Open MPI 5 connects only through PMIx: run `srun --mpi=pmix` (`srun --mpi=list` shows whether this "
            "Slurm has it) or start the ranks with `mpirun` inside the allocation"
            if "Open MPI" in library else
            "run `srun --mpi=pmi2` (MPICH, Intel MPI) or `srun --mpi=pmix`, as `srun --mpi=list` offers, or start "
            "the ranks with `mpiexec` inside the allocation")
    return RuntimeError(
        f"Slurm started {tasks} tasks in this step (SLURM_STEP_NUM_TASKS), but MPI sees a world of 1 process: "
        f"{library} did not connect to Slurm's process manager, so each task would run alone. {hint}. To run "
        "independent one-process programs on purpose, pass cluster_resolver=MPIClusterResolver().")


def default_cluster_resolver(comm: Any = None) -> ClusterResolver:
    """``SlurmClusterResolver`` inside a Slurm step whose tasks are exactly the
    ranks of ``comm`` (same count, ``SLURM_PROCID`` == rank), else
    ``MPIClusterResolver(comm)``. Collective over ``comm``; all ranks decide
    alike, and an error building the Slurm resolver is raised on every rank. A process
    alone in its MPI world inside a Slurm step of several tasks raises (MPI not wired to Slurm)."""
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD if comm is None else comm
    singleton_error = _singleton_in_step_error(MPI.COMM_WORLD.Get_size(), MPI.Get_library_version())
    if singleton_error is not None:
        raise singleton_error
    matches = False
    if in_slurm_step():
        try:
            matches = (int(os.environ["SLURM_STEP_NUM_TASKS"]) == comm.Get_size()
                       and int(os.environ["SLURM_PROCID"]) == comm.Get_rank())
        except ValueError:
            matches = False
    if not comm.allreduce(matches, op=MPI.LAND):
        return MPIClusterResolver(comm)
    resolver, error = None, None
    try:
        resolver = SlurmClusterResolver(comm=comm)
    except Exception as exc:  # reported on every rank below
        error = f"{type(exc).__name__}: {exc}"
    errors = comm.allgather(error)
    failed = {r: e for r, e in enumerate(errors) if e}
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise RuntimeError(f"Could not build the Slurm cluster resolver: {detail}")
    return resolver


def local_devices_for(resolver: ClusterResolver | None = None) -> list[str]:
    """Device strings this rank should use (``["/gpu:0"]``, ``["/cpu:0"]``...).

    ``resolver`` defaults to ``default_cluster_resolver()`` (collective). A
    resolver without ``local_gpus`` (any TensorFlow-style resolver) is read
    through ``num_accelerators()["GPU"]``.
    """
    if resolver is None:
        resolver = default_cluster_resolver()
    if isinstance(resolver, ClusterResolver):
        return resolver.local_devices()
    n = int(resolver.num_accelerators().get("GPU", 0))
    return [f"/gpu:{i}" for i in range(n)] or ["/cpu:0"]
