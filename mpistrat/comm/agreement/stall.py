"""The stall inspector's settings and report (Horovod's stall check, for MPI ranks).

The inspector itself lives in :class:`~mpistrat.comm.agreement.guard.AgreementGuard`'s wait loop: it
costs nothing until a collective has waited the interval. Both settings are read by :mod:`mpistrat.config`
when a communicator (strategy) is created.
"""

from __future__ import annotations

from typing import Sequence

from mpistrat import logs, timeline

__all__ = [
    "STALL_WARNING_ENV",
    "STALL_SHUTDOWN_ENV",
    "format_stall",
    "report_stall",
    "logger",
]

# Seconds (default 60; 0 turns the warnings off) after which a collective whose agreement check still
# waits for ranks that have not arrived is reported, and again at every further interval (format_stall).
STALL_WARNING_ENV = "MPISTRAT_STALL_WARNING_SECONDS"
# Seconds (default 0: off) after which a stall is an error on every rank: a collective that has waited
# that long raises CollectiveTimeoutError on the waiting ranks (as timeout_seconds does; the shorter of
# the two applies), and a rank that arrives later finds the collective abandoned and raises too.
STALL_SHUTDOWN_ENV = "MPISTRAT_STALL_SHUTDOWN_SECONDS"
logger = logs.get_logger("mpistrat")


def _ranks(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def format_stall(
    rank: int,
    what: str,
    waited: float,
    missing: Sequence[int],
    silent: Sequence[int],
    elsewhere: Sequence[str],
    submitted: dict[str, list[int]],
    interval: float,
    shutdown: float,
) -> str:
    """The stall report: who is missing, where they are, what the waiting ranks submitted.

    The lowest-ranked waiting rank (rank 0 whenever it is among them) logs it (:func:`report_stall`):
    which ranks have not arrived, where those ranks are if they are waiting in another mpistrat
    collective, and what the waiting ranks submitted (op, number of arrays, shapes, dtypes).
    """
    verb = "have" if len(missing) > 1 else "has"
    parts = [f"[rank {rank}] Stalled collective: {what} has waited {waited:.1f} s on rank {rank}; "
             f"{_ranks(missing)} {verb} not arrived"]
    if silent:
        parts.append(f"{_ranks(silent)} did not answer: busy outside mpistrat collectives "
                     "(computing, blocked in another MPI call) or dead")
    parts.extend(elsewhere)
    waiting = "; ".join(f"{_ranks(r)} submitted {d}" for d, r in sorted(submitted.items(), key=lambda i: i[1][0]))
    parts.append(f"waiting: {waiting}")
    then = (f"it becomes an error after {shutdown:g} s ({STALL_SHUTDOWN_ENV})" if shutdown > 0 else
            f"set {STALL_SHUTDOWN_ENV} to turn a stall into an error")
    parts.append(f"repeating every {interval:g} s ({STALL_WARNING_ENV}); {then}")
    return "; ".join(parts) + "."


def report_stall(message: str, **args: object) -> None:
    """Log a stall report (WARNING on the ``mpistrat`` logger: stderr unless logging is configured
    otherwise) and mark it in the timeline."""
    logger.warning(message)
    if timeline.enabled():
        timeline.record("stall", "stall", timeline.now_us(), 0.0, message=message, **args)
