"""The main job as a whole program: one process, mpiexec -n 4, layout equivalence, resume, bad flags, data prep."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpistrat.train.checkpoint_file import member_name
from terminal import run_on_terminal

from mpistrat.examples import digits as D
from mpistrat.examples import train as T
from mpistrat.examples.mlp import MLP

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "examples" / "train.py")
MODEL_PREFIX = "model/"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "SLURM_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _mpiexec() -> str:
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip("no mpiexec next to the Python interpreter (install mpistrat[mpich])")
    return path


def run_train(ranks: int, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``train.py`` in one process (ranks=0) or under ``mpiexec -n ranks``; fails with its output."""
    cmd = [sys.executable, TRAIN, *flags]
    if ranks:  # `timeout` stops mpiexec with SIGTERM first, so that it takes its ranks down with it
        cmd = ["timeout", "-k", "10", str(int(timeout)), _mpiexec(), "-n", str(ranks), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30, env=_env(),
                          stdin=subprocess.DEVNULL)


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _final_accuracy(out: str) -> float:
    match = re.search(r"final test accuracy (\d\.\d+)", out)
    assert match, out
    return float(match.group(1))


def _arrays(path: str) -> dict:
    with np.load(path, allow_pickle=False) as z:
        manifest = json.loads(bytes(z["__manifest__"]).decode())
        return {e["name"]: z[member_name(e["name"])] for e in manifest["variables"]}  # members named by variable


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("digits-data"))


def test_one_process_learns_digits(data_dir):
    out = _ok(run_train(0, "--epochs", "3", "--data-dir", data_dir, "--strategy", "mirrored"))
    assert "1 workers x 1 replicas" in out
    assert len(re.findall(r"^epoch \d/3  loss \d+\.\d+  accuracy \S+  test accuracy \S+  \d+ examples/s$", out,
                          re.M)) == 3, out
    assert _final_accuracy(out) > 0.9


def test_module_entry_point_help():
    out = _ok(subprocess.run([sys.executable, "-m", "mpistrat.examples.train", "--help"], capture_output=True,
                             text=True, timeout=60, env=_env()))
    for flag in ("--epochs", "--global-batch-size", "--learning-rate", "--optimizer", "--seed", "--checkpoint-dir",
                 "--checkpoint-every", "--resume", "--devices", "--data-dir", "--no-progress"):
        assert flag in out


@pytest.mark.timeout(150)
def test_four_ranks_reach_90_percent_and_only_rank_0_prints(data_dir, tmp_path):
    t0 = time.monotonic()
    result = run_train(4, "--epochs", "6", "--data-dir", data_dir, "--checkpoint-dir", str(tmp_path / "ck"),
                       "--checkpoint-every", "2")
    seconds = time.monotonic() - t0
    out = _ok(result)
    assert "4 workers x 1 replicas = 4 replicas" in out
    assert len(re.findall(r"^epoch 1/6 ", out, re.M)) == 1, "only rank 0 prints"
    assert len(re.findall(r"^epoch \d/6 ", out, re.M)) == 6
    assert _final_accuracy(out) > 0.9
    print(f"4 ranks, 6 epochs: {seconds:.1f} s")  # speed is reported (benchmarks measure it), not asserted
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-2.npz", "ckpt-4.npz", "ckpt-6.npz"]
    assert result.stderr.strip() == "", "no progress bar without a TTY, and quiet ranks"


@pytest.mark.timeout(200)
def test_layouts_train_the_same_weights(data_dir, tmp_path):
    """1x1, 1 rank x 4 replicas, 2 x 2 and 4 x 1 (same seed and global batch) end with the same weights."""
    layouts = [(0, "/cpu:0"), (1, "/cpu:0,/cpu:1,/cpu:2,/cpu:3"), (2, "/cpu:0,/cpu:1"), (4, "/cpu:0")]
    results = {}
    for ranks, devices in layouts:
        ck = tmp_path / f"r{ranks}-{devices.count(',') + 1}"
        _ok(run_train(ranks, "--epochs", "2", "--dtype", "float64", "--optimizer", "sgd", "--seed", "3",
                      "--devices", devices, "--data-dir", data_dir, "--checkpoint-dir", str(ck), "--no-progress"))
        results[(ranks, devices)] = _arrays(str(ck / "ckpt-2.npz"))
    reference = results[layouts[0]]
    initial = MLP([64, 64, 10], seed=3, dtype="float64").variables[0].numpy()
    assert np.abs(reference["model/mlp/dense_0/kernel"] - initial).max() > 1e-3  # training moved the weights
    for layout, arrays in results.items():
        assert sorted(arrays) == sorted(reference)
        for name, value in arrays.items():
            np.testing.assert_allclose(value, reference[name], rtol=1e-9, atol=1e-12, err_msg=f"{layout} {name}")


@pytest.mark.timeout(150)
def test_resume_continues_the_same_trajectory(data_dir, tmp_path):
    common = ["--optimizer", "adam", "--dtype", "float64", "--data-dir", data_dir, "--no-progress"]
    _ok(run_train(2, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "straight"), *common))
    _ok(run_train(2, "--epochs", "1", "--checkpoint-dir", str(tmp_path / "split"), *common))
    out = _ok(run_train(2, "--epochs", "2", "--resume", "--checkpoint-dir", str(tmp_path / "split"), *common))
    assert "resumed from" in out and "ckpt-1.npz (epoch 1)" in out
    assert "epoch 1/2" not in out and "epoch 2/2" in out
    straight = _arrays(str(tmp_path / "straight" / "ckpt-2.npz"))
    resumed = _arrays(str(tmp_path / "split" / "ckpt-2.npz"))
    assert int(resumed["optimizer/Adam/iterations"]) == int(straight["optimizer/Adam/iterations"]) > 0
    for name in straight:
        np.testing.assert_allclose(resumed[name], straight[name], rtol=1e-12, atol=1e-14, err_msg=name)
    done = _ok(run_train(0, "--epochs", "2", "--resume", "--checkpoint-dir", str(tmp_path / "split"), *common))
    assert "evaluating only" in done and _final_accuracy(done) > 0.5


def test_bad_flags_are_clear_errors(data_dir):
    for flags, message in [
        (["--global-batch-size", "0"], "must be > 0"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--devices", "/tpu:0"], "tpu"),
        (["--optimizer", "rmsprop"], "invalid choice"),
    ]:
        result = run_train(0, *flags, "--data-dir", data_dir)
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr.lower(), (flags, result.stderr)
    result = run_train(2, "--num-shards", "3", "--epochs", "1", "--data-dir", data_dir, timeout=60)
    assert result.returncode != 0
    assert "--num-shards 3 is not a multiple of the 2 ranks" in result.stderr, result.stderr  # first rank aborts all
    result = run_train(0, "--global-batch-size", "5000", "--data-dir", data_dir, "--strategy", "mirrored")
    assert result.returncode != 0 and "larger than the 1432 training examples" in result.stderr


def test_data_is_written_once_with_the_documented_layout(tmp_path):
    data = D.prepare_digits(str(tmp_path), 4)
    stamp = {f: os.stat(f).st_mtime_ns for f in data.train_files + data.test_files}
    again = D.prepare_digits(str(tmp_path), 4)
    assert {f: os.stat(f).st_mtime_ns for f in again.train_files + again.test_files} == stamp
    assert sorted(os.listdir(tmp_path)) == ["digits-4shards"]  # no temporary directories left
    shards = [np.load(f) for f in data.train_files]
    assert {s.shape for s in shards} == {(data.rows_per_shard, 65)} and data.num_train == 4 * data.rows_per_shard
    assert data.num_train + data.num_test <= 1797 and data.num_test == 359
    # Example i of the stored order is row i // S of shard i % S: interleaving the shards reads it back in order.
    interleaved = np.stack(shards, axis=1).reshape(-1, 65)
    labels = interleaved[:, 64]
    assert set(np.unique(labels)) == set(range(10)) and np.all(interleaved[:, :64] <= 1.0)
    with open(os.path.join(data.directory, "manifest.json"), "w") as f:
        f.write("{broken")
    with pytest.raises(RuntimeError, match="no valid manifest"):
        D.DigitsData(data.directory)


def test_one_fused_all_reduce_per_replica_and_step(data_dir, monkeypatch, capsys):
    import mpistrat as ms

    calls = []
    original = ms.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(len(ms.nest.flatten(value)))
        return original(self, reduce_op, value, options)

    monkeypatch.setattr(ms.ReplicaContext, "all_reduce", counting)
    assert T.main(["--epochs", "1", "--strategy", "mirrored", "--devices", "/cpu:0,/cpu:1", "--data-dir", data_dir,
                   "--hidden", "16", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    steps = int(re.search(r"(\d+) steps/epoch", out).group(1))
    assert len(calls) == 2 * steps  # one call per replica per step ...
    assert set(calls) == {3 * 2 + 1}  # ... carrying all 6 gradients and the example count


def test_updates_go_through_merge_call_and_metrics_are_sync_on_read(data_dir, monkeypatch):
    import mpistrat as ms

    merges, updates = [], []
    merge_call, update, update_each = ms.ReplicaContext.merge_call, ms.StrategyExtended.update, \
        ms.StrategyExtended._update_each

    def counting_merge(self, merge_fn, args=(), kwargs=None):
        merges.append(self.replica_id_in_sync_group)
        return merge_call(self, merge_fn, args, kwargs)

    def counting_update(self, var, fn, args=(), kwargs=None, group=True):
        updates.append(var.name)
        return update(self, var, fn, args, kwargs, group)

    def counting_update_each(self, variables, fn, values):  # an optimizer's step: update of each, batched
        updates.extend(v.name for v in variables)
        return update_each(self, variables, fn, values)

    monkeypatch.setattr(ms.ReplicaContext, "merge_call", counting_merge)
    monkeypatch.setattr(ms.StrategyExtended, "update", counting_update)
    monkeypatch.setattr(ms.StrategyExtended, "_update_each", counting_update_each)
    args = T.parse_args(["--epochs", "1", "--strategy", "mirrored", "--devices", "/cpu:0,/cpu:1", "--optimizer", "adam",
                         "--data-dir", data_dir, "--hidden", "16", "--no-progress"])
    strategy = T._make_strategy(args)
    trainer = T.Trainer(strategy, args, D.prepare_digits(data_dir, 8))
    metrics = trainer.train_metrics.vars
    for var in metrics.values():
        assert isinstance(var, ms.SyncOnReadVariable) and var.aggregation == ms.VariableAggregation.SUM
    result, _ = trainer.train_epoch(0, None)
    steps = trainer.steps_per_epoch
    assert sorted(merges) == [0] * steps + [1] * steps  # every replica enters merge_call once per step
    for var in trainer.model.trainable_variables:  # one update (extended.update or _update_each) per variable, step
        assert updates.count(var.name) == steps, (var.name, updates.count(var.name), steps)
    # each replica's copy holds its own partial sums; the cross-replica read is their sum
    copies = [float(np.asarray(c.numpy())) for c in metrics["count"].values]
    assert copies == [steps * args.global_batch_size / 2] * 2 and result["count"] == steps * args.global_batch_size
    assert 0 < result["correct"] <= result["count"] and result["loss"] > 0


def test_progress_bar_on_a_terminal(data_dir):
    code, out, bar = run_on_terminal([sys.executable, TRAIN, "--epochs", "1", "--strategy", "mirrored", "--data-dir",
                                      data_dir], _env(), timeout=60)
    assert code == 0, out + bar
    assert "epoch 1/1:" in bar and "/22 [" in bar, bar  # tqdm's bar on the terminal (stderr) ...
    assert "|" not in out  # ... and never in the log on stdout


@pytest.mark.gpu
@pytest.mark.timeout(150)
def test_gpu_replica_trains_like_cpu(data_dir, tmp_path):
    for device in ("/cpu:0", "/gpu:0"):
        _ok(run_train(0, "--epochs", "1", "--dtype", "float64", "--strategy", "mirrored", "--devices", device,
                      "--data-dir", data_dir, "--checkpoint-dir", str(tmp_path / device.strip("/:").replace(":", "")),
                      "--no-progress"))
    cpu, gpu = _arrays(str(tmp_path / "cpu0" / "ckpt-1.npz")), _arrays(str(tmp_path / "gpu0" / "ckpt-1.npz"))
    for name in cpu:
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=1e-9, atol=1e-12, err_msg=name)
