"""The merged timeline of a real 4-rank training run (examples/train.py under mpiexec -n 4) holds what it should."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from mpirun import clean_env, run_job, wait_for_no_leftovers

TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "train.py")
RANKS = 4


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeline-train")
    path = tmp / "train.json"
    job = run_job([TRAIN, "--epochs", "1", "--data-dir", str(tmp / "data")], RANKS, 150,
                  clean_env(MPISTRAT_TIMELINE=str(path)))
    assert wait_for_no_leftovers(job.tag) == []
    assert job.returncode == 0, job.output
    steps = int(re.search(r"global batch 64, (\d+) steps/epoch", job.output).group(1))
    hidden, classes, features = 64, 10, 64
    grad_bytes = 4 * (features * hidden + hidden + hidden * classes + classes + 1)  # float32 grads + the count
    with open(path) as f:
        doc = json.load(f)
    return doc, steps, grad_bytes, sorted(p.name for p in tmp.iterdir())


def _of(events, rank, category, name=None):
    return [e for e in events if e.get("pid") == rank and e.get("cat") == category and e["ph"] == "X"
            and (name is None or e["name"] == name)]


def test_merged_file_has_one_track_per_rank(trace):
    doc, _, _, files = trace
    assert files == ["data", "train.json"]  # rank 0 merged the per-rank files and removed them
    assert doc["otherData"] == {"ranks": RANKS, "missing_rank_files": [], "complete": True}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(RANKS)}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] > 1.6e15 and isinstance(e["tid"], int), e  # wall-clock microseconds


def test_run_steps_collectives_checks_and_input_waits(trace):
    doc, steps, grad_bytes, _ = trace
    events = doc["traceEvents"]
    check_sequences = []
    for rank in range(RANKS):
        runs = _of(events, rank, "step", "run")
        fns = Counter(e["args"]["fn"] for e in runs)
        assert fns["train_step"] == steps and fns["test_step"] >= 1, fns
        assert all(e["args"]["replicas"] == 1 for e in runs)

        # One fused all-reduce of the gradients per training step, inside its `run`.
        train_runs = [e for e in runs if e["args"]["fn"] == "train_step"]
        fused = [e for e in _of(events, rank, "collective", "allreduce") if e["args"]["bytes"] == grad_bytes]
        assert len(fused) == steps
        for c, r in zip(sorted(fused, key=lambda e: e["ts"]), sorted(train_runs, key=lambda e: e["ts"])):
            assert r["ts"] <= c["ts"] and c["ts"] + c["dur"] <= r["ts"] + r["dur"] + 1, (c, r)
            a = c["args"]
            assert (a["op"], a["arrays"], a["buckets"], a["ranks"]) == ("sum", 5, 1, RANKS), a
            assert a["wait_us"] >= 0 and a["transfer_us"] >= 0 and a["wait_us"] + a["transfer_us"] <= c["dur"] + 1

        # Fingerprint checks: the same sequence of calls on every rank.
        checks = sorted(_of(events, rank, "check"), key=lambda e: e["ts"])
        check_sequences.append([(c["args"]["seq"], c["args"]["call"]) for c in checks])
        assert sum(1 for _, call in check_sequences[-1] if call == "allreduce") >= steps

        # Input waits: one `next` per step handed to `run`, each before its step.
        waits = sorted(_of(events, rank, "input", "next"), key=lambda e: e["ts"])
        assert len(waits) >= len(runs)
        for r in train_runs:
            assert any(w["ts"] + w["dur"] <= r["ts"] + 1 for w in waits), r
    assert all(s == check_sequences[0] for s in check_sequences), "ranks checked different calls"
