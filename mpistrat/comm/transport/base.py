"""The transport contract: what every way of all-reducing a bucket between ranks implements.

:class:`Transport` is the contract; :class:`AgreementHook` is how a transport, which never decides
whether the ranks agree, tells the communicator's agreement check that this rank's data is staged.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np
from mpi4py import MPI

from mpistrat.comm.options import CommunicationOptions
from mpistrat.comm.runtime.topology import Topology
from mpistrat.config import Settings

__all__ = [
    "AgreementHook",
    "NO_AGREEMENT",
    "RepeatTransport",
    "ResultBlockSet",
    "ResultBlockSource",
    "Transport",
    "TransportContext",
]


class AgreementHook(abc.ABC):
    """Where, inside a transport's execute, the call's agreement check may complete.

    A transport calls :meth:`staged` exactly once per execute: after this rank's
    data is staged (packed, or copied where the reduction reads it) and before
    anything that needs another rank, or, with ``first=False``, before staging
    when it must do something collective first (grow a window, measure).
    """

    @abc.abstractmethod
    def staged(self, first: bool = True) -> bool:
        """This rank's data is staged (``first``), or the transport needs its peers now (not ``first``).

        Returns True only to a transport with ``folds_agreement`` and only when the
        check itself synchronised every rank after all of them staged: the transport
        then skips its own first synchronisation (every rank gets the same answer).
        """


class _AlreadyAgreed(AgreementHook):
    """The hook of a call whose check already completed (or that needs none)."""

    def staged(self, first: bool = True) -> bool:
        return False


NO_AGREEMENT: AgreementHook = _AlreadyAgreed()


class ResultBlockSet(abc.ABC):
    """Result arrays of one size in memory the transport writes into directly, shared by the ranks that
    receive the same result (read-only: a write would reach the other ranks' results)."""

    #: The blocks (1-D read-only arrays), in slot order.
    blocks: list

    @abc.abstractmethod
    def free_slots(self, own_refs: int = 0) -> list[int]:
        """The slots of the blocks that nothing on this rank refers to beyond ``own_refs`` references
        each (the caller's own views of every block, kept across calls), in slot order."""

    @abc.abstractmethod
    def offer(self, slots: int, private: Any) -> None:
        """Offer ``slots`` (a bit per slot nobody on this rank holds) for the next call, whose result is
        ``private`` (a 1-D array) unless every rank offered a common slot."""

    @property
    @abc.abstractmethod
    def chosen(self) -> int:
        """The slot this rank's last call put its result in, or -1: it went into the private array offered."""


class ResultBlockSource(abc.ABC):
    """A transport's result blocks, one :class:`ResultBlockSet` per array size, made at the first call of it."""

    @abc.abstractmethod
    def shared_results(self, count: int, dtype: np.dtype) -> ResultBlockSet | None:
        """The blocks of ``count`` items of ``dtype``, once made."""

    @abc.abstractmethod
    def may_share(self, count: int, dtype: np.dtype) -> bool:
        """Whether blocks of that size may still be made (False: made, refused, or never)."""


@dataclass(frozen=True)
class TransportContext:
    """What a transport is built from: the communicator's duplicate, its options, settings and topology."""

    comm: MPI.Comm
    options: CommunicationOptions
    settings: Settings
    topology: Topology
    timeout: float


class Transport(abc.ABC):
    """All-reduces buckets of one kind of memory (host or device) between the ranks of a communicator.

    A transport answers Horovod's two questions for one bucket (a flat array of one
    dtype): *enabled?* (:meth:`enabled`) and *execute* (:meth:`allreduce_packed` for a
    bucket the communicator packed into :meth:`pack_buffer`, :meth:`allreduce_array`
    for one contiguous array). A transport never decides whether the ranks agree on
    the call: the communicator's agreement check does, and the transport only tells
    it, through the :class:`AgreementHook` every execute gets, when this rank's data
    is staged. A transport whose first synchronisation can stand in for the check
    says so (``folds_agreement``), and skips that synchronisation when the hook says
    every rank has staged.

    Every method but :meth:`enabled` is collective: every rank calls it with the
    same count, dtype and op, in the same order (the agreement check guarantees it).
    """

    #: The name in the transport table.
    name: ClassVar[str]
    #: Whether a True from :meth:`AgreementHook.staged` lets this transport skip its first synchronisation.
    folds_agreement: ClassVar[bool] = False
    #: Result blocks in memory this transport writes into directly, or None.
    result_blocks: ResultBlockSource | None = None

    @abc.abstractmethod
    def enabled(self, nbytes: int, dtype: np.dtype, op: str) -> bool:
        """Whether this transport takes a bucket of ``nbytes`` of ``dtype`` with wire op ``op`` (local)."""

    @abc.abstractmethod
    def pack_buffer(self, count: int, dtype: np.dtype) -> Any:
        """A 1-D buffer of ``count`` items where the caller packs the bucket (valid until the next call)."""

    @abc.abstractmethod
    def allreduce_packed(self, count: int, dtype: np.dtype, op: str, hook: AgreementHook, out: Any = None) -> Any:
        """Reduce what was packed into :meth:`pack_buffer`; call ``hook.staged()`` first.

        Returns ``out`` (1-D, ``count`` items), or, when ``out`` is None, a 1-D
        array the transport owns, valid until the next :meth:`pack_buffer`. Where ``out`` came
        with an offer of the transport's ``result_blocks`` and the call took one of them (their
        ``chosen``), the result is in that block and ``out`` is left alone.
        """

    @abc.abstractmethod
    def allreduce_array(self, src: Any, dst: Any, op: str, hook: AgreementHook) -> None:
        """Reduce one C-contiguous array into ``dst`` (``src`` may be ``MPI.IN_PLACE``), calling the hook; or,
        where ``dst`` came with an offer of the transport's ``result_blocks`` and the call took one of them
        (their ``chosen``), into that block, ``dst`` left alone."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the transport holds (collective)."""

    def describe(self) -> dict[str, Any]:
        """What this transport chose, for ``python -m mpistrat info`` (its name; subclasses add sizes)."""
        return {"name": self.name}


class RepeatTransport(Transport):
    """A transport that reduces a repeated call of one array through what it prepared for that call once.

    The lean path of a training step's small reductions (``RankCommunicator.allreduce_repeat``): the
    communicator asks :meth:`prepare_array` when it plans a call of one array, then, for every
    repeat, calls :meth:`allreduce_prepared` with it: no lookups, no op checks, one call.
    """

    @abc.abstractmethod
    def prepare_array(self, shape: tuple[int, ...], dtype: np.dtype, op: str) -> Any:
        """What :meth:`allreduce_prepared` needs for arrays of ``shape`` and ``dtype`` with wire op ``op``
        (local; only for what :meth:`enabled` takes)."""

    @abc.abstractmethod
    def allreduce_prepared(self, prepared: Any, src: Any, dst: Any, staged: Callable[[], bool]) -> None:
        """:meth:`allreduce_array` of the C-contiguous ``src`` into ``dst`` with ``prepared`` (from
        :meth:`prepare_array`); ``staged`` is the hook's :meth:`AgreementHook.staged`, called once."""
