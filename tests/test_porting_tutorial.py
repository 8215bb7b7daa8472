"""The TF custom-training-loop tutorial's port gives the same losses on 1 and 2 ranks (docs/porting.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpirun import clean_env, run_job

PROGRAM = str(Path(__file__).resolve().parents[1] / "examples" / "custom_training_loop.py")


@pytest.mark.timeout(240)
def test_two_ranks_give_the_one_rank_losses(tmp_path):
    """Same program, same global batch: mpiexec -n 2 matches one rank to float32 tolerance.

    TF's tutorial (tutorials/distribute/custom_training) divides the summed
    per-example loss by the global batch (tf.nn.compute_average_loss), sums the
    gradients over replicas (apply_gradients in replica context) and reduces the
    loss with SUM, so the result does not depend on how many replicas share a batch.
    """
    one = tmp_path / "one.json"
    two = tmp_path / "two.json"
    args = ["--epochs", "2", "--output"]
    single = subprocess.run([sys.executable, PROGRAM, *args, str(one)], capture_output=True, text=True,
                            timeout=200, env=clean_env())
    assert single.returncode == 0, single.stdout + single.stderr
    job = run_job([PROGRAM, *args, str(two)], ranks=2, limit=200)
    assert job.returncode == 0, job.output
    assert job.output.count("Epoch 1, Loss:") == 1, "only rank 0 prints"
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert len(a["step_losses"]) == len(b["step_losses"]) == 2 * 23  # 1438 examples in batches of 64
    np.testing.assert_allclose(b["step_losses"], a["step_losses"], rtol=2e-5)
    for ea, eb in zip(a["epochs"], b["epochs"]):
        np.testing.assert_allclose(eb["loss"], ea["loss"], rtol=2e-5)
        assert eb["accuracy"] == ea["accuracy"] and eb["test_accuracy"] == ea["test_accuracy"]
    assert a["epochs"][-1]["loss"] < a["epochs"][0]["loss"] < a["step_losses"][0]  # it learns
