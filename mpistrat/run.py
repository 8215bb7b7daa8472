"""Run a Python program so that an exception on any rank ends the whole job.

Usage (as ``python -m mpi4py``)::

    mpiexec -n 4 python -m mpistrat.run script.py [args...]
    mpiexec -n 4 python -m mpistrat.run -m package.module [args...]
    mpiexec -n 4 python -m mpistrat.run -c "code" [args...]

It installs :func:`mpistrat.comm.safety.install_abort_on_exception` (an
uncaught exception, in the main thread or any other, prints its traceback
prefixed with ``[rank R]`` and calls ``MPI_Abort``), then runs the program.
A non-zero ``sys.exit`` on one rank also aborts the job (mpi4py's abort
status), so the other ranks never wait for it.
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

    from mpistrat.comm.safety import install_abort_on_exception  # noqa: PLC0415

    install_abort_on_exception()
    try:
        run_command_line(args)
    except SystemExit as exc:
        set_abort_status(exc)
        raise
    except KeyboardInterrupt as exc:
        set_abort_status(exc)
        raise
    except BaseException:
        set_abort_status(1)  # in case the hook is disabled (MPISTRAT_NO_ABORT_HOOK=1)
        raise


if __name__ == "__main__":
    main()
