"""jobs/mpiexec_one_node.sh: the one-node launcher without Slurm, run for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from terminal import run_on_terminal

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(150)
def test_mpiexec_launcher_runs_training(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "SLURM_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
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


@pytest.mark.timeout(150)
def test_main_job_script_on_a_terminal_shows_the_bar_and_epoch_lines(tmp_path):
    """``bash scripts/main_job.sh`` (the README's main command) with its stderr on a terminal."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "SLURM_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["MPISTRAT_VENV"] = str(Path(sys.executable).parents[1])
    code, out, terminal = run_on_terminal(["bash", str(REPO / "scripts" / "main_job.sh"), "--epochs", "2",
                                           "--data-dir", str(tmp_path / "data")], env, timeout=120)
    assert code == 0, out + terminal
    assert "[main job] mpiexec -n 4 python examples/train.py --progress --epochs 2" in out
    assert "4 workers x 1 replicas = 4 replicas" in out
    assert len(re.findall(r"^epoch \d/2  loss .* examples/s$", out, re.M)) == 2, out  # rank 0 only
    assert re.search(r"^final test accuracy 0\.\d+ after 2 epochs on 4 workers", out, re.M), out
    assert "epoch 1/2:" in terminal and "/22 [" in terminal, terminal  # tqdm's bar, forwarded by mpiexec
    assert "|" not in out
