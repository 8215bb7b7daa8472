"""Run a command with its output sent to PREFIX-rank<R>.log, R = this MPI rank.

Used by scripts/test.sh under mpiexec so each rank keeps its own log; the text
"{rank}" in the command's arguments is replaced by the rank. The rank comes
from the launcher's environment (PMI_RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID),
so MPI is not initialised here. The command replaces this process (exec).
"""

import os
import sys


def launcher_rank() -> str:
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return os.environ[var]
    return "0"


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: rank_log.py PREFIX COMMAND...", file=sys.stderr)
        return 2
    rank = launcher_rank()
    prefix, cmd = sys.argv[1], [a.replace("{rank}", rank) for a in sys.argv[2:]]
    fd = os.open(f"{prefix}-rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # exec, not a child process: the launcher must be able to kill the real process.
    os.execvp(cmd[0], cmd)
    return 127


if __name__ == "__main__":
    sys.exit(main())
