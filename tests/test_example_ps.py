"""examples/train_ps.py beyond its 4-rank run (in test_parameter_server.py): 2 ps at 5 ranks with the staleness
bound, and a rank count too small for the ps asked for, each under its own ``mpiexec``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpirun import clean_env, run_job, wait_for_no_leftovers

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train_ps.py")


@pytest.mark.timeout(150)
def test_two_ps_synchronous_rounds_train():
    job = run_job([EXAMPLE, "--num-ps", "2", "--epochs", "5", "--staleness", "0"], 5, limit=120, env=clean_env())
    assert job.returncode == 0, job.output
    assert "1 chief, 2 ps, 2 workers" in job.output, job.output
    assert len(re.findall(r"^epoch \d+/5: ", job.output, re.MULTILINE)) == 5, job.output
    match = re.search(r"^final test accuracy (\d\.\d+) after 5 epochs", job.output, re.MULTILINE)
    assert match and float(match.group(1)) > 0.9, job.output  # 5 epochs: 0.95 here, 20 epochs: 0.98
    assert wait_for_no_leftovers(job.tag) == []


@pytest.mark.timeout(90)
def test_too_few_ranks_for_the_ps_fail_on_every_rank():
    job = run_job([EXAMPLE, "--num-ps", "3"], 4, limit=60, env=clean_env())
    assert job.returncode != 0, job.output
    message = "num_ps=3 needs at least 5 ranks (a chief, the ps and a worker); this job has 4"
    assert job.output.count(message) == 4, job.output  # every rank says why, none waits
    assert wait_for_no_leftovers(job.tag) == []
