"""benchmarks/train_step.py: its arithmetic, its weight check, its driver and ``--plot`` (speed is not asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpistrat.examples.mlp import MLP, softmax_cross_entropy_sum

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
SCRIPT = str(BENCHMARKS / "train_step.py")
sys.path.insert(0, str(BENCHMARKS))

import train_step as ts  # benchmarks/ is not a package

NO_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                 "sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0]); runpy.run_path(sys.argv[0], run_name='__main__')")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "SLURM_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout the whole group (driver, mpiexec, ranks) is stopped."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                           stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        pytest.fail(f"{cmd} ran past {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, job.returncode, out, err)


def test_layer_gradients_are_the_example_mlps():
    """The benchmark's forward and layer-by-layer backward compute what mpistrat/examples/mlp.py computes."""
    rng = np.random.default_rng(0)
    model = MLP([12, 16, 16, 5], seed=3, dtype="float64")
    params = [np.array(v.value()) for v in model.variables]
    x = rng.standard_normal((9, 12))
    labels = rng.integers(0, 5, size=9)
    expected_loss, _, expected = model.loss_and_gradients(x, labels)
    logits, acts = ts.forward(params, x)
    loss, dlogits = softmax_cross_entropy_sum(logits, labels)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-12)
    produced = list(ts.layer_gradients(params, acts, dlogits))
    assert [layer for layer, _, _ in produced] == [2, 1, 0], "last layer first"
    for layer, dkernel, dbias in produced:
        np.testing.assert_allclose(dkernel, expected[2 * layer], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(dbias, expected[2 * layer + 1], rtol=1e-12, atol=1e-14)
    for got, want in zip(ts.gradients(params, x, labels), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_weight_check_flags_a_mode_that_did_other_work():
    from mpi4py import MPI

    rng = np.random.default_rng(1)
    initial = [rng.standard_normal((4, 3)).astype(np.float32), np.zeros(3, np.float32)]
    raw = [initial[0] - 0.1, initial[1] + 0.05]
    rounding = [raw[0] * (1 + 1e-7), raw[1].copy()]
    unreduced = [initial[0] - 0.1 / 2, initial[1] + 0.05 / 2]  # as if each replica had kept its own gradients
    problems, differences = ts.check_weights(MPI.COMM_SELF, ["raw", "mpistrat", "overlap"],
                                             [raw, rounding, unreduced], initial)
    assert differences["mpistrat"] < 1e-5 and differences["overlap"] == pytest.approx(0.5, rel=1e-3)
    assert problems == [("overlap: weights differ from raw's by 5.0e-01 of the distance trained (float32 rounding "
                         f"stays below {ts.SAME_WORK_TOLERANCE:g})")]
    not_finite = [raw[0].copy(), raw[1].copy()]
    not_finite[1][0] = np.nan
    problems, _ = ts.check_weights(MPI.COMM_SELF, ["raw", "mpistrat"], [raw, not_finite], initial)
    assert any(p.startswith("mpistrat: weights not finite") for p in problems), problems


def test_modes_are_checked():
    assert ts.parse_modes("mpistrat, overlap") == ["mpistrat", "overlap"]
    assert ts.parse_modes("raw,mpistrat") == ["mpistrat"]
    assert ts.parse_modes("barrier") == ["barrier"]
    with pytest.raises(Exception, match="modes must be distinct names"):
        ts.parse_modes("mpistrat,fast")
    with pytest.raises(Exception, match="modes must be distinct names"):
        ts.parse_modes("mpistrat,mpistrat")


@pytest.mark.timeout(300)
def test_driver_measures_every_rank_count_and_plots(tmp_path):
    if shutil.which("mpiexec", path=os.path.dirname(sys.executable)) is None and shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    plotting = importlib.util.find_spec("matplotlib") is not None
    out_json, png = tmp_path / "steps.json", tmp_path / "steps.png"
    cmd = [sys.executable, SCRIPT, "--ranks", "1", "2", "--steps", "2", "--warmup", "1", "--json", str(out_json)]
    cmd += ["--plot", str(png)] if plotting else []
    result = _run(cmd, timeout=240)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert result.stdout.count("equal on every rank in every training mode") == 2, result.stdout
    saved = json.loads(out_json.read_text())
    table = saved["table"]
    assert sorted(table) == ["1", "2"]
    for ranks, modes in table.items():
        assert sorted(modes) == ["barrier", "mpistrat", "overlap", "raw"]
        for row in modes.values():  # one run: its medians are the table's
            assert row["step_s"] > 0 and row["pair"] > 0
            assert row["examples_per_s"] == pytest.approx(int(ranks) * ts.BATCH_PER_RANK / row["step_s"])
            assert 0 <= row["reducing_fraction"] <= 1
    assert table["1"]["raw"]["efficiency"] == pytest.approx(1.0)
    run = saved["runs"]["2"][0]
    assert run["ranks"] == 2 and run["blas_threads"]["OMP_NUM_THREADS"] == "1" and run["problems"] == []
    assert len(run["results"]["overlap"]["step_s_all"]) == 2
    # the barrier bound trains each rank apart: its weights are not checked, the training modes' are
    assert sorted(run["weight_difference_from_raw"]) == ["mpistrat", "overlap"]
    if plotting:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_stops_before_measuring(tmp_path):
    result = _run([sys.executable, "-c", NO_MATPLOTLIB, SCRIPT, "--plot", str(tmp_path / "x.png")], timeout=60)
    assert result.returncode == 1
    assert "--plot needs matplotlib" in result.stderr and "mpistrat[plot]" in result.stderr, result.stderr
    assert "mpiexec" not in result.stdout, "nothing was measured"
    assert not (tmp_path / "x.png").exists()


def test_bad_use_is_refused_with_a_message():
    result = _run([sys.executable, SCRIPT, "--worker", "--plot", "x.png"], timeout=60)
    assert result.returncode == 2 and "--plot and --json belong to the driver" in result.stderr
    result = _run([sys.executable, SCRIPT, "--modes", "mpistrat,turbo"], timeout=60)
    assert result.returncode == 2 and "modes must be distinct names" in result.stderr
