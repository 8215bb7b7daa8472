"""Every ``MPISTRAT_*`` setting, parsed from the environment into one frozen :class:`Settings`.

Nothing else in the library reads ``MPISTRAT_*`` variables: :data:`VARIABLES` names each one,
:func:`settings` parses them, :func:`describe` lists the effective values
(``python -m mpistrat info --settings``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import threading
import types
import warnings
from typing import Any, Callable, Mapping

__all__ = [
    "Settings",
    "Variable",
    "VARIABLES",
    "settings",
    "get",
    "describe",
    "parse_bytes",
    "parse_bool",
    "l2_cache_bytes",
    "last_level_cache_bytes",
    "node_chunk_bytes",
    "default_chunk_bytes",
    "cache_block_bytes",
    "update_block_bytes",
]

PREFIX = "MPISTRAT_"
# Settings earlier releases read: named in the warning, with what replaced them.
REMOVED = {
    "MPISTRAT_SHM_SYNC": "removed: the node synchronisation is always the epoch counters, the only one that "
                         "honours the timeout",
}
# Read by the project's scripts and test fixtures, not by the library: known, never warned about.
SCRIPT_VARIABLES = ("MPISTRAT_VENV", "MPISTRAT_SERIAL_TIMEOUT", "MPISTRAT_MPI_TIMEOUT", "MPISTRAT_SLURM_INSTALL_BUDGET",
                    "MPISTRAT_TEST_NO_ABORT", "MPISTRAT_MPI", "MPISTRAT_TEST_SET", "MPISTRAT_TEST_OPENMPI")

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)i?b?\s*$", re.IGNORECASE)
_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off"))


def parse_bytes(text: str, what: str) -> int:
    """``"4096"``, ``"256K"``, ``"64MiB"``, ``"1G"`` as a byte count (ValueError naming ``what``)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{what} must be a byte count such as 4096, 256K or 64M, got {text!r}")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def parse_bool(text: str, what: str) -> bool:
    """The one boolean rule: 1/true/yes/on or 0/false/no/off, any case (ValueError naming ``what``)."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{what} must be one of 1/true/yes/on or 0/false/no/off, got {text!r}")


def _seconds(minimum: float, allow_zero: bool) -> Callable[[str, str], float]:
    def parse(text: str, what: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        ok = value == value and value != float("inf") and (value > minimum or (allow_zero and value == minimum))
        if not ok:
            bound = f">= {minimum:g}" if allow_zero else f"> {minimum:g}"
            raise ValueError(f"{what} must be a finite number of seconds {bound}, got {text!r}")
        return value
    return parse


def _grace(text: str, what: str) -> float:
    return max(0.05, _seconds(0.0, True)(text, what))


def _min_bytes(text: str, what: str) -> int | str:
    word = text.strip().lower()
    return word if word in ("off", "auto") else parse_bytes(text, what)


def _chunk_bytes(text: str, what: str) -> int | str:
    word = text.strip().lower()
    return word if word == "auto" else parse_bytes(text, what)


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(text: str, what: str) -> str:
        word = text.strip().lower()
        if word not in choices:
            raise ValueError(f"{what} must be one of {', '.join(choices)}, got {text!r}")
        return word
    return parse


def _positive_int(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return value


def _path(text: str, what: str) -> str | None:
    return text.strip() or None


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: the field it sets, how it is parsed, its default and what it does."""

    name: str
    field: str
    parse: Callable[[str, str], Any]
    default: Any
    help: str


@functools.lru_cache(maxsize=None)
def _cache_sizes() -> Mapping[int, int]:
    """CPU 0's data or unified caches (Linux sysfs): size in bytes by level; empty when unknown. Read once
    per process: a hardware fact."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    sizes: dict[int, int] = {}
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return sizes
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:  # an entry that cannot be read is left out, the others kept
            with open(os.path.join(base, entry, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(base, entry, "level")) as f:
                level = int(f.read().strip())
            with open(os.path.join(base, entry, "size")) as f:
                sizes[level] = parse_bytes(f.read().strip(), f"L{level} cache size")
        except (OSError, ValueError):
            continue
    return types.MappingProxyType(sizes)


def _l2_share(divisor: int, floor_log2: int, unknown: int) -> tuple[int, str]:
    """The largest power of two at most L2 / ``divisor``, at least ``2 ** floor_log2`` (``unknown`` when
    L2 is unknown); and where that came from."""
    l2 = l2_cache_bytes()
    if l2 is None:
        return unknown, "default"
    return 1 << max(floor_log2, (l2 // divisor).bit_length() - 1), "hardware"


def l2_cache_bytes() -> int | None:
    """The size of CPU 0's level-2 cache in bytes (Linux sysfs), or None when unknown."""
    return _cache_sizes().get(2)


def last_level_cache_bytes() -> int | None:
    """The size of CPU 0's last-level cache (level 3 or more) in bytes (Linux sysfs), or None when unknown."""
    sizes = _cache_sizes()
    levels = [level for level in sizes if level >= 3]
    return sizes[max(levels)] if levels else None


def cache_block_bytes() -> tuple[int, str]:
    """A block of an eighth of L2 (a power of two, at least 16 KiB; 256 KiB when L2 is unknown), so that
    the blocks one pass of an array operation touches together stay in cache; and where that came from.
    The shared-memory reduce's default block (up to seven ranks' blocks at once)."""
    return _l2_share(8, 14, 256 << 10)


def update_block_bytes() -> tuple[int, str]:
    """The optimizers' update block (train/kernels.py): half of L2 (a power of two, at least 64 KiB; 512 KiB
    when L2 is unknown), so a rule's scratch block stays in cache and each block's few NumPy calls are
    spread over much data (an eighth of L2 cost twice as much per variable: benchmarks/README.md); and
    where that came from."""
    return _l2_share(2, 16, 512 << 10)


def node_chunk_bytes(machine_ranks: int) -> int:
    """The shared-memory transport's default chunk where ``machine_ranks`` ranks share a machine: the
    largest power of two with which every rank's chunk, its copy in the window and its results (three
    chunks per rank) fill at most half of the last-level cache, so a chunk's passes meet it there; at
    least :func:`default_chunk_bytes` (which it is when the last-level cache is unknown). The
    measurements behind it are in benchmarks/README.md."""
    floor = default_chunk_bytes()[0]
    llc = last_level_cache_bytes()
    if llc is None:
        return floor
    share = llc // (6 * max(1, machine_ranks))
    return max(floor, 1 << (share.bit_length() - 1)) if share > 0 else floor


def default_chunk_bytes() -> tuple[int, str]:
    """The shared-memory transport's chunk for long single arrays: half of L2, so a chunk's copy in,
    sum and copy out stay in cache (a power of two, at least 256 KiB; 1 MiB when L2 is unknown); and where
    that came from."""
    return _l2_share(2, 18, 1 << 20)


VARIABLES: tuple[Variable, ...] = (
    Variable("MPISTRAT_TIMEOUT_SECONDS", "timeout_seconds", _seconds(0.0, False), 600.0,
             "how long a collective waits for the other ranks (CommunicationOptions.timeout_seconds=None)"),
    Variable("MPISTRAT_TIMEOUT_GRACE_SECONDS", "timeout_grace_seconds", _grace, 0.5,
             "how long a rank that timed out waits for its peers' answers (at least 0.05)"),
    Variable("MPISTRAT_STALL_WARNING_SECONDS", "stall_warning_seconds", _seconds(0.0, True), 60.0,
             "interval of the stall inspector's reports (0: off)"),
    Variable("MPISTRAT_STALL_SHUTDOWN_SECONDS", "stall_shutdown_seconds", _seconds(0.0, True), 0.0,
             "a collective stalled this long raises on every rank (0: off)"),
    Variable("MPISTRAT_SHM_MIN_BYTES", "shm_min_bytes", _min_bytes, "auto",
             "smallest bucket for the shared-memory window: a size, off, or auto (16K)"),
    Variable("MPISTRAT_SHM_MAX_BYTES", "shm_max_bytes", parse_bytes, 64 << 20,
             "largest bucket for the shared-memory window, per rank"),
    Variable("MPISTRAT_SHM_BLOCK_BYTES", "shm_block_bytes", parse_bytes, None,
             "block of the shared-memory reduce-scatter (default: an eighth of the L2 cache)"),
    Variable("MPISTRAT_SHM_CHUNK_BYTES", "shm_chunk_bytes", _chunk_bytes, None,
             "single arrays longer than this are reduced chunk by chunk (default: sized to the last-level "
             "cache, none where ranks outnumber cores; 0: never; auto: measured)"),
    Variable("MPISTRAT_COMPILED_LANE", "compiled_lane", parse_bool, True,
             "repeated small all-reduces on one node in one compiled call, where the extension was built"),
    Variable("MPISTRAT_AGREEMENT", "agreement", _choice("auto", "mpi"), "auto",
             "transport of the agreement check: auto (node shared memory on one node) or mpi"),
    Variable("MPISTRAT_PRETEND_NODES", "pretend_nodes", _positive_int, None,
             "cut the ranks into this many pretend nodes (tests and benchmarks)"),
    Variable("MPISTRAT_CUDA_AWARE", "cuda_aware", parse_bool, None,
             "whether MPI takes CuPy buffers directly (default: asked from the MPI library)"),
    Variable("MPISTRAT_CHECK_NUMERICS", "check_numerics", parse_bool, False,
             "check every reduction's inputs for NaN/Inf first"),
    Variable("MPISTRAT_TIMELINE", "timeline", _path, None,
             "record a Chrome-trace timeline of every rank to this path (read at the first strategy or communicator)"),
    Variable("MPISTRAT_NO_ABORT_HOOK", "no_abort_hook", parse_bool, False,
             "do not install the hook that aborts the job on an uncaught exception"),
    Variable("MPISTRAT_PRINT_RANKS", "print_ranks", parse_bool, False,
             "rank 0 prints a rank -> host/PID table when a MultiWorkerMirroredStrategy starts"),
    Variable("MPISTRAT_NUM_PS", "num_ps", _positive_int, None,
             "parameter servers of MPIClusterResolver() (num_ps=None): rank 0 the chief, the next ranks ps"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The effective value of every ``MPISTRAT_*`` setting; ``sources[field]`` says where it came from."""

    timeout_seconds: float
    timeout_grace_seconds: float
    stall_warning_seconds: float
    stall_shutdown_seconds: float
    shm_min_bytes: int | str
    shm_max_bytes: int
    shm_block_bytes: int
    shm_chunk_bytes: int | str
    compiled_lane: bool
    agreement: str
    pretend_nodes: int | None
    cuda_aware: bool | None
    check_numerics: bool
    timeline: str | None
    no_abort_hook: bool
    print_ranks: bool
    num_ps: int | None
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)


class _Parsed:
    """One environment's parse: every field's value and source, and the error of each malformed one."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        for var in VARIABLES:
            text = env.get(var.name, "").strip()
            if not text:
                self.values[var.field], self.sources[var.field] = var.default, "default"
                continue
            try:
                self.values[var.field], self.sources[var.field] = var.parse(text, var.name), "environment"
            except ValueError as exc:
                self.errors[var.field] = str(exc)
        if self.values.get("shm_block_bytes", 0) is None:
            self.values["shm_block_bytes"], self.sources["shm_block_bytes"] = cache_block_bytes()
        if self.values.get("shm_chunk_bytes", 0) is None:
            self.values["shm_chunk_bytes"], self.sources["shm_chunk_bytes"] = default_chunk_bytes()
        self.settings = None if self.errors else Settings(**self.values, sources=self.sources)


_lock = threading.Lock()
_cached: tuple[tuple, _Parsed] | None = None
_warned: set[str] = set()


def _snapshot() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(PREFIX)))


def _warn_unknown(names: list[str]) -> None:
    """One warning per unknown ``MPISTRAT_*`` name, naming the closest known one."""
    known = list(_BY_NAME) + list(SCRIPT_VARIABLES)
    for name in names:
        if name in _BY_NAME or name in SCRIPT_VARIABLES or name in _warned:
            continue
        _warned.add(name)
        if name in REMOVED:
            warnings.warn(f"mpistrat setting {name} is ignored: {REMOVED[name]}", RuntimeWarning, stacklevel=4)
            continue
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(_BY_NAME)}"
        warnings.warn(f"unknown mpistrat setting {name} in the environment (ignored){hint}", RuntimeWarning,
                      stacklevel=4)


def _parsed() -> _Parsed:
    global _cached
    snap = _snapshot()
    cached = _cached
    if cached is not None and cached[0] == snap:
        return cached[1]
    with _lock:
        parsed = _Parsed(dict(snap))
        _warn_unknown([name for name, _ in snap])
        _cached = (snap, parsed)
    return parsed


def settings() -> Settings:
    """The current settings (ValueError naming every malformed ``MPISTRAT_*`` variable).

    The environment is parsed once, and the same object returned until an ``MPISTRAT_*`` variable
    changes (a test or a program that sets ``os.environ`` before building a strategy gets a fresh
    object then). Booleans follow one rule (:func:`parse_bool`); an unknown ``MPISTRAT_*`` name gets
    one warning naming the closest known one.
    """
    parsed = _parsed()
    if parsed.settings is None:
        raise ValueError("; ".join(parsed.errors.values()))
    return parsed.settings


def get(field: str) -> Any:
    """One setting's value, raising only if that one is malformed (for what is read at import,
    so that a malformed setting of the communicator does not make ``import mpistrat`` fail)."""
    parsed = _parsed()
    if field in parsed.errors:
        raise ValueError(parsed.errors[field])
    return parsed.values[field]


def describe() -> list[tuple[str, str, str]]:
    """``(variable, effective value, source)`` for every setting, in the table's order; a malformed
    one shows its error as its value (``python -m mpistrat info --settings`` prints it)."""
    parsed = _parsed()
    rows = []
    for var in VARIABLES:
        if var.field in parsed.errors:
            rows.append((var.name, f"error: {parsed.errors[var.field]}", "environment"))
            continue
        value = parsed.values[var.field]
        rows.append((var.name, "unset" if value is None else str(value), parsed.sources[var.field]))
    return rows
