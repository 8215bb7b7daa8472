"""One collective call's agreement check, run where the call's plan allows: first, overlapped, or folded.

:class:`CallAgreement` is the communicator's side of the transport contract's
:class:`~mpistrat.comm.transport.base.AgreementHook`; :func:`choose_mode` says where each call's check runs.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from mpistrat import timeline
from mpistrat.comm.agreement.guard import AgreementGuard
from mpistrat.comm.agreement.signatures import CallKey
from mpistrat.comm.errors import CollectiveMismatchError
from mpistrat.comm.transport.base import NO_AGREEMENT, AgreementHook

__all__ = ["FIRST", "OVERLAP", "FOLD", "CHECKED", "OVERLAP_MAX_BYTES", "STAGED_FIRST", "CallAgreement", "FoldedCheck",
           "check_aux", "choose_mode", "require_same_pack"]

FIRST, OVERLAP, FOLD = 0, 1, 2
CHECKED = 3  # the call's check already ran (a call not planned before is checked, then planned)
# While it stages, a rank makes no MPI progress and answers no peer's query, so staging overlaps the
# check only for host buckets up to this size, far below the grace period a timed-out peer waits.
OVERLAP_MAX_BYTES = 4 << 20

# An all-reduce's aux: the bucket size (bytes_per_pack) shifted left by one, and this bit when the
# rank posted its check only after staging its first bucket (FOLD).
STAGED_FIRST = 1


def check_aux(pack_bytes: int, staged_first: bool = False) -> int:
    """The ``aux`` an all-reduce's (or broadcast's) check carries: the bucket size and :data:`STAGED_FIRST`."""
    return pack_bytes << 1 | (STAGED_FIRST if staged_first else 0)


def require_same_pack(aux: "np.ndarray | list[int]", call: str = "allreduce") -> bool:
    """Raise (on every rank: all see the same values) unless every rank fuses with the same bucket
    size; whether every rank staged its first bucket before its check (:data:`STAGED_FIRST`)."""
    values = aux if type(aux) is list else aux.tolist()  # a few ints: Python's min and max beat NumPy's
    lo, hi = min(values), max(values)
    if lo >> 1 != hi >> 1:
        detail = "; ".join(f"rank {r}: {p >> 1}" for r, p in enumerate(values))
        raise CollectiveMismatchError(
            f"Mismatched {call} bytes_per_pack ({detail}): the ranks would fuse different buckets; "
            "pass the same CommunicationOptions on every rank"
        )
    return bool(lo & STAGED_FIRST)


def choose_mode(guard: AgreementGuard | None, host: bool, nbytes: int, folds_agreement: bool) -> int:
    """Where the check of a repeated all-reduce runs, from its first bucket (the modes:
    :class:`CallAgreement`; a call not planned before is always checked ``FIRST``)."""
    if guard is None or not host or nbytes > OVERLAP_MAX_BYTES:
        return FIRST
    return FOLD if folds_agreement and guard.transport == "shm" else OVERLAP


def _all_failed_alike(signatures: list, error: Exception) -> bool:
    """Whether every rank sent a local error of ``error``'s type (their messages may name their own data)."""
    prefix = f"{type(error).__name__}: "
    return bool(signatures) and all(
        len(key[1]) == 1 and key[1][0][0] == "error" and str(key[1][0][1]).startswith(prefix) for key in signatures)


class CallAgreement(AgreementHook):
    """The agreement checks of one communicator, one call at a time (``guard`` None: one rank, no checks).

    :meth:`agree` runs a whole check; :meth:`begin` prepares one for a transport
    and returns the hook to hand it; :meth:`end` or :meth:`fail` closes it.
    With the timeline on, the check's span is kept for the call's event.

    For every all-reduce it runs the check of :class:`~mpistrat.comm.agreement.guard.AgreementGuard`
    in one of these places, chosen per plan by :func:`choose_mode`:

    * ``CHECKED``: it already ran (a call not planned before is checked with :meth:`agree`, then planned);
    * ``FIRST``: before the transport starts (device buckets, buckets above ``OVERLAP_MAX_BYTES``);
    * ``OVERLAP``: the check's round is posted, the transport stages this rank's
      first bucket, and the hook waits for the round once told the data is staged;
    * ``FOLD``: the whole check runs once the transport has staged, through node
      shared memory; when every rank had staged first (the ``STAGED_FIRST`` bit of
      the check's ``aux``), the check stands for the transport's first node
      synchronisation and the hook says so.

    A local error (bad arguments; under ``FOLD``, a failure while staging) travels in the call's
    key, so every rank raises instead of waiting. Under ``OVERLAP`` the round is out with the call's
    key before staging: a failure while staging finishes the check, so no request stays open, but
    the peers enter the transfer, where the transport's timeout or the abort hook ends them.
    """

    def __init__(self, guard: AgreementGuard | None) -> None:
        self.guard = guard
        self.span = (0.0, 0.0)  # timeline: the last check's (start, end), in microseconds
        self._mode = FIRST
        self._pending = False  # a begun check the transport has not reached yet
        self._call: tuple = ()
        self._t0 = 0.0

    # -- whole checks --------------------------------------------------------------------
    def agree(self, key: CallKey, timeout: float, aux: int = 0, error: Exception | None = None,
              h: int | None = None) -> np.ndarray | None:
        """Check ``key`` with every rank; each rank's ``aux`` (None on one rank). A local ``error``
        travels in the key, so every rank raises: where all failed with one error type, each its own
        error; else a mismatch naming the errors."""
        if error is not None:
            key = (key[0], (("error", f"{type(error).__name__}: {error}"),), ())
            h = None
        guard = self.guard
        aux_values = None
        if guard is not None:
            try:
                if timeline.enabled():
                    t0 = timeline.now_us()
                    try:
                        aux_values = guard.check(key, timeout, aux, h)
                    finally:
                        self._record(t0, key)
                else:
                    aux_values = guard.check(key, timeout, aux, h)
            except CollectiveMismatchError as mismatch:
                if error is not None and _all_failed_alike(mismatch.signatures, error):
                    raise error from None  # the same kind of error everywhere: each rank its own, as alone
                raise
        if error is not None:
            raise error
        return aux_values

    # -- checks a transport completes -------------------------------------------------------
    def begin(self, key: CallKey, h: int, timeout: float, pack_bytes: int, mode: int) -> AgreementHook:
        """Prepare the check of an all-reduce to run in ``mode``; the hook to hand the transport."""
        guard = self.guard
        if guard is None or mode == CHECKED:
            return NO_AGREEMENT
        if mode == FIRST:
            require_same_pack(self.agree(key, timeout, check_aux(pack_bytes), h=h))
            return NO_AGREEMENT
        if mode == OVERLAP:
            t0 = timeline.now_us() if timeline.enabled() else 0.0
            guard.start(key, timeout, check_aux(pack_bytes), h)
            self._t0 = t0
        elif guard.broken is not None:  # before staging: peers may still read this rank's last data
            guard.require_usable()
        self._mode, self._pending, self._call = mode, True, (key, h, timeout, pack_bytes)
        return self

    def staged(self, first: bool = True) -> bool:
        """The transport has staged this rank's data (or needs its peers before staging: not ``first``)."""
        if not self._pending:
            raise RuntimeError("the agreement hook was called twice in one all-reduce")
        self._pending = False
        guard = self.guard
        assert guard is not None
        key, h, timeout, pack_bytes = self._call
        if self._mode == OVERLAP:
            try:
                aux = guard.finish()
            finally:
                if self._t0:
                    self._record(self._t0, key)
            require_same_pack(aux)
            return False
        aux = pack_bytes << 1 | (STAGED_FIRST if first else 0)  # check_aux, inline: this is every call
        if timeline.enabled():
            return require_same_pack(self.agree(key, timeout, aux, h=h))
        return require_same_pack(guard.check_aux(key, timeout, aux, h))

    def end(self, transport: Any) -> None:
        """After the transport returned: a transport that never told the hook is a bug, raised on every rank."""
        if self._pending:
            self.fail(RuntimeError(f"transport {type(transport).__name__} never called its agreement hook: "
                                   "the check would have finished only after the data moved"))

    def fail(self, exc: BaseException) -> None:
        """The call failed before the transport told the hook: close the check so no rank waits, then
        raise (``exc`` here; where the check can still carry it, a mismatch on the other ranks)."""
        if not self._pending:
            raise exc
        self._pending = False
        guard = self.guard
        assert guard is not None
        key, _, timeout, _ = self._call
        if self._mode == OVERLAP:
            if guard.started:
                guard.finish()  # the round is out already: finish it, never leave it open
            raise exc
        if isinstance(exc, Exception):  # not KeyboardInterrupt and the like: those end the program
            self.agree(key, timeout, error=exc)
        raise exc

    def _record(self, t0: float, key: CallKey) -> None:
        t1 = timeline.now_us()
        self.span = (t0, t1)
        assert self.guard is not None
        timeline.record("check", "check", t0, t1 - t0, call=key[0], seq=self.guard.seq)


class FoldedCheck(AgreementHook):
    """The hook of one plan's repeated ``FOLD`` calls (the communicator's options): key, fingerprint, timeout
    and ``aux`` fixed with the plan, so a call sets :attr:`pending` and the transport's :meth:`staged` runs
    the check. :class:`CallAgreement`'s ``begin``/``staged``/``end`` for that case, with nothing to unpack."""

    __slots__ = ("_agreement", "_guard", "_key", "_h", "_timeout", "_aux", "pending")

    def __init__(self, agreement: CallAgreement, key: CallKey, h: int, timeout: float, pack_bytes: int) -> None:
        self._agreement = agreement
        self._guard = agreement.guard
        self._key, self._h, self._timeout = key, h, timeout
        self._aux = check_aux(pack_bytes, True)
        self.pending = False  # set by the caller before the transport, cleared by staged()

    def unstaged(self, transport: Any) -> NoReturn:
        """The transport returned still :attr:`pending` (it never called :meth:`staged`): a bug, raised on every
        rank (:meth:`fail`)."""
        self.fail(RuntimeError(f"transport {type(transport).__name__} never called its agreement hook"))

    def signature(self) -> tuple[CallKey, int, float, int]:
        """The plan's key, fingerprint, timeout and ``aux`` (staged first)."""
        return self._key, self._h, self._timeout, self._aux

    def staged(self, first: bool = True) -> bool:
        """Run the check once this rank's data is staged; whether every rank staged first."""
        if not self.pending:
            raise RuntimeError("the agreement hook was called twice in one all-reduce")
        self.pending = False
        aux = self._aux if first else self._aux & ~STAGED_FIRST
        return self.verdict(self._guard.check_aux(self._key, self._timeout, aux, self._h))

    def verdict(self, values: list[int]) -> bool:
        """Whether every rank staged first, from every rank's ``aux`` of a passed check (a different bucket
        size on some rank raises on every rank)."""
        if min(values) == max(values):  # every rank the same bucket size, all staged first (or none)
            return bool(values[0] & STAGED_FIRST)
        return require_same_pack(values)

    def fail(self, exc: BaseException) -> NoReturn:
        """The call failed: before the check, every rank is told (:meth:`CallAgreement.fail`); raises."""
        if not self.pending:
            raise exc
        self.pending = False
        if isinstance(exc, Exception):
            self._agreement.agree(self._key, self._timeout, error=exc)
        raise exc
