"""benchmarks/machine_phase.py and core_round_trip.c: the cross-core round trip printed beside the tables."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
_spec = importlib.util.spec_from_file_location("machine_phase", os.path.join(_BENCH, "machine_phase.py"))
mp = importlib.util.module_from_spec(_spec)
sys.modules["machine_phase"] = mp
_spec.loader.exec_module(mp)

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
two_cores = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="cores 0 and 1 not both usable")


@needs_cc
@two_cores
def test_the_round_trip_is_measured_in_nanoseconds():
    ns = mp.round_trip_ns()
    assert ns is not None and 1 <= ns < 1e6


@needs_cc
@pytest.mark.parametrize("second, message", [("same", "two different cores"), ("1000", "cannot run on core 1000"),
                                             ("x", "usage: core_round_trip")])
def test_a_core_it_cannot_use_is_named_and_nothing_waits(second, message):
    exe = mp._program()
    assert exe is not None
    first = min(os.sched_getaffinity(0))
    cores = [str(first), str(first) if second == "same" else second]
    done = subprocess.run([exe, *cores], capture_output=True, text=True, timeout=20, check=False)
    assert done.returncode == 2
    assert message in done.stderr


def test_runs_that_could_not_measure_are_marked():
    assert mp.describe([51.4, None, 1002.0]) == "51, ?, 1002 ns"
