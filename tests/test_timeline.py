"""The Chrome-trace timeline: per-rank recording, merge on rank 0."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from mpi4py import MPI

import mpistrat as ms
from mpistrat import timeline
from mpistrat.distribute import context


@pytest.mark.mpi(min_size=1)
def test_timeline_records_run_steps_and_merges(mpi_tmp_path):
    path = str(mpi_tmp_path / "trace.json")
    strategy = ms.MirroredStrategy(["/cpu:0", "/cpu:1"])
    timeline.start(path)
    try:
        assert timeline.enabled()
        for _ in range(3):
            strategy.run(lambda: None)
        with timeline.span("custom", "test", answer=42):
            pass
    finally:
        merged = timeline.stop()
    assert not timeline.enabled()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        assert merged == path
        with open(path) as f:
            doc = json.load(f)
        events = doc["traceEvents"]
        steps = [e for e in events if e.get("cat") == "step"]
        assert len(steps) == 3 * comm.size
        assert {e["pid"] for e in steps} == set(range(comm.size))
        assert all(e["ph"] == "X" and e["dur"] >= 0 and e["args"]["replicas"] == 2 for e in steps)
        names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
        assert names == {f"rank {r}" for r in range(comm.size)}
        custom = [e for e in events if e["name"] == "custom"]
        assert len(custom) == comm.size and custom[0]["args"]["answer"] == 42
        assert doc["otherData"]["complete"] and not doc["otherData"]["missing_rank_files"]
        assert not [f for f in os.listdir(mpi_tmp_path) if ".rank" in f]  # per-rank files removed
    else:
        assert merged is None


def test_timeline_from_environment(tmp_path):
    path = tmp_path / "env.json"
    code = textwrap.dedent("""
        import mpistrat as ms
        s = ms.OneDeviceStrategy("/cpu:0")
        for i in range(4):
            s.run(lambda: i)
    """)
    env = dict(os.environ, MPISTRAT_TIMELINE=str(path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    events = json.loads(path.read_text())["traceEvents"]
    assert len([e for e in events if e.get("cat") == "step"]) == 4


def test_disabled_timeline_records_nothing():
    assert not timeline.enabled()
    timeline.record("x", "y", 0, 1)
    with timeline.span("x", "y") as args:
        args["k"] = 1
    assert timeline.stop() is None


def test_one_replica_run_takes_the_same_path_with_the_timeline_on(tmp_path, monkeypatch):
    strategy = ms.OneDeviceStrategy("/cpu:0")
    ext = strategy.extended
    solo_calls = []
    run_solo = ext._run_solo
    monkeypatch.setattr(ext, "_run_solo", lambda *a: solo_calls.append(1) or run_solo(*a))

    def frames_and_mode():
        return len(context.thread_stack()), ms.in_cross_replica_context()

    off = strategy.run(frames_and_mode)
    timeline.start(str(tmp_path / "trace.json"))
    try:
        on = strategy.run(frames_and_mode)
    finally:
        timeline.stop()
    assert on == off == (1, False)
    assert solo_calls == [1, 1]  # the one-replica short path, traced or not
    steps = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("cat") == "step"]
    assert [(e["name"], e["args"]) for e in steps] == [("run", {"fn": "frames_and_mode", "replicas": 1})]
