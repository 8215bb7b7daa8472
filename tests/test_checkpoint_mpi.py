"""Checkpoints across MPI ranks: the chief writes, every rank restores the chief's file, errors on every rank."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint import Checkpoint, CheckpointError, CheckpointManager


@pytest.fixture
def shared_dir(mpi_tmp_path):
    """A directory every rank of the test sees (rank 0's tmp_path, from pytest-mpi)."""
    return str(mpi_tmp_path)


@pytest.mark.mpi(min_size=2)
def test_chief_writes_every_rank_restores(comm, shared_dir):
    strategy = ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        weights = ms.Variable(np.arange(6.0).reshape(2, 3), name="w")
        step = ms.Variable(np.int64(0), name="step")
        seen = ms.Variable(0.0, name="seen", synchronization=ms.VariableSynchronization.ON_READ,
                           aggregation=ms.VariableAggregation.SUM)
    strategy.run(lambda: seen.assign_add(1.0))  # one per replica: the saved value is the global sum
    manager = CheckpointManager(Checkpoint(w=weights, step=step, seen=seen), os.path.join(shared_dir, "ck"),
                                max_to_keep=2)
    with strategy.scope():
        step.assign(5)
    path = manager.save()
    assert path == comm.bcast(path, root=0)
    assert os.path.basename(path) == "ckpt-1.npz"
    with strategy.scope():
        weights.assign(np.full((2, 3), float(comm.Get_rank())))  # diverge on purpose
        step.assign(-1)
    assert manager.restore_or_initialize() == path
    for copy in weights.values:
        np.testing.assert_array_equal(copy.numpy(), np.arange(6.0).reshape(2, 3))
    with strategy.scope():
        assert int(step.numpy()) == 5
        assert float(seen.numpy()) == 2.0 * comm.Get_size()
    comm.Barrier()
    if comm.Get_rank() == 0:
        assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt-1.npz"]


@pytest.mark.mpi(min_size=2)
def test_corrupt_checkpoint_raises_on_every_rank(comm, shared_dir):
    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        weights = ms.Variable(np.ones(1000), name="w")
    ckpt = Checkpoint(w=weights)
    path = ckpt.write(os.path.join(shared_dir, "bad.npz"))
    comm.Barrier()
    if comm.Get_rank() == 0:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    comm.Barrier()
    with pytest.raises(CheckpointError, match=r"bad\.npz' is corrupt or truncated"):
        ckpt.restore(path)
    with strategy.scope():
        other = ms.Variable(np.ones(3), name="w")
    good = Checkpoint(w=other).write(os.path.join(shared_dir, "small.npz"))
    with pytest.raises(CheckpointError, match=r"'w/w': saved shape \(3,\) dtype float64, live shape \(1000,\)"):
        ckpt.restore(good)
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_save_and_restore_send_nothing_pickled(comm, shared_dir, monkeypatch):
    from mpistrat.comm.communicator import RankCommunicator

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint collective used a pickled object")

    strategy = ms.MultiWorkerMirroredStrategy()
    with strategy.scope():
        weights = ms.Variable(np.arange(5.0), name="w")
    manager = CheckpointManager(Checkpoint(w=weights), os.path.join(shared_dir, "np"), max_to_keep=1)
    monkeypatch.setattr(RankCommunicator, "broadcast_object", refuse)
    monkeypatch.setattr(RankCommunicator, "allgather_object", refuse)
    path = manager.save(metadata={"note": "no pickle"})  # numbering agreed from the chief's directory listing
    with strategy.scope():
        weights.assign(np.zeros(5))
    assert manager.restore_or_initialize() == path
    np.testing.assert_array_equal(weights.numpy(), np.arange(5.0))
    assert manager.checkpoint.restore(path) == {"note": "no pickle"}
    with pytest.raises(CheckpointError, match="does not exist"):  # the chief's error, on every rank
        manager.checkpoint.restore(os.path.join(shared_dir, "np", "absent.npz"))
