"""A killed job's timeline: every rank streamed its events, and what they left merges into one trace."""

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

from mpistrat import timeline

STEPS = 7
PROGRAM = textwrap.dedent(f"""
    import time, numpy as np, mpistrat as ms
    strategy = ms.MultiWorkerMirroredStrategy()
    for _ in range({STEPS}):
        strategy.run(lambda: ms.get_replica_context().all_reduce("SUM", np.ones(4)))
    print("ready", flush=True)
    time.sleep(120)  # killed here, with the timeline still recording
""")


def _remove_new_shm_files(before: set) -> None:
    """MPICH leaves its shared-memory files behind when killed: remove those this job made."""
    for name in set(os.listdir("/dev/shm")) - before:
        if name.startswith("mpich"):
            try:
                os.remove(os.path.join("/dev/shm", name))
            except OSError:
                pass


def test_a_killed_jobs_timeline_merges_with_every_ranks_events(tmp_path):
    script, trace = tmp_path / "prog.py", tmp_path / "trace.json"
    script.write_text(PROGRAM)
    env = dict(os.environ, MPISTRAT_TIMELINE=str(trace), PYTHONUNBUFFERED="1")
    shm_before = set(os.listdir("/dev/shm"))
    job = subprocess.Popen(["mpiexec", "-n", "2", sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, deadline = b"", time.monotonic() + 90
        while out.count(b"ready") < 2 and time.monotonic() < deadline and job.poll() is None:
            if select.select([job.stdout], [], [], 1.0)[0]:
                out += os.read(job.stdout.fileno(), 65536)  # unbuffered: select sees every byte not yet read
        assert out.count(b"ready") == 2, f"the ranks did not finish their steps: {out[-2000:]!r}"
        time.sleep(2.5 * timeline.FLUSH_SECONDS)  # the flush timer's period, with room
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        _remove_new_shm_files(shm_before)
    assert not trace.exists()  # nobody merged: the job was killed
    files = sorted(str(p) for p in tmp_path.glob("trace.json.rank*.jsonl"))
    assert len(files) == 2, files
    # In the job's own shell (MPISTRAT_TIMELINE still set): the tool must not start a timeline of its own,
    # which would overwrite rank 0's file (found in review).
    merged = subprocess.run([sys.executable, "-m", "mpistrat", "timeline", "merge", *files, "-o", str(trace)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert merged.returncode == 0, merged.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in events if e.get("pid") == rank]
        assert sum(e.get("cat") == "step" for e in mine) == STEPS, rank
        assert sum(e.get("cat") == "collective" for e in mine) >= STEPS, rank
    summary = subprocess.run([sys.executable, "-m", "mpistrat", "timeline", "summary", str(trace)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    rows = [line.split() for line in summary.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("0", str(STEPS)), ("1", str(STEPS))], summary.stdout


def test_a_line_cut_short_by_a_kill_is_left_out(tmp_path):
    path = tmp_path / "t.json.rank0.jsonl"
    path.write_text('{"name":"a","ph":"X","pid":0}\n{"name":"b","ph":"X","pid":0}\n{"name":"c","ph"')
    assert [e["name"] for e in timeline.read_events(str(path))] == ["a", "b"]


def test_a_timeline_started_by_hand_and_never_stopped_is_merged_at_exit(tmp_path):
    path = tmp_path / "manual.json"
    code = (f"from mpistrat import timeline\ntimeline.start({str(path)!r})\n"
            "timeline.record('last_step', 'step', timeline.now_us(), 1.0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    events = json.loads(path.read_text())["traceEvents"]
    assert [e["name"] for e in events if e.get("cat") == "step"] == ["last_step"]
    assert not list(tmp_path.glob("manual.json.rank*"))  # merged and removed
