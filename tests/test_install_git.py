"""The README's install from a git URL: pip installs a fresh clone of this repository through ``git+file://``
(serial; pip builds the package, with ``--no-deps`` so nothing else is fetched)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_pip_installs_a_fresh_clone_from_a_git_url(tmp_path):
    clone, target = tmp_path / "clone", tmp_path / "site"
    subprocess.run(["git", "clone", "-q", "--no-local", str(REPO), str(clone)], check=True, timeout=120)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout.strip()
    # The README's line, extras quoted; --no-deps: the venv running this test has them already.
    requirement = f"mpistrat[mpich] @ git+file://{clone}"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                          "--target", str(target), requirement], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    (info,) = target.glob("mpistrat-*.dist-info")
    assert json.loads((info / "direct_url.json").read_text())["vcs_info"]["commit_id"] == commit
    for name in ("py.typed", "examples/digits.npz"):  # package data came along
        assert (target / "mpistrat" / name).is_file(), name
    # Imported from where pip put it (not from this checkout), it reports its version.
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import mpistrat, importlib.metadata as md; "
             "print(mpistrat.__file__); print(mpistrat.__version__ == md.version('mpistrat'), mpistrat.__version__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-c", probe, str(target)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    path, version = ran.stdout.splitlines()
    assert path.startswith(str(target)) and version.startswith("True "), ran.stdout
