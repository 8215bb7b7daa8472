"""Checkpoints in one process: round trips, numbering and pruning, mismatches, corrupt files, no pickle."""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.checkpoint import Checkpoint, CheckpointError, CheckpointManager, latest_checkpoint
from mpistrat.examples.mlp import MLP
from mpistrat.optimizers import Adam


def _model_and_optimizer(strategy=None, seed=0):
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = MLP([4, 5, 3], seed=seed)
        opt = Adam(0.01)
        opt.build(model.trainable_variables)
        step = ms.Variable(np.int64(7), name="step", trainable=False)
    return model, opt, step


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _values(ckpt):
    return {n: np.array(v.numpy()) for n, v in ckpt.variables().items()}


def test_round_trip_mirrored(tmp_path):
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    model, opt, step = _model_and_optimizer(strategy)
    ckpt = Checkpoint(model=model, optimizer=opt, step=step)
    saved = _values(ckpt)
    path = ckpt.write(tmp_path / "a.npz", metadata={"epoch": 3})
    assert sorted(saved) == sorted(ckpt.variables())
    assert "optimizer/Adam/mlp/dense_0/kernel/m" in saved and "step/step" in saved
    with strategy.scope():
        for v in ckpt.variables().values():
            v.assign(np.ones(v.shape, v.dtype))
    assert ckpt.restore(path) == {"epoch": 3}
    for name, var in ckpt.variables().items():
        for copy in var.values:  # every replica's copy is restored
            np.testing.assert_array_equal(copy.numpy(), saved[name])
            assert copy.numpy().dtype == saved[name].dtype


def test_manager_numbers_keeps_last_k_and_finds_latest(tmp_path):
    model, opt, step = _model_and_optimizer()
    manager = CheckpointManager(Checkpoint(model=model), tmp_path / "ck", max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.restore_or_initialize() is None
    paths = [manager.save() for _ in range(3)]
    assert [os.path.basename(p) for p in paths] == ["ckpt-1.npz", "ckpt-2.npz", "ckpt-3.npz"]
    assert manager.checkpoints == paths[1:]
    manager.save(checkpoint_number=10)
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-3.npz", "ckpt-10.npz"]
    assert latest_checkpoint(tmp_path / "ck").endswith("ckpt-10.npz")
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-10.npz", "ckpt-3.npz"]  # no temporary files left
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointManager(Checkpoint(model=model), tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="checkpoint_number"):
        manager.save(checkpoint_number=-1)


def test_mismatches_name_the_file_and_variables(tmp_path):
    model, opt, step = _model_and_optimizer()
    path = Checkpoint(model=model, step=step).write(tmp_path / "c.npz")
    before = model.variables[0].numpy().copy()
    other = MLP([4, 6, 3], seed=0)
    with pytest.raises(CheckpointError, match=r"c\.npz.*'model/mlp/dense_0/kernel': saved shape \(4, 5\) dtype "
                                              r"float32, live shape \(4, 6\)"):
        Checkpoint(model=other, step=step).restore(path)
    with pytest.raises(CheckpointError, match=r"missing from the file: \['optimizer/"):
        Checkpoint(model=model, step=step, optimizer=opt).restore(path)
    with pytest.raises(CheckpointError, match=r"in the file but not among the live variables: \['step/step'\]"):
        Checkpoint(model=model).restore(path)
    wide = ms.Variable(np.int32(1), name="step")
    with pytest.raises(CheckpointError, match=r"'step/step': saved shape \(\) dtype int64, live shape \(\) dtype int32"):
        Checkpoint(model=model, step=wide).restore(path)
    np.testing.assert_array_equal(model.variables[0].numpy(), before)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty"])
def test_corrupt_files_raise_naming_the_file(tmp_path, damage):
    model, _, _ = _model_and_optimizer()
    ckpt = Checkpoint(model=model)
    path = ckpt.write(tmp_path / "d.npz")
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("model/mlp/dense_0/kernel.npy")  # members are named by variable
        at = info.header_offset + 30 + len(info.filename) + 128 + 5  # inside the kernel's array bytes
        data[at] ^= 0xFF
    elif damage == "garbage":
        data = bytearray(b"not a checkpoint at all" * 10)
    else:
        data = bytearray()
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=rf"Checkpoint file '{path}' is corrupt or truncated"):
        ckpt.restore(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.restore(tmp_path / "nothing.npz")


def test_refuses_pickled_members_and_foreign_npz(tmp_path):
    model, _, _ = _model_and_optimizer()
    ckpt = Checkpoint(model=model)
    path = ckpt.write(tmp_path / "e.npz")
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    members["model/mlp/dense_0/kernel"] = np.array([{"evil": 1}, None], dtype=object)  # would need pickle
    np.savez(tmp_path / "evil.npz", **members)
    with pytest.raises(CheckpointError, match=r"evil.npz' is inconsistent: 'model/mlp/dense_0/kernel' is stored with "
                                              r"shape \(2,\) dtype object but its manifest says \(4, 5\) <f4"):
        ckpt.restore(tmp_path / "evil.npz")
    np.savez(tmp_path / "foreign.npz", a=np.ones(3))
    with pytest.raises(CheckpointError, match="foreign.npz' has no manifest"):
        ckpt.restore(tmp_path / "foreign.npz")


def test_write_failure_and_bad_objects(tmp_path):
    model, _, _ = _model_and_optimizer()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="Could not write checkpoint"):
        Checkpoint(model=model).write(tmp_path / "file" / "f.npz")
    with pytest.raises(TypeError, match="'thing' is a str"):
        Checkpoint(thing="text").variables()
    with pytest.raises(ValueError, match="at least one object"):
        Checkpoint()
    a, b = ms.Variable(1.0, name="same"), ms.Variable(2.0, name="same")
    with pytest.raises(ValueError, match="both named 'v/same'"):
        Checkpoint(v=[a, b]).variables()
