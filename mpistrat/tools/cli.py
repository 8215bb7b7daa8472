"""``python -m mpistrat COMMAND``: dispatch to the subcommand named in the ``COMMANDS`` table.

A command is a module with ``add_arguments(parser)`` and ``run(args) -> int``,
listed in ``COMMANDS``; only the chosen command's module is imported.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["COMMANDS", "main"]

#: name -> (module, one-line help). Add a command by adding a line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("mpistrat.tools.info", "print MPI, CUDA, GPU and device facts for every rank"),
    "timeline": ("mpistrat.tools.timeline", "merge the per-rank timeline files of a job; summarise a trace per rank"),
    "checkpoint": ("mpistrat.tools.checkpoint_cli", "list a checkpoint's variables, or export them (safetensors)"),
}


def _version() -> str:
    from mpistrat import __version__  # noqa: PLC0415

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m mpistrat",
                                     description="mpistrat command-line tools")
    parser.add_argument("--version", action="version", version=f"mpistrat {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module, text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=text, description=text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(cmd)
            cmd.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
