"""The library's loggers: every record names the MPI rank that wrote it.

``get_logger(name)`` returns a logger of the ``mpistrat`` hierarchy whose records carry
``record.rank`` and ``record.world_size`` and, in a job of several ranks, start with
``[rank N]``. The rank comes from the launcher's environment (mpiexec's ``PMI_RANK``, Open MPI's
``OMPI_COMM_WORLD_RANK``, Slurm's ``SLURM_PROCID``), read without initialising MPI, until a
strategy says it (:func:`set_rank`).
"""

from __future__ import annotations

import logging
import os

__all__ = ["get_logger", "set_rank", "current_rank"]

_RANK_VARIABLES = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                   ("SLURM_PROCID", "SLURM_NTASKS"), ("PMIX_RANK", "PMIX_SIZE"))
_rank: tuple[int, int] | None = None


def _from_environment() -> tuple[int, int]:
    for rank_var, size_var in _RANK_VARIABLES:
        rank, size = os.environ.get(rank_var, ""), os.environ.get(size_var, "")
        if rank.isdigit():
            return int(rank), int(size) if size.isdigit() else 0
    return 0, 1


def set_rank(rank: int, world_size: int) -> None:
    """Name ``rank`` of ``world_size`` in every later record (a strategy calls it when it knows)."""
    global _rank
    _rank = (int(rank), int(world_size))


def current_rank() -> tuple[int, int]:
    """``(rank, world_size)`` as the records name them (world size 0: the launcher did not say)."""
    return _rank if _rank is not None else _from_environment()


class _RankFilter(logging.Filter):
    """Adds ``rank`` and ``world_size`` to a record and ``[rank N]`` in front of its message (several ranks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank, size = current_rank()
        record.rank, record.world_size = rank, size
        if size != 1 and not str(record.msg).startswith("[rank "):
            record.msg = f"[rank {rank}] {record.msg}"
        return True


_FILTER = _RankFilter()


def get_logger(name: str = "mpistrat") -> logging.Logger:
    """The logger ``name`` (in the ``mpistrat`` hierarchy), its records naming their rank."""
    if name != "mpistrat" and not name.startswith("mpistrat."):
        raise ValueError(f"mpistrat loggers are named 'mpistrat' or 'mpistrat.<part>', got {name!r}")
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
