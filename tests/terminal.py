"""Run a command with its stderr on a pseudo-terminal (as a user's shell), capturing both streams."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios


def run_on_terminal(cmd: list[str], env: dict, timeout: float, columns: int = 100) -> tuple[int, str, str]:
    """Run ``cmd`` with stdout piped and stderr on a new pty ``columns`` wide (a new pty is 0 wide);
    return (exit status, stdout, what the terminal received)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, text=True,
                                env=env)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        out = proc.communicate(timeout=timeout)[0]
    finally:
        os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")
