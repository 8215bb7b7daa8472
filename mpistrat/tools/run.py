"""Run a Python program so that an exception on any rank ends the whole job.

Usage (as ``python -m mpi4py``)::

    mpiexec -n 4 python -m mpistrat.run script.py [args...]
    mpiexec -n 4 python -m mpistrat.run -m package.module [args...]
    mpiexec -n 4 python -m mpistrat.run -c "code" [args...]

It installs :func:`mpistrat.comm.install_abort_on_exception` (an
uncaught exception, in the main thread or any other, prints its traceback
prefixed with ``[rank R]`` and calls ``MPI_Abort``), then runs the program.
A non-zero ``sys.exit`` on one rank also aborts the job at once, so the
other ranks never wait for it.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = "usage: python -m mpistrat.run [script.py | -m module | -c code | -] [args...]"


def main(argv: list[str] | None = None) -> None:
    """Run ``argv`` (default ``sys.argv[1:]``) with the abort-on-exception hook."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not args else sys.stdout)
        raise SystemExit(2 if not args else 0)
    if args[0] in ("-m", "-c") and len(args) < 2:
        print(f"{_USAGE}\nArgument expected for option: {args[0]}", file=sys.stderr)
        raise SystemExit(2)
    from mpi4py.run import run_command_line, set_abort_status  # noqa: PLC0415

    from mpistrat.comm import install_abort_on_exception  # noqa: PLC0415

    hooked = install_abort_on_exception()
    try:
        run_command_line(args)
    except SystemExit as exc:
        if hooked and exc.code not in (None, 0):
            _abort_on_exit(exc)
        set_abort_status(exc)
        raise
    except KeyboardInterrupt as exc:
        set_abort_status(exc)
        raise
    except BaseException:
        set_abort_status(1)  # in case the hook is disabled (MPISTRAT_NO_ABORT_HOOK=1)
        raise


def _abort_on_exit(exc: SystemExit) -> None:
    """A non-zero exit on one rank of several: abort now (before exit handlers
    that might wait for the other ranks)."""
    from mpi4py import MPI  # noqa: PLC0415

    if not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        return
    code = exc.code if isinstance(exc.code, int) else 1
    if not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.write(
        f"[rank {MPI.COMM_WORLD.Get_rank()}] exited with status {code}; aborting all "
        f"{MPI.COMM_WORLD.Get_size()} ranks (MPI_Abort).\n"
    )
    sys.stderr.flush()
    from mpistrat.comm import abort_world  # noqa: PLC0415

    abort_world(code)


if __name__ == "__main__":
    main()
