"""``scripts/test.sh`` with a filter: a rank count that collects nothing is no failure, a filter that matches
nothing anywhere is one, and so is collecting nothing without a filter (serial; runs the script itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _test_sh(logs: Path, *args: str, test_set: str = "all") -> tuple[int, str]:
    # The venv running these tests is the one the script would set up: it is reused, not reinstalled;
    # the logs go to a folder of the test's own, away from those of a test.sh run that runs this test.
    env = dict(os.environ, MPISTRAT_TEST_SET=test_set, MPISTRAT_TEST_OPENMPI="0", MPISTRAT_MPI="mpich",
               MPISTRAT_VENV=str(Path(sys.executable).parents[1]), MPISTRAT_TEST_LOGS=str(logs))
    env.pop("PYTEST_CURRENT_TEST", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), *args], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=300)
    return out.returncode, out.stdout[out.stdout.find("=== summary ===") :]


@pytest.mark.timeout(320)
def test_a_filter_that_matches_in_some_runs_only_passes(tmp_path):
    # A serial test of a file outside the agreement-check runs: those collect nothing (pytest's exit 5).
    rc, summary = _test_sh(tmp_path, "-k", "test_arrays_of_at_least_alone_bytes_get_buckets_of_their_own")
    assert rc == 0, summary
    assert "1 rank:  1 passed, 0 failed" in summary, summary
    assert "n2-mpi-check): 0 passed, 0 failed, 0 skipped" in summary, summary


@pytest.mark.timeout(120)
def test_a_filter_that_matches_nothing_anywhere_fails(tmp_path):
    rc, summary = _test_sh(tmp_path, "-k", "no_test_is_named_like_this", test_set="mpi-subset-ci")
    assert rc == 1 and "the filter matched no test in any run: FAILED" in summary, summary


@pytest.mark.timeout(120)
def test_nothing_collected_without_a_filter_fails(tmp_path):
    rc, summary = _test_sh(tmp_path, "--deselect", "tests/", test_set="mpi-subset-ci")
    assert rc == 1 and "(exit 5)" in summary, summary
