"""The stall inspector: a rank that is late to a collective is reported, repeatedly; shutdown makes it an error."""

import logging
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from mpistrat import config
from mpistrat.comm import CollectiveTimeoutError, CommunicationOptions, CommunicatorBrokenError, RankCommunicator
from mpistrat.comm.agreement.stall import STALL_SHUTDOWN_ENV, STALL_WARNING_ENV, format_stall


def stall_settings():
    current = config.settings()
    return current.stall_warning_seconds, current.stall_shutdown_seconds

ARRAYS = lambda: [np.ones((2, 3), np.float32), np.ones(5)]  # noqa: E731
SUBMITTED = r"allreduce\(op=sum\) \[\(2, 3\), float32; \(5,\), float64\]"


def _ranks(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _stall_records(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mpistrat" and "Stalled collective" in r.getMessage()]


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.delenv(STALL_WARNING_ENV, raising=False)
    monkeypatch.delenv(STALL_SHUTDOWN_ENV, raising=False)
    assert stall_settings() == (60.0, 0.0)
    monkeypatch.setenv(STALL_WARNING_ENV, "0")
    monkeypatch.setenv(STALL_SHUTDOWN_ENV, "2.5")
    assert stall_settings() == (0.0, 2.5)
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(STALL_SHUTDOWN_ENV, bad)
        with pytest.raises(ValueError, match=rf"{STALL_SHUTDOWN_ENV} must be a finite number of seconds >= 0.*{bad}"):
            stall_settings()


def test_report_format():
    text = format_stall(0, "collective #3 of communicator #1 (barrier)", 61.04, [2, 3], [3],
                        ["rank 2 is waiting in collective #7 of communicator #2 (barrier) since 1.0 s"],
                        {"barrier": [0, 1]}, 60, 0)
    assert text == (
        "[rank 0] Stalled collective: collective #3 of communicator #1 (barrier) has waited 61.0 s on rank 0; "
        "ranks 2, 3 have not arrived; rank 3 did not answer: busy outside mpistrat collectives (computing, "
        "blocked in another MPI call) or dead; rank 2 is waiting in collective #7 of communicator #2 (barrier) "
        "since 1.0 s; waiting: ranks 0, 1 submitted barrier; repeating every 60 s "
        "(MPISTRAT_STALL_WARNING_SECONDS); set MPISTRAT_STALL_SHUTDOWN_SECONDS to turn a stall into an error.")


def test_report_goes_to_stderr_without_logging_setup():
    code = "from mpistrat.comm.agreement.stall import report_stall; report_stall('[rank 0] Stalled collective: test')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "[rank 0] Stalled collective: test" in out.stderr, out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("late_is_last", [True, False], ids=["late-last", "late-rank0"])
def test_late_rank_is_reported_repeatedly_by_the_lowest_waiting_rank(comm, monkeypatch, caplog, late_is_last):
    monkeypatch.setenv(STALL_WARNING_ENV, "0.4")
    monkeypatch.delenv(STALL_SHUTDOWN_ENV, raising=False)
    late = comm.size - 1 if late_is_last else 0
    reporter = 0 if late_is_last else 1
    waiting = [r for r in range(comm.size) if r != late]
    with RankCommunicator(comm) as rc, caplog.at_level(logging.WARNING, logger="mpistrat"):
        if comm.rank == late:
            time.sleep(2.0)  # busy in Python: it cannot answer
        out = rc.allreduce(ARRAYS(), "sum")
        rc.barrier()
    assert out[1].tolist() == [comm.size] * 5  # the stall was only reported: the collective completed
    records = _stall_records(caplog)
    if comm.rank != reporter:
        assert records == [], records
        return
    assert len(records) >= 2, records  # repeated
    for text in records:
        assert text.startswith(f"[rank {reporter}] Stalled collective: collective #1 of communicator #"), text
        assert f"rank {late} has not arrived; rank {late} did not answer" in text, text
        assert re.search(rf"waiting: {_ranks(waiting)} submitted {SUBMITTED}; repeating every 0.4 s", text), text
    waited = [float(re.search(r"has waited (\d+\.\d) s", t).group(1)) for t in records]
    assert waited == sorted(waited) and waited[0] >= 0.4, waited


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_report_says_where_a_late_rank_waits(comm, monkeypatch, caplog):
    # The late rank waits in another communicator's barrier (the others never come: it times out),
    # then joins the others' step agreement; meanwhile rank 0's report says where it was.
    monkeypatch.setenv(STALL_WARNING_ENV, "0.3")
    late = comm.size - 1
    a, b = RankCommunicator(comm), RankCommunicator(comm)
    with caplog.at_level(logging.WARNING, logger="mpistrat"):
        if comm.rank == late:
            with pytest.raises(CollectiveTimeoutError):
                b.barrier(CommunicationOptions(timeout_seconds=1.5))
        codes = a.step_agreement(comm.rank)
        if comm.rank != late:
            with pytest.raises(CollectiveTimeoutError, match="abandoned"):
                b.barrier()
    assert codes.tolist() == list(range(comm.size))
    records = _stall_records(caplog)
    if comm.rank == 0:
        assert records, "rank 0 reported nothing"
        text = records[0]
        assert (f"rank {late} has not arrived; rank {late} is waiting in collective #1 of communicator "
                f"#{b._guard.index} (barrier) since") in text, text
        assert "did not answer" not in text and "submitted step_agreement" in text, text
    elif comm.rank == late:  # it waited alone in b's barrier: a stall of b, the others being in a
        others = list(range(late))
        assert records and all(f"{_ranks(others)} {'has' if late == 1 else 'have'} not arrived" in t
                               and f"rank 0 is waiting in collective #1 of communicator #{a._guard.index} "
                               "(step_agreement)" in t for t in records), records
    else:
        assert records == []
    a.close()
    b.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_shutdown_turns_a_stall_into_an_error_on_every_rank(comm, monkeypatch, caplog):
    monkeypatch.setenv(STALL_WARNING_ENV, "0.3")
    monkeypatch.setenv(STALL_SHUTDOWN_ENV, "1")
    late = comm.size - 1
    with RankCommunicator(comm) as rc:
        with caplog.at_level(logging.WARNING, logger="mpistrat"):
            if comm.rank == late:
                time.sleep(3.0)
            start = time.monotonic()
            with pytest.raises(CollectiveTimeoutError) as info:
                rc.allreduce(ARRAYS(), "sum")  # the default timeout_seconds (600 s) is not what ends it
            waited = time.monotonic() - start
        text = str(info.value)
        if comm.rank == late:
            assert "was abandoned before" in text and "gave up waiting after MPISTRAT_STALL_SHUTDOWN_SECONDS=1" in text
            assert info.value.abandoned_by == [r for r in range(comm.size) if r != late], text
        else:
            assert info.value.missing_ranks == [late], text
            assert f"rank {late} never arrived" in text and "(MPISTRAT_STALL_SHUTDOWN_SECONDS=1)" in text, text
            assert 1.0 <= waited < 20, waited
        if comm.rank == 0:
            assert _stall_records(caplog), "no stall warning before the shutdown"
        with pytest.raises(CommunicatorBrokenError):
            rc.barrier()
