"""ClusterSpec, GPU binding, MPIClusterResolver and the default resolver choice."""

import os

import pytest
from mpi4py import MPI

from mpistrat.cluster_resolver import (
    ClusterSpec,
    MPIClusterResolver,
    SlurmClusterResolver,
    default_cluster_resolver,
    local_devices_for,
)
from mpistrat.cluster.resolvers import gpu_binding
from mpistrat.devices import num_gpus


# ----------------------------------------------------------------------------- ClusterSpec

def test_cluster_spec_lists_and_dicts():
    spec = ClusterSpec({"worker": ["a:1", "b:2"], "ps": {0: "c:3", 2: "d:4"}})
    assert spec.jobs == ["worker", "ps"]
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("ps") == 2
    assert spec.task_indices("ps") == [0, 2]
    assert spec.task_address("worker", 1) == "b:2"
    assert spec.job_tasks("ps") == ["c:3", None, "d:4"]
    assert spec.as_dict() == {"worker": ["a:1", "b:2"], "ps": {0: "c:3", 2: "d:4"}}
    assert ClusterSpec(spec) == spec and ClusterSpec(spec.as_dict()) == spec
    assert spec != ClusterSpec({"worker": ["a:1"]})
    assert bool(spec) and not ClusterSpec({}) and not ClusterSpec()
    assert "worker" in repr(spec)


def test_cluster_spec_errors():
    spec = ClusterSpec({"worker": ["a:1"]})
    with pytest.raises(ValueError, match=r"No such job in cluster: 'ps' \(jobs: \['worker'\]\)"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match="No task with index 3 in job 'worker'"):
        spec.task_address("worker", 3)
    with pytest.raises(TypeError, match="dict of job name"):
        ClusterSpec(["a:1"])
    with pytest.raises(TypeError, match="must be a list or a dict"):
        ClusterSpec({"worker": "a:1"})
    with pytest.raises(TypeError, match="must be a string"):
        ClusterSpec({"worker": [1]})
    with pytest.raises(TypeError, match="int >= 0"):
        ClusterSpec({"worker": {-1: "a"}})


# ----------------------------------------------------------------------------- GPU binding

@pytest.mark.parametrize("k, L, n, g, gpus", [
    (0, 1, 0, None, []),          # no GPU: CPU
    (3, 4, 0, None, []),
    (2, 4, 4, None, [2]),         # one GPU per rank
    (3, 4, 2, None, [1]),         # more ranks than GPUs: k % n
    (0, 1, 4, None, [0, 1, 2, 3]),  # one process takes the node
    (1, 2, 4, None, [2, 3]),      # blocks of n // L
    (1, 2, 5, None, [2, 3]),      # GPU 4 unused: equal replicas per rank
    (1, 2, 4, 1, [1]),            # explicit g: [k*g, (k+1)*g)
    (1, 2, 4, 2, [2, 3]),
    (1, 2, 0, 0, []),
])
def test_gpu_binding(k, L, n, g, gpus):
    assert gpu_binding(k, L, n, g) == gpus


def test_gpu_binding_errors():
    with pytest.raises(RuntimeError, match="Requested more GPUs per node than available: 4 tasks per node x 2"):
        gpu_binding(0, 4, 4, 2)
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\), got 2"):
        gpu_binding(2, 2, 4)
    with pytest.raises(ValueError, match="num_gpus must be >= 0"):
        gpu_binding(0, 1, -1)
    with pytest.raises(ValueError, match="gpus_per_task must be >= 0"):
        gpu_binding(0, 1, 1, -1)


# ----------------------------------------------------------------------------- MPIClusterResolver

@pytest.fixture
def no_slurm(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("MPISTRAT_PRETEND_NODES", raising=False)


def test_mpi_resolver_single_process(no_slurm):
    comm = MPI.COMM_SELF
    r = MPIClusterResolver(comm)
    host = MPI.Get_processor_name()
    assert (r.task_type, r.task_id, r.num_workers) == ("worker", 0, 1)
    assert (r.local_rank, r.local_size, r.node_index, r.num_nodes) == (0, 1, 0, 1)
    assert r.cluster_spec().as_dict() == {"worker": [f"{host}:8888"]}
    assert r.master() == f"{host}:8888"
    assert r.master(rpc_layer="mpi") == f"mpi://{host}:8888"
    assert r.environment == ""
    assert r.num_accelerators() == {"GPU": num_gpus()}
    expected = [f"/gpu:{i}" for i in range(num_gpus())] or ["/cpu:0"]
    assert r.local_devices() == expected
    assert local_devices_for(r) == expected
    four = MPIClusterResolver(comm, gpus_per_node=4, port_base=9000)
    assert four.local_devices() == ["/gpu:0", "/gpu:1", "/gpu:2", "/gpu:3"]
    assert four.num_accelerators() == {"GPU": 4}
    assert four.master() == f"{host}:9000"


def test_mpi_resolver_rejects_non_communicator():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        MPIClusterResolver(comm="world")


def test_tensorflow_style_resolver_in_local_devices_for():
    class Fake:
        def num_accelerators(self):
            return {"GPU": 2}

    assert local_devices_for(Fake()) == ["/gpu:0", "/gpu:1"]


@pytest.mark.mpi(min_size=2)
def test_mpi_resolver_across_ranks(no_slurm, comm):
    r = MPIClusterResolver(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    assert (r.task_id, r.num_workers) == (rank, size)
    assert r.hostnames == comm.allgather(MPI.Get_processor_name())
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    assert (r.local_rank, r.local_size) == (node.Get_rank(), node.Get_size())
    node.Free()
    specs = comm.allgather(r.cluster_spec().as_dict())
    assert all(s == specs[0] for s in specs)
    assert specs[0]["worker"][rank] == f"{r.hostname}:{8888 + r.local_rank}"
    # One GPU per rank when the node has as many GPUs as ranks (one node here).
    if r.num_nodes == 1:
        bound = MPIClusterResolver(comm, gpus_per_node=size)
        assert bound.local_devices() == [f"/gpu:{rank}"]
        assert comm.allgather(bound.local_devices()[0]) == [f"/gpu:{i}" for i in range(size)]


@pytest.mark.mpi(min_size=2)
def test_ranks_share_fewer_gpus_round_robin_with_one_warning_per_node(no_slurm, comm):
    # More ranks than GPUs (a laptop, a one-GPU test node): ranks share them round-robin, and the
    # node's first rank warns once; no rank fails.
    import warnings

    size = comm.Get_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = MPIClusterResolver(comm, gpus_per_node=1)
        assert r.local_devices() == ["/gpu:0"]
        assert r.local_devices() == ["/gpu:0"]  # asked again: bound once, no second warning
    shared = [w for w in caught if issubclass(w.category, RuntimeWarning) and "share 1 GPU(s)" in str(w.message)]
    assert len(shared) == (1 if r.local_rank == 0 else 0), [str(w.message) for w in caught]
    assert sum(comm.allgather(len(shared))) == r.num_nodes
    if size >= 2:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            two = MPIClusterResolver(comm, gpus_per_node=2)
            assert two.local_devices() == [f"/gpu:{r.local_rank % 2}"]
        assert bool([w for w in caught if "share 2 GPU(s)" in str(w.message)]) == (r.local_rank == 0 and r.local_size > 2)


def test_warn_shared_gpus_rule():
    import warnings

    from mpistrat.cluster.resolvers import warn_shared_gpus

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_shared_gpus(0, 4, 2, None) is True
        assert warn_shared_gpus(1, 4, 2, None) is True  # shared, but only a node's first task warns
        assert warn_shared_gpus(0, 2, 2, None) is False  # one GPU each
        assert warn_shared_gpus(0, 4, 0, None) is False  # no GPU: CPUs, nothing shared
        assert warn_shared_gpus(0, 4, 8, 2) is False  # an explicit GPUs-per-task request
    assert [str(w.message).split(":")[0] for w in caught] == ["4 tasks on this node share 2 GPU(s)"]


@pytest.mark.mpi(min_size=2)
def test_mpi_resolver_pretend_nodes(no_slurm, comm, monkeypatch):
    monkeypatch.setenv("MPISTRAT_PRETEND_NODES", "2")
    r = MPIClusterResolver(comm, gpus_per_node=1)
    size = comm.Get_size()
    assert r.num_nodes == 2
    assert r.node_index == comm.Get_rank() * 2 // size
    assert r.cluster_spec().num_tasks("worker") == size
    assert r.local_devices() == ["/gpu:0"]  # one GPU per pretend node, shared by its ranks
    ports = [int(a.rsplit(":", 1)[1]) for a in r.cluster_spec().as_dict()["worker"]]
    first_rank_of_node = [min(q for q in range(size) if q * 2 // size == p * 2 // size) for p in range(size)]
    assert ports == [8888 + p - first_rank_of_node[p] for p in range(size)]


@pytest.mark.mpi(min_size=2)
def test_mpi_resolver_on_sub_communicator(no_slurm, comm):
    rank = comm.Get_rank()
    sub = comm.Split(color=rank % 2, key=rank)
    try:
        r = MPIClusterResolver(sub)
        assert r.comm is sub
        assert (r.task_id, r.num_workers) == (sub.Get_rank(), sub.Get_size())
        assert r.num_workers == len(range(rank % 2, comm.Get_size(), 2))
    finally:
        sub.Free()


# ----------------------------------------------------------------------------- default resolver

def _fake_step(monkeypatch, procid, ntasks):
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", str(ntasks))
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", str(ntasks))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_default_is_mpi_outside_slurm(no_slurm):
    r = default_cluster_resolver(MPI.COMM_SELF)
    assert isinstance(r, MPIClusterResolver)


def test_default_is_slurm_in_matching_step(no_slurm, monkeypatch):
    _fake_step(monkeypatch, 0, 1)
    r = default_cluster_resolver(MPI.COMM_SELF)
    assert isinstance(r, SlurmClusterResolver)
    assert r.comm is MPI.COMM_SELF
    assert (r.task_type, r.task_id) == ("worker", 0)


def test_default_raises_for_a_world_of_one_inside_a_step_of_several_tasks(no_slurm, monkeypatch):
    # srun -n 4 with an MPI not wired to Slurm: every task is alone. (mpiexec -n 2 inside a batch
    # script, whose ranks are not the step's tasks, gives MPIClusterResolver: test_slurm_cluster.py.)
    _fake_step(monkeypatch, 0, 4)
    with pytest.raises(RuntimeError, match="Slurm started 4 tasks in this step"):
        default_cluster_resolver(MPI.COMM_SELF)


def test_default_reports_broken_slurm_environment(no_slurm, monkeypatch):
    _fake_step(monkeypatch, 0, 1)
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(y2)")
    with pytest.raises(RuntimeError, match="Could not build the Slurm cluster resolver: rank 0: ValueError: "
                                           "Invalid tasks-per-node list"):
        default_cluster_resolver(MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
def test_default_choice_agrees_across_ranks(no_slurm, comm, monkeypatch):
    rank, size = comm.Get_rank(), comm.Get_size()
    _fake_step(monkeypatch, rank, size)
    r = default_cluster_resolver(comm)
    assert isinstance(r, SlurmClusterResolver) and r.task_id == rank
    # Task ids that do not match the ranks: every rank falls back to MPI.
    _fake_step(monkeypatch, (rank + 1) % size, size)
    assert isinstance(default_cluster_resolver(comm), MPIClusterResolver)
    # Only rank 0 looks like a Slurm step: still MPI everywhere, no hang.
    if rank != 0:
        monkeypatch.delenv("SLURM_PROCID")
    else:
        _fake_step(monkeypatch, 0, size)
    assert isinstance(default_cluster_resolver(comm), MPIClusterResolver)
    # A broken step on one rank raises on every rank, naming that rank.
    _fake_step(monkeypatch, rank, size)
    if rank == size - 1:
        monkeypatch.setenv("SLURM_STEP_NODELIST", "n[1")
    with pytest.raises(RuntimeError, match=f"rank {size - 1}: ValueError: Invalid hostlist"):
        default_cluster_resolver(comm)


# ----------------------------------------------------------------------------- real GPUs (skipped without)

@pytest.mark.gpu
def test_mpi_resolver_binds_real_gpus(no_slurm):
    import cupy

    n = num_gpus()
    r = MPIClusterResolver(MPI.COMM_SELF)
    assert r.local_devices() == [f"/gpu:{i}" for i in range(n)]
    for device in r.local_devices():
        with cupy.cuda.Device(int(device.split(":")[1])):
            assert int(cupy.arange(3).sum()) == 3


@pytest.mark.gpu(min_gpus=2)
def test_slurm_resolver_hides_other_gpus_from_cuda(tmp_path):
    import subprocess
    import sys

    n = num_gpus()
    script = ("import os\n"
              "from mpistrat.cluster_resolver import SlurmClusterResolver\n"
              "r = SlurmClusterResolver()\n"
              "import cupy\n"
              "print(os.environ['CUDA_VISIBLE_DEVICES'], cupy.cuda.runtime.getDeviceCount(), r.local_devices())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="n1",
               SLURM_STEP_TASKS_PER_NODE="2", SLURM_LOCALID="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    g = n // 2
    expected_cvd = ",".join(str(i) for i in range(g, 2 * g))
    assert out.stdout.split()[0] == expected_cvd
    assert out.stdout.split()[1] == str(g)  # CUDA sees only this task's GPUs
