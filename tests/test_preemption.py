"""PreemptionCheckpointHandler: a signal to one rank saves a checkpoint on every rank at the next step and exits 42;
the rerun resumes and ends with the weights of an uninterrupted run, bit for bit (``mpiexec -n 2``, launched here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from mpirun import clean_env, leftovers, mpiexec, run_job, wait_for_no_leftovers

import mpistrat as ms
from mpistrat.train.preemption import EXIT_CODE, PreemptionCheckpointHandler, TerminationConfig

TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
EPOCHS = "12"


def _train_args(ckpt: Path, data: Path) -> list[str]:
    return [TRAIN, "--epochs", EPOCHS, "--checkpoint-dir", str(ckpt), "--data-dir", str(data), "--resume",
            "--no-progress", "--prefetch", "0"]


def _arrays(path: Path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k != "__manifest__"}


def _preempted_run(args: list[str], after: str, limit: float = 120) -> tuple[int, str]:
    """Run ``args`` at 2 ranks; once ``after`` is printed, send SIGUSR1 to one rank only; the exit code and output."""
    tag = f"mpistrat-test-{uuid.uuid4().hex[:12]}"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-X", f"mpistrat_test={tag}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean_env(),
                            start_new_session=True)
    lines, signalled, deadline = [], False, time.monotonic() + limit
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if not signalled and after in line:
            ranks = [pid for pid in leftovers(tag) if Path(f"/proc/{pid}/exe").resolve() == Path(sys.executable).resolve()]
            assert len(ranks) == 2, ranks
            os.kill(min(ranks), signal.SIGUSR1)  # one rank alone is told
            signalled = True
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the preempted run did not end: " + "".join(lines))
    code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    assert wait_for_no_leftovers(tag) == []
    assert signalled, "".join(lines)
    return code, "".join(lines)


@pytest.mark.timeout(300)
def test_a_signal_to_one_rank_saves_everywhere_exits_42_and_the_rerun_ends_bitwise_equal(tmp_path):
    data = tmp_path / "data"
    straight = run_job(_train_args(tmp_path / "a", data), 2, limit=120)
    assert straight.returncode == 0, straight.output
    code, output = _preempted_run(_train_args(tmp_path / "b", data), after="epoch 2/")
    assert code == EXIT_CODE, output
    assert "final test accuracy" not in output, output
    saved = list((tmp_path / "b" / "preemption").glob("ckpt-*.npz"))
    assert len(saved) == 1, output
    resumed = run_job(_train_args(tmp_path / "b", data), 2, limit=120)
    assert resumed.returncode == 0 and "resumed from the preemption checkpoint" in resumed.output, resumed.output
    final = f"ckpt-{EPOCHS}.npz"
    a, b = _arrays(tmp_path / "a" / final), _arrays(tmp_path / "b" / final)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def test_handler_in_one_process_saves_once_told_and_restores_the_count(tmp_path):
    exits = []
    told = {"now": False}
    w = ms.Variable(np.zeros(3, np.float32), name="w")
    ckpt = ms.Checkpoint(w=w)
    config = TerminationConfig(termination_watcher_fn=lambda: told["now"], exit_fn=lambda: exits.append(1))
    handler = PreemptionCheckpointHandler(None, ckpt, tmp_path / "p", termination_config=config)
    for _ in range(5):
        handler.run(lambda: w.assign_add(np.ones(3, np.float32)))
    assert handler.total_run_calls == 5 and not exits
    told["now"] = True
    handler.run(lambda: w.assign_add(np.ones(3, np.float32)))  # told before this step: saved at 5, then exit_fn
    assert exits == [1] and (tmp_path / "p" / "ckpt-5.npz").is_file()
    w.assign(np.zeros(3, np.float32))
    again = PreemptionCheckpointHandler(None, ms.Checkpoint(w=w), tmp_path / "p",
                                        termination_config=TerminationConfig(termination_watcher_fn=lambda: False))
    assert again.total_run_calls == 5 and (w.numpy() == 5).all()
    with pytest.raises(ValueError, match="checkpoint_dir is needed"):
        PreemptionCheckpointHandler(None, ms.Checkpoint(w=w))
    assert ms.experimental.PreemptionCheckpointHandler is PreemptionCheckpointHandler
