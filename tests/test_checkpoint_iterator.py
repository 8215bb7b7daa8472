"""Checkpoint(iterator=...): a restored distributed iterator yields bitwise the batches the saved run saw next."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint import Checkpoint, CheckpointError
from mpistrat.data import Dataset


def _pipeline(strategy):
    """Shuffled (unseeded: a fresh seed each build), repeated with reshuffling, batched, sharded by data."""
    ds = Dataset.range(48).map(lambda x: x * 10).shuffle(16).repeat(2).batch(4)
    return strategy.experimental_distribute_dataset(ds)


def _take(it, n):
    return [np.asarray(next(it)).copy() for _ in range(n)]


def _save_and_resume(strategy, path, k=3, m=7, passes_before=0):
    with strategy.scope():
        w = ms.Variable(np.arange(3.0), name="w")
    dist = _pipeline(strategy)
    for _ in range(passes_before):  # a later pass: its shuffle epoch must be restored too
        for _ in dist:
            pass
    it = iter(dist)
    _take(it, k)
    Checkpoint(model=w, iterator=it).write(path)
    expected = _take(it, m)

    fresh = iter(_pipeline(strategy))  # a new pipeline with new random seeds, as in a new process
    metadata = Checkpoint(model=w, iterator=fresh).restore(path)
    assert "mpistrat.iterators" not in metadata
    got = _take(fresh, m)
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    other = _take(iter(_pipeline(strategy)), m)  # without restoring, the batches differ: the test can fail
    assert any(not np.array_equal(a, b) for a, b in zip(expected, other))


def test_resumed_iterator_yields_the_same_batches(tmp_path):
    _save_and_resume(ms.OneDeviceStrategy("/cpu:0"), str(tmp_path / "it.npz"))


def test_resume_in_a_later_pass(tmp_path):
    _save_and_resume(ms.OneDeviceStrategy("/cpu:0"), str(tmp_path / "it.npz"), k=5, passes_before=1)


def test_exhausted_iterator_restores_exhausted(tmp_path):
    strategy = ms.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        w = ms.Variable(np.arange(3.0), name="w")
    it = iter(_pipeline(strategy))
    assert len(list(it)) == 24
    path = Checkpoint(model=w, iterator=it).write(str(tmp_path / "end.npz"))
    fresh = iter(_pipeline(strategy))
    Checkpoint(model=w, iterator=fresh).restore(path)
    assert list(fresh) == []


def test_inspect_shows_the_position(tmp_path):
    strategy = ms.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        w = ms.Variable(np.arange(3.0), name="w")
    it = iter(_pipeline(strategy))
    _take(it, 2)
    path = Checkpoint(model=w, iterator=it).write(str(tmp_path / "it.npz"))
    out = subprocess.run([sys.executable, "-m", "mpistrat", "checkpoint", "inspect", path], capture_output=True, check=False,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"steps": 2' in out.stdout


def test_generator_source_cannot_be_saved(tmp_path):
    strategy = ms.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        w = ms.Variable(np.arange(3.0), name="w")
    ds = Dataset.from_generator(lambda: iter(range(8)), output_types=np.int64).batch(2)
    it = iter(strategy.experimental_distribute_dataset(ds))
    next(it)
    with pytest.raises(ValueError, match="from_generator"):
        Checkpoint(model=w, iterator=it).write(str(tmp_path / "g.npz"))


def test_restore_into_a_used_iterator_raises(tmp_path):
    strategy = ms.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        w = ms.Variable(np.arange(3.0), name="w")
    it = iter(_pipeline(strategy))
    path = Checkpoint(model=w, iterator=it).write(str(tmp_path / "it.npz"))
    next(it)
    with pytest.raises(ValueError, match="fresh"):
        Checkpoint(model=w, iterator=it).restore(path)
    with pytest.raises(CheckpointError, match="no position for the iterator 'data'"):
        Checkpoint(model=w, data=iter(_pipeline(strategy))).restore(path)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_resumed_iterator_under_mpi(comm, mpi_tmp_path):
    strategy = ms.MultiWorkerMirroredStrategy()
    assert _pipeline(strategy).auto_shard_mode == "DATA"
    _save_and_resume(strategy, os.path.join(str(mpi_tmp_path), "it.npz"), k=4, m=5, passes_before=1)
