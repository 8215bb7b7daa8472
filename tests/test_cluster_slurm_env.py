"""SlurmClusterResolver from a Slurm step's environment (set in the test).

The first five tests are TensorFlow's published cases
(slurm_cluster_resolver_test.py), ported; the rest cover mpistrat's errors and
its documented differences from TensorFlow.
"""

import os

import pytest

from mpistrat.cluster_resolver import ClusterSpec, SlurmClusterResolver
from mpistrat.cluster.resolvers import in_slurm_step, local_devices_for


@pytest.fixture
def slurm_env(monkeypatch):
    """Clear Slurm and CUDA variables; return a setter for a fake step.

    The resolver writes CUDA_VISIBLE_DEVICES itself: setting it through
    monkeypatch first makes sure it is restored after the test.
    """
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for key in list(os.environ):
        if key.startswith("SLURM_") or key == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(key)

    def set_env(**values):
        for key, value in values.items():
            name = key if key == "CUDA_VISIBLE_DEVICES" else "SLURM_" + key
            monkeypatch.setenv(name, value)

    return set_env


def _check_spec(spec, expected):
    assert spec.as_dict() == expected
    assert ClusterSpec(spec) == spec
    assert ClusterSpec(spec.as_dict()) == spec


THREE_NODES = dict(STEP_NUM_TASKS="3", STEP_NODELIST="t02n13,t02n41,t02n43")
FIVE_TASKS = dict(PROCID="1", STEP_NUM_TASKS="5", STEP_TASKS_PER_NODE="2(x2),1",
                  STEP_NODELIST="t02n13,t02n41,t02n43", CUDA_VISIBLE_DEVICES="")
WORKERS_4 = {"ps": ["t02n13:8888"],
             "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"]}


def test_simple_retrieval_from_env(slurm_env):
    slurm_env(PROCID="0", STEP_TASKS_PER_NODE="1(x3)", CUDA_VISIBLE_DEVICES="0", **THREE_NODES)
    r = SlurmClusterResolver()
    _check_spec(r.cluster_spec(), {"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]})
    assert r.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert r.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert (r.task_type, r.task_id) == ("worker", 0)


def test_simple_successful_retrieval(slurm_env):
    slurm_env(PROCID="0", **THREE_NODES)
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, port_base=8888, tasks_per_node=1,
                             gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)
    _check_spec(r.cluster_spec(), {"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]})
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_simple_master_retrieval(slurm_env):
    slurm_env(PROCID="0", **THREE_NODES)
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, port_base=8888, tasks_per_node=1,
                             gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False)
    r.task_type = "worker"
    r.task_id = 1
    assert r.master() == "grpc://t02n43:8888"
    r.rpc_layer = "ab"
    assert r.master("ps", 0) == "ab://t02n13:8888"
    assert r.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


def test_task_per_node_not_set_retrieval(slurm_env):
    slurm_env(PROCID="0", STEP_TASKS_PER_NODE="1(x3)", **THREE_NODES)
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, port_base=8888, gpus_per_node=1,
                             gpus_per_task=1, auto_set_gpu=False)
    _check_spec(r.cluster_spec(), {"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]})


def test_multi_task_per_node_retrieval(slurm_env):
    slurm_env(**FIVE_TASKS)
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=2,
                             gpus_per_task=1, auto_set_gpu=True)
    _check_spec(r.cluster_spec(), WORKERS_4)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert (r.task_type, r.task_id) == ("worker", 0)


def test_multiple_gpus_per_task_retrieval(slurm_env):
    slurm_env(**FIVE_TASKS)
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=4,
                             gpus_per_task=2, auto_set_gpu=True)
    _check_spec(r.cluster_spec(), WORKERS_4)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert r.num_accelerators() == {"GPU": 2}
    assert r.local_devices() == ["/gpu:0", "/gpu:1"]  # the process now sees only its two
    assert r.gpu_allocation() == ["0,1", "2,3", "0,1", "2,3", "0,1"]


# ----------------------------------------------------------------------------- beyond TensorFlow's cases

def test_cuda_visible_devices_set_at_creation(slurm_env):
    slurm_env(**FIVE_TASKS)
    SlurmClusterResolver(gpus_per_node=4, gpus_per_task=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"  # before any cluster_spec() call


def test_not_in_a_slurm_step(slurm_env):
    assert not in_slurm_step()
    with pytest.raises(RuntimeError, match=r"SLURM_PROCID not found in environment\. Not running inside a SLURM step\?"):
        SlurmClusterResolver()
    slurm_env(PROCID="0", STEP_NODELIST="n1")
    with pytest.raises(RuntimeError, match="SLURM_STEP_NUM_TASKS not found .* SLURM step"):
        SlurmClusterResolver()
    with pytest.raises(RuntimeError, match="SLURM_STEP_TASKS_PER_NODE not found"):
        SlurmClusterResolver(jobs={"worker": 1})


def test_more_gpus_than_available(slurm_env):
    slurm_env(**FIVE_TASKS)
    with pytest.raises(RuntimeError, match=r"Requested more GPUs per node than available: 2 tasks per node x "
                                           r"2 GPUs per task > 3 GPUs per node"):
        SlurmClusterResolver(gpus_per_node=3, gpus_per_task=2)


def test_more_tasks_requested_than_assigned(slurm_env):
    slurm_env(**FIVE_TASKS)
    with pytest.raises(RuntimeError, match="Requested 6 tasks .* has 5 tasks"):
        SlurmClusterResolver(jobs={"worker": 6}, gpus_per_node=0)


@pytest.mark.parametrize("env, message", [
    (dict(PROCID="x", STEP_NUM_TASKS="1", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="1"),
     "SLURM_PROCID must be an integer, got 'x'"),
    (dict(PROCID="3", STEP_NUM_TASKS="2", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="2"),
     "SLURM_PROCID=3 is outside the step's 2 tasks"),
    (dict(PROCID="0", STEP_NUM_TASKS="3", STEP_NODELIST="n[1-2]", STEP_TASKS_PER_NODE="1(x3)"),
     "names 2 nodes but SLURM_STEP_TASKS_PER_NODE gives 3 counts"),
    (dict(PROCID="0", STEP_NUM_TASKS="2", STEP_NODELIST="n[1-2", STEP_TASKS_PER_NODE="1(x2)"),
     "Invalid hostlist 'n\\[1-2'"),
])
def test_bad_environment_is_named(slurm_env, env, message):
    slurm_env(CUDA_VISIBLE_DEVICES="", **env)
    with pytest.raises((RuntimeError, ValueError), match=message):
        SlurmClusterResolver()


def test_nodes_keep_slurm_order(slurm_env):
    # TensorFlow sorts host names as strings (n10 before n9); Slurm numbers tasks in nodelist order.
    slurm_env(PROCID="1", STEP_NUM_TASKS="2", STEP_NODELIST="n[9-10]", STEP_TASKS_PER_NODE="1(x2)",
              CUDA_VISIBLE_DEVICES="")
    r = SlurmClusterResolver()
    assert r.cluster_spec().as_dict() == {"worker": ["n9:8888", "n10:8888"]}
    assert r.master() == "grpc://n10:8888"


def test_local_id_wins_for_gpus(slurm_env):
    # --distribution=cyclic: rank 2 is the second task of the first node (block order would say
    # the first task of the second node, GPU 0).
    slurm_env(PROCID="2", STEP_NUM_TASKS="4", STEP_NODELIST="n[1-2]", STEP_TASKS_PER_NODE="2(x2)",
              LOCALID="1", CUDA_VISIBLE_DEVICES="0,1")
    r = SlurmClusterResolver()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert r.local_rank == 1


def test_gpus_taken_from_slurm_visible_list(slurm_env):
    # Slurm gave this job GPUs 4-7 of the node: tasks get entries of that list, not 0-3.
    env = dict(PROCID="1", STEP_NUM_TASKS="2", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="2",
               CUDA_VISIBLE_DEVICES="4,5,6,7")
    slurm_env(**env)
    r = SlurmClusterResolver()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert r.local_devices() == ["/gpu:0", "/gpu:1"]
    slurm_env(**env)
    r = SlurmClusterResolver(auto_set_gpu=False)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert r.local_devices() == ["/gpu:2", "/gpu:3"]
    assert local_devices_for(r) == ["/gpu:2", "/gpu:3"]


def test_no_gpus_leaves_environment_alone(slurm_env):
    slurm_env(PROCID="0", STEP_NUM_TASKS="2", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="2",
              CUDA_VISIBLE_DEVICES="")
    r = SlurmClusterResolver()
    assert r.num_accelerators() == {"GPU": 0}
    assert r.local_devices() == ["/cpu:0"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_more_tasks_than_gpus_share(slurm_env):
    slurm_env(PROCID="3", STEP_NUM_TASKS="4", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="4")
    r = SlurmClusterResolver(gpus_per_node=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert r.gpu_allocation() == ["0", "1", "0", "1"]


def test_default_gpus_per_task_splits_node(slurm_env):
    slurm_env(PROCID="3", STEP_NUM_TASKS="4", STEP_NODELIST="n[1-2]", STEP_TASKS_PER_NODE="2(x2)")
    r = SlurmClusterResolver(gpus_per_node=8)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert r.num_accelerators() == {"GPU": 4}


def test_tasks_per_node_as_dict(slurm_env):
    slurm_env(PROCID="2", STEP_NUM_TASKS="3")
    r = SlurmClusterResolver(tasks_per_node={"a": 2, "b": 1}, gpus_per_node=0)
    assert r.cluster_spec().as_dict() == {"worker": ["a:8888", "a:8889", "b:8888"]}
    assert (r.task_type, r.task_id, r.environment) == ("worker", 2, "")


def test_bad_jobs_argument(slurm_env):
    slurm_env(PROCID="0", STEP_NUM_TASKS="1", STEP_NODELIST="n1", STEP_TASKS_PER_NODE="1")
    with pytest.raises(ValueError, match="Number of tasks of job 'worker' must be an int >= 0"):
        SlurmClusterResolver(jobs={"worker": "1"})
    with pytest.raises(ValueError, match="non-empty dict"):
        SlurmClusterResolver(jobs={})


def test_a_process_alone_in_its_mpi_world_inside_a_step_of_several_tasks_is_an_error(slurm_env):
    from mpistrat.cluster.resolvers import _singleton_in_step_error

    assert _singleton_in_step_error(1, "MPICH Version: 5.0.2") is None  # no Slurm step
    slurm_env(PROCID="1", STEP_NUM_TASKS="4", STEP_NODELIST="n[1-2]")
    error = _singleton_in_step_error(1, "Open MPI v5.0.11, package: Open MPI\nmore")
    assert isinstance(error, RuntimeError)
    assert "Slurm started 4 tasks" in str(error) and "Open MPI v5.0.11, package: Open MPI" in str(error)
    assert "srun --mpi=pmix" in str(error) and "mpirun" in str(error)
    assert "srun --mpi=pmi2" in str(_singleton_in_step_error(1, "MPICH Version: 5.0.2"))
    assert _singleton_in_step_error(4, "MPICH Version: 5.0.2") is None  # wired: the world is the step
    slurm_env(STEP_NUM_TASKS="1")
    assert _singleton_in_step_error(1, "MPICH Version: 5.0.2") is None  # a one-task step
