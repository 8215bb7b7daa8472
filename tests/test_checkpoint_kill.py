"""A process SIGKILLed in the middle of a save leaves the previous checkpoints loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint import Checkpoint, CheckpointManager

CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import mpistrat as ms
    from mpistrat.checkpoint import Checkpoint, CheckpointManager
    big = ms.Variable(np.zeros(4 << 20), name="big")   # 32 MiB: a save takes a while
    manager = CheckpointManager(Checkpoint(state=big), sys.argv[1], max_to_keep=3)
    n = 0
    while True:
        n += 1
        big.assign(np.full(big.shape, float(n)))
        manager.save(checkpoint_number=n)
        print("saved", n, flush=True)
""")


def _temporaries(directory):
    return [e for e in os.listdir(directory) if e.endswith(".tmp")]


@pytest.mark.timeout(120)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    directory = tmp_path / "ck"
    script = tmp_path / "saver.py"
    script.write_text(CHILD)
    for attempt in range(5):  # the kill must land while a temporary file exists (almost always the first try)
        proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().split() == ["saved", "1"]
            deadline = time.monotonic() + 30
            while not (directory.exists() and _temporaries(directory)):
                assert time.monotonic() < deadline, "no save in progress within 30 s"
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        if _temporaries(directory):
            break
    else:
        pytest.fail("the kill never landed during a save")
    # The partial file is not a checkpoint; every complete checkpoint loads with its own content.
    state = ms.Variable(np.zeros(4 << 20), name="big")
    manager = CheckpointManager(Checkpoint(state=state), directory, max_to_keep=3)
    assert manager.checkpoints, "no complete checkpoint survived"
    for path in manager.checkpoints:
        number = int(os.path.basename(path)[len("ckpt-"):-len(".npz")])
        Checkpoint(state=state).restore(path)
        assert np.all(state.numpy() == number)
    assert manager.restore_or_initialize() == manager.checkpoints[-1]
    # The next save removes the killed save's temporary file.
    manager.save()
    assert not _temporaries(directory)
