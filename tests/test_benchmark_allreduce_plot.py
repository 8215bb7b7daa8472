"""benchmarks/allreduce.py --plot: a PNG of busbw against size, or a clear stop on every rank without matplotlib."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "benchmarks" / "allreduce.py")
QUICK = ["--min-size", "4K", "--max-size", "16K", "--budget", "0.05", "--columns", "strategy", "--fused-count", "4"]
NO_MATPLOTLIB = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                 "sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0]); runpy.run_path(sys.argv[0], run_name='__main__')")


def _mpiexec() -> str:
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip("no mpiexec next to the Python interpreter (install mpistrat[mpich])")
    return path


def _run(ranks: int, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    cmd = ["timeout", "-k", "10", str(timeout), _mpiexec(), "-n", str(ranks), sys.executable, *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout + 30, env=env,
                          stdin=subprocess.DEVNULL, cwd=REPO)


@pytest.mark.timeout(150)
def test_plot_writes_busbw_against_size(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (the [plot] extra)")
    png = tmp_path / "busbw.png"
    result = _run(2, SCRIPT, *QUICK, "--plot", str(png))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert f"# wrote {png}" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(150)
def test_plot_without_matplotlib_stops_every_rank_before_measuring(tmp_path):
    result = _run(2, "-c", NO_MATPLOTLIB, SCRIPT, *QUICK, "--plot", str(tmp_path / "x.png"))
    assert result.returncode != 0
    assert result.stderr.count("allreduce.py: --plot needs matplotlib") == 2, result.stderr  # one line per rank
    assert "mpistrat[plot]" in result.stderr
    assert "busbw" not in result.stdout, "no table was measured"
    assert not (tmp_path / "x.png").exists()
