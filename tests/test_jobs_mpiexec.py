"""jobs/mpiexec_one_node.sh: the one-node launcher without Slurm, run for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(150)
def test_mpiexec_launcher_runs_training(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "SLURM_"))}
    env.update(NP="2", EPOCHS="2", DATA_DIR=str(tmp_path / "data"), CKPT_DIR=str(tmp_path / "ck"),
               MPISTRAT_VENV=str(Path(sys.executable).parents[1]))
    result = subprocess.run(["bash", str(REPO / "jobs" / "mpiexec_one_node.sh"), "--no-progress", "--seed", "1"],
                            capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 workers x 1 replicas" in result.stdout
    assert re.search(r"^final test accuracy 0\.\d+ after 2 epochs", result.stdout, re.M), result.stdout
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-1.npz", "ckpt-2.npz"]
    bad = subprocess.run(["bash", str(REPO / "jobs" / "mpiexec_one_node.sh"), "--epochs", "zero"],
                         capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert bad.returncode != 0 and "--epochs" in bad.stderr
