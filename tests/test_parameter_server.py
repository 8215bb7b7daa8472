"""ParameterServerStrategy, ClusterCoordinator and Server: jobs of 4 ranks (chief, 1 ps, 2 workers) and 5 ranks
(2 ps) run ``tests/ps_program.py`` under their own ``mpiexec``; TF's argument checks in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpirun import clean_env, run_job, wait_for_no_leftovers

import mpistrat as ms
from mpistrat.cluster.resolvers import ClusterResolver, ClusterSpec

PROGRAM = str(Path(__file__).with_name("ps_program.py"))
CASES = ["placement", "count", "remote_value", "shards", "errors", "remote_value_argument", "worker_index",
         "datasets", "staleness", "optimizer", "unavailable"]


def _job(ranks: int, cases: list[str], tmp_path: Path, **env: str):
    job = run_job([PROGRAM, ",".join(cases)], ranks, limit=150,
                  env=clean_env(PS_PID_DIR=str(tmp_path), PS_CKPT_DIR=str(tmp_path), **env))
    assert job.returncode == 0, job.output
    for case in cases:
        assert f"ok {case}\n" in job.output, job.output
    num_ps = int(env.get("PS_COUNT", "1"))
    # shutdown: every server's join() returned, and no rank is left waiting
    for task in [f"ps {i}" for i in range(num_ps)] + [f"worker {i}" for i in range(ranks - 1 - num_ps)]:
        assert f"{task} returned from join" in job.output, job.output
    assert wait_for_no_leftovers(job.tag) == []
    return job


@pytest.mark.timeout(200)
def test_chief_one_ps_two_workers(tmp_path):
    _job(4, CASES, tmp_path)


@pytest.mark.timeout(200)
def test_chief_two_ps_two_workers(tmp_path):
    _job(5, CASES, tmp_path, PS_COUNT="2")


@pytest.mark.timeout(200)
def test_checkpoint_of_ps_variables_resumes_in_another_job_and_shard_count(tmp_path):
    _job(4, ["save"], tmp_path, PS_SHARDS="3")  # 10 steps, saved
    assert (tmp_path / "ps.npz").is_file()
    _job(5, ["restore"], tmp_path, PS_COUNT="2", PS_SHARDS="5")  # restored after 10, 10 more: 20


class _Resolver(ClusterResolver):
    def __init__(self, jobs: dict, task_type: str | None = "chief", task_id: int = 0) -> None:
        self._spec, self.task_type, self.task_id = ClusterSpec(jobs), task_type, task_id
        self.rpc_layer = None

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


@pytest.mark.parametrize("jobs, message", [
    ({}, "Cluster spec must be non-empty"),
    ({"chief": ["a:1"], "worker": ["b:1"]}, "There must be at least one ps."),
    ({"chief": ["a:1"], "ps": ["b:1"]}, "There must be at least one worker."),
    ({"chief": ["a:1"], "ps": ["b:1"], "worker": ["c:1"], "evaluator": ["d:1"]}, "Disallowed task type"),
])
def test_strategy_checks_the_cluster_as_tensorflow_does(jobs, message):
    with pytest.raises(ValueError, match=message):
        ms.ParameterServerStrategy(_Resolver(jobs))


def test_strategy_on_a_worker_task_says_to_run_a_server_there():
    jobs = {"chief": ["a:1"], "ps": ["b:1"], "worker": ["c:1", "d:1"]}
    with pytest.raises(RuntimeError, match=r"on this worker task 1: there, run ms\.Server\(.*\)\.join\(\)"):
        ms.ParameterServerStrategy(_Resolver(jobs, "worker", 1))


def test_server_serves_ps_and_worker_tasks_only():
    jobs = {"chief": ["a:1"], "ps": ["b:1"], "worker": ["c:1"]}
    with pytest.raises(ValueError, match="not 'chief'"):
        ms.Server(jobs, job_name="chief", task_index=0, start=False)
    with pytest.raises(ValueError, match="task 3 of job 'worker' does not exist"):
        ms.Server(jobs, job_name="worker", task_index=3, start=False)
    assert ms.Server(jobs, job_name="worker", task_index=0, start=False).target == "mpi://rank2"


def test_mpi_resolver_roles_need_enough_ranks(monkeypatch):
    with pytest.raises(ValueError, match="num_ps=1 needs at least 3 ranks"):
        ms.cluster_resolver.MPIClusterResolver(num_ps=1)
    monkeypatch.setenv("MPISTRAT_NUM_PS", "2")
    with pytest.raises(ValueError, match="num_ps=2 needs at least 4 ranks"):
        ms.cluster_resolver.MPIClusterResolver()
    resolver = ms.cluster_resolver.MPIClusterResolver(num_ps=0)  # no ps: one worker per rank, as before
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)


def test_names_are_tensorflows():
    assert issubclass(ms.errors.CancelledError, ms.errors.OpError)
    assert ms.experimental.coordinator.ClusterCoordinator is ms.coordinator.ClusterCoordinator
    assert ms.experimental.ParameterServerStrategy is ms.ParameterServerStrategy
    with pytest.raises(ValueError, match="Only `tf.distribute.experimental.ParameterServerStrategy` is supported"):
        ms.coordinator.ClusterCoordinator(ms.OneDeviceStrategy("/cpu:0"))



@pytest.mark.timeout(200)
def test_the_asynchronous_example_trains(tmp_path):
    example = str(Path(__file__).resolve().parents[1] / "examples" / "train_ps.py")
    job = run_job([example], 4, limit=150, env=clean_env())  # 10 epochs: about 1 s
    assert job.returncode == 0, job.output
    assert "1 chief, 1 ps, 2 workers" in job.output, job.output
    final = [line for line in job.output.splitlines() if line.startswith("final test accuracy")]
    assert final and float(final[0].split()[3]) > 0.95, job.output  # MultiWorkerMirrored's: 0.98
    assert wait_for_no_leftovers(job.tag) == []
