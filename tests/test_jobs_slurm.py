"""The Slurm job templates in jobs/, submitted to a real single-node Slurm cluster (tests/slurm.py).

The CPU templates run for real with ``sbatch --wait`` (the several-nodes one with ``--nodes=1``, as the
test cluster has one node); the GPU template is validated with ``sbatch --test-only``: with its GPU
lines as written Slurm must reject it here (the node has no GPUs), and with the lines marked
``GPU-LINE`` removed (and fewer cores per task) Slurm must accept it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm import slurm_cluster  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"

pytestmark = pytest.mark.slurm


@pytest.fixture
def job_env(slurm_cluster, monkeypatch, tmp_path):
    """Point the templates' parameters at this checkout and temporary data/checkpoint directories."""
    for key, value in {"MPISTRAT_REPO": str(REPO), "MPISTRAT_VENV": str(Path(sys.executable).parents[1]),
                       "DATA_DIR": str(tmp_path / "data"), "CKPT_DIR": str(tmp_path / "ck"), "EPOCHS": "3",
                       "MPI_PLUGIN": slurm_cluster.mpi_plugin() or "pmi2"}.items():
        monkeypatch.setitem(slurm_cluster.env, key, value)
    return tmp_path


def _unwired(slurm_cluster, result, ranks: int) -> bool:
    """Where srun cannot wire this MPI (Open MPI 5 without Slurm's PMIx library), whether the job failed
    with the error every task gives (no task trained alone); False where srun wires it."""
    if slurm_cluster.mpi_plugin() is not None:
        return False
    assert result.returncode != 0 and f"Slurm started {ranks} tasks in this step" in result.output + result.stderr
    return True


def _check_run(result, ranks: int) -> float:
    text = result.output
    assert result.returncode == 0, f"sbatch exit {result.returncode}\n{result.stderr}\n{text}"
    assert re.search(rf"^job {result.job_id}: {ranks} ranks", text, re.M), text
    assert f"{ranks} workers x 1 replicas = {ranks} replicas" in text, text
    assert len(re.findall(r"^epoch 3/3 ", text, re.M)) == 1, text
    match = re.search(r"^final test accuracy (\d\.\d+) after 3 epochs", text, re.M)
    assert match, text
    return float(match.group(1))


@pytest.mark.timeout(240)
def test_cpu_one_node_template(slurm_cluster, job_env):
    result = slurm_cluster.sbatch(JOBS / "slurm_cpu_one_node.sbatch", timeout=200)
    if _unwired(slurm_cluster, result, 4):
        return
    assert _check_run(result, 4) > 0.9
    assert (job_env / "ck" / "ckpt-3.npz").is_file()
    again = slurm_cluster.sbatch(JOBS / "slurm_cpu_one_node.sbatch", timeout=200)  # a requeued job resumes
    assert again.returncode == 0 and "resumed from" in again.output and "evaluating only" in again.output, again.output


@pytest.mark.timeout(240)
def test_cpu_multi_node_template_on_one_node(slurm_cluster, job_env):
    result = slurm_cluster.sbatch(JOBS / "slurm_cpu_multi_node.sbatch", "--nodes=1", "--ntasks-per-node=2",
                                  timeout=200)
    if _unwired(slurm_cluster, result, 2):
        return
    assert _check_run(result, 2) > 0.9


@pytest.mark.timeout(240)
def test_parameter_server_template(slurm_cluster, job_env):
    result = slurm_cluster.sbatch(JOBS / "slurm_parameter_server.sbatch", timeout=200)
    if _unwired(slurm_cluster, result, 4):
        return
    text = result.output
    assert result.returncode == 0, f"sbatch exit {result.returncode}\n{result.stderr}\n{text}"
    assert "1 chief, 1 ps, 2 workers" in text, text
    match = re.search(r"^final test accuracy (\d\.\d+) after 3 epochs", text, re.M)
    assert match and float(match.group(1)) > 0.7, text  # 3 epochs (job_env): learning, not converged


def test_gpu_template_test_only(slurm_cluster, job_env, tmp_path):
    script = (JOBS / "slurm_gpu.sbatch").read_text()
    assert "--gpus-per-task=1" in script and re.search(r"^#SBATCH --ntasks-per-node=\d+", script, re.M)
    assert 'srun --mpi="$MPI_PLUGIN"' in script
    as_written = slurm_cluster.run(["sbatch", "--test-only", str(JOBS / "slurm_gpu.sbatch")], timeout=60)
    assert as_written.returncode != 0, "this node has no GPUs: Slurm must refuse --gpus-per-task=1"
    assert "gres" in as_written.stderr.lower(), as_written.stderr  # "Invalid generic resource (gres) specification"
    adapted = tmp_path / "gpu_adapted.sbatch"
    adapted.write_text("\n".join(line for line in script.splitlines() if "GPU-LINE" not in line) + "\n")
    result = slurm_cluster.run(["sbatch", "--test-only", "--cpus-per-task=1", str(adapted)], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["slurm_cpu_one_node.sbatch", "slurm_cpu_multi_node.sbatch", "slurm_gpu.sbatch",
                                  "slurm_parameter_server.sbatch"])
def test_templates_have_editable_parameters_and_site_notes(name):
    text = (JOBS / name).read_text()
    assert text.startswith("#!/bin/bash\n")
    example = "examples/train_ps.py" if "parameter_server" in name else "examples/train.py"
    for needle in ("#SBATCH --nodes=", "#SBATCH --ntasks-per-node=", "#SBATCH --time=", "--partition",
                   "module load", ': "${EPOCHS:=', ': "${MPI_PLUGIN:=pmi2}"', example):
        assert needle in text, (name, needle)
