"""The machine's cross-core cache-line round trip, printed beside a table as the sign of the VM's speed phase."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core_round_trip.c")


@functools.lru_cache(maxsize=1)
def _program() -> str | None:
    """core_round_trip.c built once per process in a temporary folder (None: no C compiler or no build)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    exe = os.path.join(tempfile.mkdtemp(prefix="mpistrat-bench-"), "core_round_trip")
    try:
        built = subprocess.run([cc, "-O2", "-pthread", _SOURCE, "-o", exe], capture_output=True, timeout=60,
                               check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if built.returncode == 0 else None


def round_trip_ns() -> float | None:
    """The median cross-core round trip between cores 0 and 1, in ns (None where it cannot be measured)."""
    exe = _program()
    if exe is None:
        return None
    try:  # the program ends itself after about 2 s on a busy machine
        out = subprocess.run([exe], capture_output=True, text=True, timeout=30, check=False)
        return float(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def describe(values: list[float | None]) -> str:
    """``"1015, 987 ns"`` (``?`` where a run could not measure it)."""
    return ", ".join("?" if v is None else f"{v:.0f}" for v in values) + " ns"
