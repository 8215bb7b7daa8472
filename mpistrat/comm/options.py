"""Collective communication options, as ``tf.distribute.experimental``.

``CommunicationOptions`` has TensorFlow's constructor, validation and ``merge``; where mpistrat
differs, its class docstring says so.
"""

from __future__ import annotations

import copy
import enum
import math

from mpistrat import config

__all__ = [
    "CommunicationImplementation",
    "CommunicationOptions",
    "DEFAULT_BYTES_PER_PACK",
]

DEFAULT_BYTES_PER_PACK = 32 * 1024 * 1024


class CommunicationImplementation(enum.Enum):
    """Cross-rank collective implementation: a row of the transport table (comm/transport/table.py).

    AUTO, RING and NCCL are TensorFlow's names. AUTO takes the node
    shared-memory transport from its size threshold and plain MPI otherwise for host
    buckets, and NCCL across ranks for device buckets where every rank has a GPU of
    its own; RING takes plain MPI; NCCL is AUTO for device buckets, warning when the
    ranks share GPUs, and MPI for host buckets (within a rank NCCL is used whenever
    the rank has several GPUs).
    MPI (plain MPI only) and SHM (the shared-memory transport at every size up
    to its limit) are mpistrat's.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"
    MPI = "MPI"
    SHM = "SHM"


def _validate_timeout(timeout_seconds: object, source: str) -> float | None:
    if timeout_seconds is None:
        return None
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
        raise ValueError(f"{source} must be a positive number of seconds or None, got {timeout_seconds!r}")
    value = float(timeout_seconds)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source} must be a positive, finite number of seconds, got {timeout_seconds!r}")
    return value


class CommunicationOptions:
    """Options for cross-rank collectives (TF's ``CommunicationOptions``).

    ``CommunicationOptions(bytes_per_pack=0, timeout_seconds=None, implementation=AUTO)`` has
    TensorFlow's constructor, validation and :meth:`merge`. Two mpistrat-specific points:

    * ``bytes_per_pack=0`` means "the default bucket size"
      (:data:`DEFAULT_BYTES_PER_PACK`), see :meth:`pack_bytes`.
    * ``timeout_seconds=None`` never means "wait forever": it falls back to
      ``MPISTRAT_TIMEOUT_SECONDS`` (default 600 s), see :meth:`timeout`.

    Args:
      bytes_per_pack: fusion bucket size in bytes; 0 picks the default.
      timeout_seconds: how long a collective may wait for the other ranks
        before raising; None falls back to ``MPISTRAT_TIMEOUT_SECONDS`` (600 s).
      implementation: a :class:`CommunicationImplementation` or its name.
      deterministic: mpistrat's: sums (and MEAN) whose bits depend only on the
        replicas' values, never on the rank count, the replicas per rank or
        the node layout (an exact fixed-point sum, docs/internals.md,
        "Deterministic all-reduce"); every rank must ask for it or none.
        ``merge`` keeps it on once either side asks.
    """

    __slots__ = ("bytes_per_pack", "timeout_seconds", "implementation", "deterministic")

    def __init__(
        self,
        bytes_per_pack: int = 0,
        timeout_seconds: float | None = None,
        implementation: "CommunicationImplementation | str" = CommunicationImplementation.AUTO,
        deterministic: bool = False,
    ) -> None:
        if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int):
            raise ValueError(f"Argument `bytes_per_pack` must be an int >= 0, received {bytes_per_pack!r}.")
        if bytes_per_pack < 0:
            raise ValueError(f"Argument `bytes_per_pack` must be >=0, Received {bytes_per_pack}.")
        if isinstance(implementation, str):
            try:
                implementation = CommunicationImplementation(implementation.upper())
            except ValueError:
                names = ", ".join(m.name for m in CommunicationImplementation)
                raise ValueError(
                    f"Argument `implementation` {implementation!r} is not one of {names}."
                ) from None
        if not isinstance(implementation, CommunicationImplementation):
            raise ValueError(
                "Argument `implementation` must be instance of "
                "`mpistrat.experimental.CommunicationImplementation`, "
                f"received {implementation!r}."
            )
        self.bytes_per_pack = bytes_per_pack
        self.timeout_seconds = _validate_timeout(timeout_seconds, "Argument `timeout_seconds`")
        self.implementation = implementation
        if not isinstance(deterministic, bool):
            raise ValueError(f"Argument `deterministic` must be a bool, received {deterministic!r}.")
        self.deterministic = bool(deterministic)

    def merge(self, options: "CommunicationOptions | None") -> "CommunicationOptions":
        """A copy where the non-default fields of ``options`` take precedence."""
        merged = copy.copy(self)
        if options is None:
            return merged
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"Expected CommunicationOptions or None, got {type(options).__name__}")
        if options.bytes_per_pack != 0:
            merged.bytes_per_pack = options.bytes_per_pack
        if options.timeout_seconds is not None:
            merged.timeout_seconds = options.timeout_seconds
        if options.implementation != CommunicationImplementation.AUTO:
            merged.implementation = options.implementation
        if getattr(options, "deterministic", False):
            merged.deterministic = True
        return merged

    def pack_bytes(self) -> int:
        """The effective bucket size: ``bytes_per_pack`` or the default."""
        return self.bytes_per_pack or DEFAULT_BYTES_PER_PACK

    def timeout(self, settings: config.Settings | None = None) -> float:
        """The effective timeout in seconds (never infinite): ``timeout_seconds``, else the setting."""
        if self.timeout_seconds is not None:
            return self.timeout_seconds
        return (config.settings() if settings is None else settings).timeout_seconds

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommunicationOptions):
            return NotImplemented
        return (self.bytes_per_pack, self.timeout_seconds, self.implementation, self.deterministic) == (
            other.bytes_per_pack,
            other.timeout_seconds,
            other.implementation,
            other.deterministic,
        )

    def __repr__(self) -> str:
        return (
            f"CommunicationOptions(bytes_per_pack={self.bytes_per_pack}, "
            f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation}"
            + (", deterministic=True)" if self.deterministic else ")")
        )
