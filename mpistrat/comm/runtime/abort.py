"""Ending the whole MPI job when one rank fails: abort-on-exception hooks and a clean ``MPI_Abort``.

:func:`install_abort_on_exception` installs the hooks (``python -m mpistrat.run script.py`` runs a
script with them); :func:`abort_world` ends the job.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
import warnings
from typing import Any

from mpi4py import MPI

from mpistrat import config, timeline

__all__ = [
    "install_abort_on_exception",
    "abort_world",
    "record_ranks",
    "unlink_mpi_shared_memory_files",
]


_HOOK_LOCK = threading.Lock()
_HOOK_INSTALLED = False
_RANK_TABLE: list[tuple[str, int]] = []  # (host, PID) by rank of the last strategy's communicator


def record_ranks(comm: Any) -> list[tuple[str, int]]:
    """Collective over ``comm``: every rank's ``(host, PID)``, in rank order, kept for the missing-peer summary.

    With ``MPISTRAT_PRINT_RANKS=1`` rank 0 prints the table (one line per rank), so a user can tell which
    process a launcher's "PID 1234 ... EXIT CODE: 9" was. Always gathered (one small all-gather at start-up),
    so a setting that differs between ranks cannot leave some of them waiting.
    """
    table = [tuple(row) for row in comm.allgather((socket.gethostname(), os.getpid()))]
    _RANK_TABLE[:] = table
    try:
        show = config.get("print_ranks")
    except ValueError as exc:
        warnings.warn(f"{exc}; not printing the rank table", RuntimeWarning, stacklevel=2)
        show = False
    if show and comm.Get_rank() == 0:
        rows = "".join(f"[mpistrat] rank {r}: host {host} PID {pid}\n" for r, (host, pid) in enumerate(table))
        sys.stdout.write(f"[mpistrat] {len(table)} ranks:\n{rows}")
        sys.stdout.flush()
    return table


def _world_rank_size() -> tuple[int, int]:
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _rank_name(rank: int) -> str:
    if 0 <= rank < len(_RANK_TABLE):
        host, pid = _RANK_TABLE[rank]
        return f"rank {rank} (host {host}, PID {pid})"
    return f"rank {rank}"


def _missing_peers(exc: BaseException | None) -> tuple[list[int], str, int, int | None]:
    """``(gone, how, this rank, lowest surviving rank)`` for a missing-peer error; ``gone`` empty otherwise."""
    gone = list(getattr(exc, "exited_ranks", None) or ())
    how = "exited without joining"
    if not gone:
        gone, how = list(getattr(exc, "missing_ranks", None) or ()), "never arrived at"
    me = (socket.gethostname(), os.getpid())
    if me in _RANK_TABLE:
        rank, size = _RANK_TABLE.index(me), len(_RANK_TABLE)
    else:
        rank, size = _world_rank_size()
    survivors = [r for r in range(size) if r not in gone]
    return gone, how, rank, (survivors[0] if survivors else None)


def missing_peer_summary(exc: BaseException | None) -> str | None:
    """The one-line summary of a missing peer, on the lowest surviving rank only; None elsewhere or for other errors.

    For a :class:`~mpistrat.comm.errors.PeerExitedError` (``exited_ranks``) or a
    :class:`~mpistrat.comm.errors.CollectiveTimeoutError` with ``missing_ranks``; ranks are those of the
    strategy's communicator (:func:`record_ranks`).
    """
    gone, how, rank, lowest = _missing_peers(exc)
    if not gone or rank != lowest:
        return None
    collective = getattr(exc, "collective", "") or "(unknown)"
    names = ", ".join(_rank_name(r) for r in sorted(gone))
    return (f"[mpistrat] job summary from rank {rank}, the lowest surviving: {names} {how} collective {collective} "
            f"({type(exc).__name__}); ending the job with exit code 1")


def _report_and_abort(exc_type: type, exc: BaseException | None, tb: Any, where: str = "") -> bool:
    """Print the traceback with a rank prefix and abort; False when size 1."""
    rank, size = _world_rank_size()
    if size <= 1:
        return False
    code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
    try:  # whatever goes wrong while reporting, the job still ends: a hook that raised would leave peers waiting
        lines = "".join(traceback.format_exception(exc_type, exc, tb)).rstrip("\n").split("\n")
        gone, _, me, lowest = _missing_peers(exc)
        if gone and lowest is not None and me != lowest:  # one traceback (the lowest survivor's) is enough
            lines = [*traceback.format_exception_only(exc_type, exc)[-1].rstrip("\n").split("\n"),
                     f"(traceback and summary on rank {lowest})"]
        prefix = f"[rank {rank}] "
        head = f"{prefix}Uncaught exception{where}; aborting all {size} ranks (MPI_Abort).\n"
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - stdout may be closed
            pass
        summary = missing_peer_summary(exc)
        sys.stderr.write(head + "".join(prefix + line + "\n" for line in lines) + (summary + "\n" if summary else ""))
        sys.stderr.flush()
    except BaseException as report_error:  # noqa: BLE001
        try:
            sys.stderr.write(f"[rank {rank}] {exc_type.__name__}: {exc} (reporting it failed: {report_error!r}); "
                             "aborting all ranks\n")
        except BaseException:  # noqa: BLE001 - stderr gone too
            pass
    abort_world(code)
    return True


def unlink_mpi_shared_memory_files() -> list[str]:
    """Unlink the ``/dev/shm`` files this process has mapped for MPICH's shared memory; return them.

    MPICH removes them at ``MPI_Finalize`` but not at ``MPI_Abort``, so every
    aborted job would leave its files in ``/dev/shm`` of each node. Unlinking is safe while the job still runs: mapped
    memory stays valid for every process that has it; only new attachments by
    name would fail, and an aborting job makes none.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/mpich_shm_" in line}
    except (OSError, IndexError):
        return []
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another rank was first
            pass
    return removed


def abort_world(code: int) -> None:
    """``MPI.COMM_WORLD.Abort(code)`` after a short pause, so the launcher can
    forward what this rank just wrote before it kills the job; MPICH's shared
    memory files are unlinked first (:func:`unlink_mpi_shared_memory_files`), and the timeline's buffered
    events written (:func:`mpistrat.timeline.flush`)."""
    timeline.flush()
    unlink_mpi_shared_memory_files()
    time.sleep(0.2)
    MPI.COMM_WORLD.Abort(code)


def install_abort_on_exception() -> bool:
    """Make an uncaught exception on any rank end the whole MPI job (``python -m mpistrat.run`` installs it).

    Installs ``sys.excepthook`` and ``threading.excepthook`` hooks that print
    the traceback, each line prefixed with ``[rank R]``, and call
    ``MPI.COMM_WORLD.Abort(1)`` when the world has more than one rank (with
    one rank the previous hooks run). Idempotent. ``MPISTRAT_NO_ABORT_HOOK=1``
    disables it (returns False). A malformed ``MPISTRAT_NO_ABORT_HOOK`` installs the hook with a
    warning: raising here, on one rank, would leave the others waiting.
    """
    global _HOOK_INSTALLED
    try:
        disabled = config.get("no_abort_hook")
    except ValueError as exc:
        warnings.warn(f"{exc}; installing the abort-on-exception hook", RuntimeWarning, stacklevel=2)
        disabled = False
    if disabled:
        return False
    with _HOOK_LOCK:
        if _HOOK_INSTALLED:
            return True
        previous_sys = sys.excepthook
        previous_thread = threading.excepthook

        def excepthook(exc_type, exc, tb):  # noqa: ANN001
            if not _report_and_abort(exc_type, exc, tb):
                previous_sys(exc_type, exc, tb)

        def thread_excepthook(args):  # noqa: ANN001
            if args.exc_type is SystemExit:
                previous_thread(args)
                return
            name = getattr(args.thread, "name", "?")
            if not _report_and_abort(args.exc_type, args.exc_value, args.exc_traceback, f" in thread {name!r}"):
                previous_thread(args)

        sys.excepthook = excepthook
        threading.excepthook = thread_excepthook
        _HOOK_INSTALLED = True
        return True
