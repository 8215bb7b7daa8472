"""RankCommunicator records its agreement checks and collectives in the timeline."""

import json

import numpy as np
import pytest

from mpistrat import timeline
from mpistrat.comm.communicator import RankCommunicator


@pytest.mark.mpi(min_size=1)
def test_timeline_has_checks_and_collectives(comm, mpi_tmp_path):
    path = str(mpi_tmp_path / "comm_timeline.json")
    with RankCommunicator(comm) as rc:
        timeline.start(path)
        try:
            rc.allreduce([np.ones(8, np.float32), np.ones(4, np.float64), np.ones(2, np.float32)], "max")
            rc.allreduce([np.ones(1000, np.float32)], "sum", inplace=True)
            rc.step_agreement(0)
            rc.broadcast([np.ones(3), np.ones(2, np.float32)])
            rc.allgather(np.ones((2, 3), np.float32))
        finally:
            merged = timeline.stop()
    if comm.rank != 0:
        return
    with open(merged) as f:
        events = json.load(f)["traceEvents"]
    for rank in range(comm.size):
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        collectives = [e for e in mine if e["cat"] == "collective" and e["name"] == "allreduce"]
        assert [(c["args"]["bytes"], c["args"]["buckets"], c["args"]["op"]) for c in collectives] == [
            (10 * 4 + 4 * 8, 2, "max"), (4000, 1, "sum")]
        for c in collectives:
            assert c["args"]["wait_us"] >= 0 and c["args"]["transfer_us"] >= 0
            assert c["args"]["wait_us"] + c["args"]["transfer_us"] <= c["dur"] + 1
        others = [(e["name"], e["args"]["bytes"], e["args"]["arrays"]) for e in mine
                  if e["cat"] == "collective" and e["name"] != "allreduce"]
        assert others == [("broadcast", 3 * 8 + 2 * 4, 2), ("allgather", comm.size * 6 * 4, 1)]
        checks = [e for e in mine if e["cat"] == "check"]
        if comm.size > 1:
            assert [c["args"]["call"] for c in checks] == ["allreduce", "allreduce", "step_agreement", "broadcast",
                                                           "allgather"]
            assert checks[0]["args"]["seq"] + 2 == checks[2]["args"]["seq"]
        else:
            assert checks == []  # one rank: nothing to agree on
