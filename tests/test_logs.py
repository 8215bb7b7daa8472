"""mpistrat's log records name the rank that wrote them."""

import logging

import pytest

from mpistrat import logs


def test_loggers_belong_to_the_mpistrat_hierarchy():
    assert logs.get_logger("mpistrat.data").name == "mpistrat.data"
    with pytest.raises(ValueError, match="mpistrat.<part>"):
        logs.get_logger("data")


def test_rank_from_the_launchers_environment(monkeypatch):
    monkeypatch.setattr(logs, "_rank", None)
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "PMIX_RANK", "PMIX_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert logs.current_rank() == (0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    assert logs.current_rank() == (3, 8)
    monkeypatch.setenv("PMI_RANK", "5")  # mpiexec (Hydra) first
    monkeypatch.setenv("PMI_SIZE", "6")
    assert logs.current_rank() == (5, 6)


@pytest.mark.mpi(min_size=2)
def test_records_of_a_multi_rank_job_start_with_their_rank(comm, caplog):
    import mpistrat as ms

    ms.MultiWorkerMirroredStrategy()  # tells the loggers the rank
    logger = logs.get_logger("mpistrat.test")
    with caplog.at_level(logging.INFO, logger="mpistrat"):
        logger.info("hello %s", "world")
        logger.info("[rank 9] already named")
    first, second = caplog.records[-2:]
    assert (first.rank, first.world_size) == (comm.rank, comm.size)
    assert first.getMessage() == f"[rank {comm.rank}] hello world"
    assert second.getMessage() == "[rank 9] already named"  # a message that names its rank is kept
