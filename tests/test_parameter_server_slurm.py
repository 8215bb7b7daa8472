"""SlurmClusterResolver's parameter-server roles: TF's ``jobs={"chief": 1, "ps": P, "worker": W}``, ranks in
that order (a fake Slurm step's environment, set in the test), and the strategy's check of a worker task."""

import os

import pytest

import mpistrat as ms
from mpistrat.cluster_resolver import SlurmClusterResolver

FOUR_TASKS = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "n1,n2"}


@pytest.fixture
def slurm_step(monkeypatch):
    """A fake step of 4 tasks on 2 nodes; returns a setter of this process's task."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    for key, value in FOUR_TASKS.items():
        monkeypatch.setenv(key, value)

    def task(procid: int) -> None:
        monkeypatch.setenv("SLURM_PROCID", str(procid))

    return task


@pytest.mark.parametrize("procid, role", [(0, ("chief", 0)), (1, ("ps", 0)), (2, ("worker", 0)), (3, ("worker", 1))])
def test_slurm_ranks_go_to_chief_then_ps_then_workers(slurm_step, procid, role):
    slurm_step(procid)
    resolver = SlurmClusterResolver(jobs={"chief": 1, "ps": 1, "worker": 2}, port_base=8888, auto_set_gpu=False)
    assert (resolver.task_type, resolver.task_id) == role
    assert resolver.cluster_spec().as_dict() == {"chief": ["n1:8888"], "ps": ["n1:8889"],
                                                 "worker": ["n2:8888", "n2:8889"]}


def test_strategy_on_a_slurm_ps_task_says_to_run_a_server_there(slurm_step):
    slurm_step(1)
    resolver = SlurmClusterResolver(jobs={"chief": 1, "ps": 1, "worker": 2}, auto_set_gpu=False)
    with pytest.raises(RuntimeError, match=r"on this ps task 0: there, run ms\.Server\(.*\)\.join\(\)"):
        ms.ParameterServerStrategy(resolver)
