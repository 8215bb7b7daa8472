"""The input pipeline's errors, whose messages name the rank (``rank_label``)."""

from __future__ import annotations

__all__ = ["DataLossError", "InputPipelineError", "InvalidArgumentError", "OutOfRangeError", "rank_label"]


class DataLossError(OSError):
    """A corrupt or truncated input file (bad length, CRC mismatch, short read)."""


class InputPipelineError(RuntimeError):
    """Raised on every rank when the input pipeline failed on one or more ranks."""


class OutOfRangeError(Exception):
    """``DistributedIterator.get_next()`` past the end of the data (TF's OutOfRangeError)."""


class InvalidArgumentError(Exception):
    """An operation got an argument it cannot use, e.g. an empty ``Optional``'s value (TF's InvalidArgumentError)."""


def rank_label() -> str:
    """``"rank R"`` for this process (rank 0 when MPI is not initialised)."""
    try:
        from mpi4py import MPI  # noqa: PLC0415

        if MPI.Is_initialized() and not MPI.Is_finalized():
            return f"rank {MPI.COMM_WORLD.Get_rank()}"
    except Exception:  # mpi4py missing or broken: still name a rank
        pass
    return "rank 0"
