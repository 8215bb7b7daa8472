"""Checkpoint members named by variable, readable by other tools; ``python -m mpistrat checkpoint inspect|export``."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import mpistrat as ms
from mpistrat.train.checkpoint_file import member_name

TRICKY = ["mlp/dense_0/kernel", "a b", "x%y", "/lead", "a//b", ".", "..", "a/./b", "__manifest__", "é",
          "a.b", "a%2Fb", "a/b", "%2E", "trail/", "ü/ü", "%5F_manifest__"]


def test_member_names_are_unique_stable_and_plain_where_the_name_is():
    members = [member_name(n) for n in TRICKY]
    assert len(set(members)) == len(TRICKY), dict(zip(TRICKY, members))  # different names, different members
    assert [member_name(n) for n in TRICKY] == members  # stable
    assert member_name("mlp/dense_0/kernel") == "mlp/dense_0/kernel" and member_name("a.b") == "a.b"
    for member in members:  # zip paths no tool misreads: no empty, "." or ".." segment, never the manifest's
        assert all(seg not in ("", ".", "..") for seg in member.split("/")) and member != "__manifest__", member


def _variables():
    return {name: ms.Variable(np.full((2, i + 1), i, np.float32), name="") for i, name in enumerate(TRICKY)}


def test_named_members_load_with_numpy_and_restore(tmp_path):
    values = _variables()
    path = ms.Checkpoint(**{f"v{i}": v for i, v in enumerate(values.values())}).write(tmp_path / "t.npz")
    with np.load(path) as z:  # no mpistrat needed to read them
        for i in range(len(TRICKY)):
            np.testing.assert_array_equal(z[f"v{i}"], np.full((2, i + 1), i, np.float32))
    model = ms.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="kernel")
    path = ms.Checkpoint(model={"mlp/dense_0": model}).write(tmp_path / "m.npz")
    with np.load(path) as z, zipfile.ZipFile(path) as raw:
        assert "model/mlp/dense_0/kernel.npy" in raw.namelist()
        np.testing.assert_array_equal(z["model/mlp/dense_0/kernel"], model.numpy())
    target = ms.Variable(np.zeros((2, 3), np.float32), name="kernel")
    ms.Checkpoint(model={"mlp/dense_0": target}).restore(path)
    np.testing.assert_array_equal(target.numpy(), model.numpy())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mpistrat", "checkpoint", *args], capture_output=True, text=True,
                          timeout=120)


def test_inspect_lists_names_shapes_dtypes_and_metadata(tmp_path):
    w = ms.Variable(np.zeros((4, 5), np.float32), name="w")
    step = ms.Variable(np.int64(3), name="step")
    path = ms.Checkpoint(w=w, step=step).write(tmp_path / "c.npz", metadata={"epoch": 7})
    out = _cli("inspect", str(path))
    assert out.returncode == 0, out.stderr
    assert "w/w" in out.stdout and "(4, 5)" in out.stdout and "float32" in out.stdout
    assert "step/step" in out.stdout and "int64" in out.stdout and '"epoch": 7' in out.stdout
    data = json.loads(_cli("inspect", str(path), "--json").stdout)
    assert data["variables"] == [{"name": "w/w", "shape": [4, 5], "dtype": "float32"},
                                 {"name": "step/step", "shape": [], "dtype": "int64"}]
    bad = _cli("inspect", str(tmp_path / "missing.npz"))
    assert bad.returncode == 1 and "missing.npz' does not exist" in bad.stderr and "Traceback" not in bad.stderr


def test_export_to_safetensors_gives_the_variables(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")  # in the [test] extra
    w = ms.Variable(np.arange(20, dtype=np.float32).reshape(4, 5), name="w")
    step = ms.Variable(np.int64(3), name="step")
    path = ms.Checkpoint(w=w, step=step).write(tmp_path / "c.npz", metadata={"epoch": 7})
    out = _cli("export", str(path), "--format", "safetensors", "-o", str(tmp_path / "c.safetensors"))
    assert out.returncode == 0, out.stderr
    loaded = safetensors_numpy.load_file(str(tmp_path / "c.safetensors"))
    assert sorted(loaded) == ["step/step", "w/w"]
    np.testing.assert_array_equal(loaded["w/w"], w.numpy())
    assert loaded["step/step"].dtype == np.int64 and int(loaded["step/step"]) == 3
