"""RankCommunicator: the cross-rank collectives under the strategies.

Every call first agrees with every rank on what is being done
(:class:`~mpistrat.comm.agreement.guard.AgreementGuard`: one tiny collective that
also carries per-rank sizes or codes where a call needs them), honouring
``options.timeout_seconds``, then moves the data:

* ``allreduce``: arrays are grouped by kind (NumPy, CuPy, other
  ``__cuda_array_interface__`` objects) and dtype into buckets of up to
  ``bytes_per_pack`` (:mod:`~mpistrat.comm.fusion`), one MPI call per
  bucket through the first enabled backend (:mod:`~mpistrat.comm.transport.table`).
  A bucket holding one contiguous array is reduced without packing, in place
  or into the result (the shared-memory backend copies it into its window:
  from 16 KiB that beat MPICH's in-place and send/receive ``Allreduce`` here).
  Plans, buckets and result arrays are cached per call signature, so the
  hot path allocates nothing for shapes it has seen; results handed out are
  never overwritten by later calls (see :class:`~mpistrat.comm.fusion.ResultPool`).
* ``allgather`` (sizes along ``axis`` may differ: ``Allgatherv``),
  ``broadcast``, and pickled ``broadcast_object`` / ``allgather_object``.
* ``step_agreement(code)``: one int per rank, carried by the check itself.

CuPy arrays go to MPI directly when it is CUDA-aware
(:func:`~mpistrat.comm.transport.cuda.mpi_cuda_support`), after synchronising the
stream; otherwise through pinned host buffers. Other objects exposing only
``__cuda_array_interface__`` need a CUDA-aware MPI and ``inplace=True``.
A one-rank communicator makes no MPI call and keeps the same semantics.
A communicator is used by one thread at a time.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat.comm.transport.table import (
    MPI_OPS,
    DeviceMpiAllreduceBackend,
    GrowableBuffers,
    MpiAllreduceBackend,
    mpi_datatype,
    select_backends,
)
from mpistrat.comm.allreduce_steps import (
    CAI,
    CUPY,
    HOST,
    Step,
    check_aux,
    folds_sync,
    overlaps_check,
    require_same_pack,
    run_steps,
)
from mpistrat.comm.allreduce_signature import allreduce_signature
from mpistrat.comm.transport.cuda import is_cupy_array, is_device_buffer, mpi_cuda_support, synchronize_producer
from mpistrat.comm.fusion import Bucket, pack, plan_buckets
from mpistrat.comm.runtime.lifetime import Resources, release_dropped, track
from mpistrat.comm.options import CommunicationOptions
from mpistrat import timeline
from mpistrat.comm.errors import CollectiveError
from mpistrat.comm.agreement.guard import AgreementGuard
from mpistrat.comm.agreement.signatures import CallKey, fingerprint

__all__ = ["RankCommunicator", "normalize_op"]

_PLAN_CACHE_MAX = 512


def normalize_op(op: Any) -> str:
    """``"sum"``, ``"min"`` or ``"max"`` from a string or ``ReduceOp`` (ValueError otherwise)."""
    name = getattr(op, "value", op)
    if isinstance(name, str):
        lower = name.strip().lower()
        if lower in MPI_OPS:
            return lower
        if lower == "mean":
            raise ValueError(
                "op 'mean' is not a cross-rank all-reduce op: all-reduce with 'sum' and divide by the "
                "number of replicas"
            )
    raise ValueError(f"Unknown all-reduce op {op!r}; expected 'sum', 'min' or 'max' (or a ReduceOp)")


def _op_param(op: Any) -> tuple[str, Exception | None]:
    if type(op) is str and op in MPI_OPS:
        return op, None
    try:
        return normalize_op(op), None
    except ValueError as exc:
        return repr(op), exc


def _traced(name: str) -> Callable:
    """Record a collective method in the timeline (bytes and count of the arrays it returns)."""
    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def traced(self: "RankCommunicator", *args: Any, **kwargs: Any) -> Any:
            if not timeline.enabled():
                return method(self, *args, **kwargs)
            t0 = timeline.now_us()
            result = method(self, *args, **kwargs)
            arrays = result if isinstance(result, list) else [result]
            self._record(name, t0, sum(int(a.nbytes) for a in arrays), arrays=len(arrays))
            return result
        return traced
    return wrap


class RankCommunicator:
    """Cross-rank collectives over a duplicate of ``comm`` (collective to create).

    Args:
      comm: the ranks taking part (default ``MPI.COMM_WORLD``); duplicated.
      options: default :class:`CommunicationOptions`; per-call options
        override them (:meth:`CommunicationOptions.merge`).
    """

    def __init__(self, comm: MPI.Comm | None = None, options: CommunicationOptions | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        if options is None:
            options = CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        self.options = options
        release_dropped(comm)  # what earlier communicators on these ranks left behind
        self.comm: MPI.Comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._timeout = options.timeout()
        self._pack = options.pack_bytes()
        try:
            self._guard = AgreementGuard(self.comm) if self.size > 1 else None
        except Exception:  # raised on every rank (a bad setting): nothing left behind
            self.comm.Free()
            raise
        self._host_backends: list[Any] = (
            select_backends(self.comm, options) if self.size > 1 else [MpiAllreduceBackend(self.comm)]
        )
        self._device_backend: DeviceMpiAllreduceBackend | None = None
        # Dropped without close(): released at the next collective point (lifetime.py).
        self._resources = Resources(self.comm, self._guard, self._host_backends)
        self._finalizer = track(self, self._resources)
        self._plans: dict[Any, list[Step]] = {}
        self._scratch = GrowableBuffers(lambda n, dt: np.empty(n, dtype=dt))
        self._check_span = (0.0, 0.0)  # timeline: the last check's (start, end)
        self._closed = False

    # ------------------------------------------------------------------ helpers

    def _settings(self, options: CommunicationOptions | None) -> tuple[float, int]:
        if options is None:
            return self._timeout, self._pack
        merged = self.options.merge(options)
        return merged.timeout(), merged.pack_bytes()

    def _check(self, key: CallKey, timeout: float, aux: int = 0, h: int | None = None) -> np.ndarray | None:
        if self._guard is None:
            if self._closed:
                raise RuntimeError("RankCommunicator used after close()")
            return None
        if not timeline.enabled():
            return self._guard.check(key, timeout, aux, h)
        t0 = timeline.now_us()
        try:
            return self._guard.check(key, timeout, aux, h)
        finally:
            t1 = timeline.now_us()
            self._check_span = (t0, t1)
            timeline.record("check", "check", t0, t1 - t0, call=key[0], seq=self._guard.seq)

    def _record(self, name: str, t0: float, nbytes: int, **args: Any) -> None:
        """A ``collective`` timeline event from ``t0`` to now (wait = the check)."""
        t2 = timeline.now_us()
        c0, c1 = self._check_span if self._check_span[0] >= t0 else (t0, t0)
        timeline.record(name, "collective", t0, t2 - t0, bytes=nbytes, wait_us=c1 - c0,
                        transfer_us=t2 - c1, ranks=self.size, **args)

    def _agree_or_raise(self, key: CallKey, error: Exception | None, timeout: float, aux: int = 0) -> np.ndarray | None:
        """Run the check; a local error travels in the key so every rank raises."""
        if error is not None:
            key = (key[0], (("error", f"{type(error).__name__}: {error}"),), ())
        aux_values = self._check(key, timeout, aux)
        if error is not None:
            raise error
        return aux_values

    @property
    def cuda_aware(self) -> bool:
        """Whether CuPy buffers go to MPI directly (else host-staged)."""
        return bool(mpi_cuda_support())

    def _device(self) -> DeviceMpiAllreduceBackend:
        if self._device_backend is None:
            self._device_backend = self._resources.device = DeviceMpiAllreduceBackend(self.comm, self.cuda_aware)
        return self._device_backend

    # ------------------------------------------------------------------ all-reduce

    def _signature(self, arrays: list, inplace: bool) -> tuple[tuple, tuple | None, Exception | None]:
        """Per-array ``(shape, dtype)`` signature, the arrays' kinds, a local error (allreduce_signature)."""
        return allreduce_signature(arrays, inplace, self._device_mpi_missing)

    def _device_mpi_missing(self) -> bool:
        return self.size > 1 and not self.cuda_aware

    def _plan(self, cache_key: tuple, sig: tuple, kinds: tuple | None, op: str, pack_bytes: int) -> list[Step]:
        """The steps of an all-reduce not planned before, filed under ``cache_key`` (checks its dtypes)."""
        op = normalize_op(op)
        for i, entry in enumerate(sig):
            dtype = np.dtype(entry[1])
            if dtype.kind not in "iufc":
                raise TypeError(
                    f"allreduce: array #{i} has dtype {dtype}; supported are integer, float and complex dtypes"
                )
            if dtype.kind == "c" and op != "sum":
                raise TypeError(f"allreduce: op {op!r} is not defined for complex array #{i} ({dtype})")
            mpi_datatype(dtype)  # ValueError when MPI has no such type
        kinds_list = kinds if kinds is not None else (HOST,) * len(sig)
        steps = []
        for kind in (HOST, CUPY, CAI):
            index = [i for i, k in enumerate(kinds_list) if k == kind]
            if not index:
                continue
            if kind == CAI:
                # One direct call per buffer: nothing to pack them with.
                buckets = [self._single_bucket(i, sig[i][:2]) for i in index]
            else:
                sub = plan_buckets([sig[i][:2] for i in index], pack_bytes)
                buckets = [
                    Bucket(b.dtype, b.count, tuple(index[m] for m in b.members), b.offsets, b.sizes, b.shapes)
                    for b in sub
                ]
            for b in buckets:
                if kind == HOST:
                    # The first enabled backend (shared memory, MPI), for one array too:
                    # both take one contiguous array unpacked (allreduce_array).
                    backend = next(x for x in self._host_backends if x.enabled(b.nbytes, b.dtype, op))
                    xp = np
                else:
                    backend = self._device()
                    xp = sys.modules.get("cupy") if kind == CUPY else None
                steps.append(Step(b, kind, backend, xp))
        if len(self._plans) >= _PLAN_CACHE_MAX:
            self._plans.clear()
        self._plans[cache_key] = steps
        return steps

    @staticmethod
    def _single_bucket(i: int, entry: tuple) -> Bucket:
        shape, code = entry
        size = int(np.prod(shape, dtype=np.int64))
        return Bucket(np.dtype(code), size, (i,), (0,), (size,), (tuple(shape),))

    def allreduce(
        self,
        arrays: Sequence[Any],
        op: Any,
        options: CommunicationOptions | None = None,
        *,
        inplace: bool = False,
    ) -> list:
        """Reduce each array element-wise across ranks; every rank gets the results.

        ``op`` is ``"sum"``, ``"min"`` or ``"max"``. With ``inplace=True`` the
        input arrays are overwritten and returned; otherwise the inputs are
        untouched and the results are new arrays, never overwritten later.
        """
        timeout, pack_bytes = self._settings(options)
        arrays = list(arrays)
        opname, error = _op_param(op)
        sig, kinds, sig_error = self._signature(arrays, inplace)
        error = error or sig_error
        key = ("allreduce", (("op", opname),), sig)
        if error is not None:
            self._agree_or_raise(key, error, timeout)
        h = fingerprint(key)
        traced = timeline.enabled()
        guard = self._guard
        # h, the call's fingerprint, stands for (op, sig): a cheap dictionary key.
        plan_key = (h, kinds, pack_bytes, inplace)
        steps = self._plans.get(plan_key)
        if steps and guard is not None and not traced and overlaps_check(steps[0]):
            if guard.transport == "shm" and folds_sync(steps[0]):
                return self._allreduce_folded(guard, key, timeout, h, pack_bytes, steps, arrays, opname, inplace)
            return self._allreduce_overlapped(guard, key, timeout, h, pack_bytes, steps, arrays, opname, inplace)
        t0 = timeline.now_us() if traced else 0.0
        aux = self._check(key, timeout, check_aux(pack_bytes), h)
        if aux is not None:
            require_same_pack(aux)
        if steps is None:
            steps = self._plan(plan_key, sig, kinds, opname, pack_bytes)
        if traced:
            try:
                return self._run_steps(steps, arrays, opname, inplace)
            finally:
                nbytes = sum(s.bucket.nbytes for s in steps)
                self._record("allreduce", t0, nbytes, op=opname, arrays=len(arrays), buckets=len(steps))
        return self._run_steps(steps, arrays, opname, inplace)

    def _allreduce_overlapped(
        self, guard: AgreementGuard, key: CallKey, timeout: float, h: int, pack_bytes: int, steps: list[Step],
        arrays: list, opname: str, inplace: bool,
    ) -> list:
        """A call planned before (so staged before: no window to grow): the check's wait for the other
        ranks overlaps this rank's staging of its first bucket (see _allreduce_steps)."""
        guard.start(key, timeout, check_aux(pack_bytes), h)
        try:
            results = self._run_steps(steps, arrays, opname, inplace, self._finish_check)
        except BaseException:
            if guard.started:  # failed before the check finished: finish it, never leave it open
                guard.finish()
            raise
        if guard.started:  # a backend that took ready and never called it: a bug, caught on every rank
            guard.finish()
            raise RuntimeError(f"all-reduce backend {type(steps[0].backend).__name__} took `ready` and never "
                               "called it: the agreement check finished only after the data moved")
        return results

    def _allreduce_folded(
        self, guard: AgreementGuard, key: CallKey, timeout: float, h: int, pack_bytes: int, steps: list[Step], arrays: list,
        opname: str, inplace: bool,
    ) -> list:
        """A call planned before, on a communicator whose check goes through shared memory, to a
        backend that folds (see folds_sync): the whole check runs once this rank has staged its
        first bucket, and when every rank did so, it is the backend's first node synchronisation."""
        guard.require_usable()  # before staging: peers may still read this rank's last data
        checked = False

        def ready(staged: bool = True) -> bool:
            nonlocal checked
            checked = True
            return require_same_pack(guard.check(key, timeout, check_aux(pack_bytes, staged_first=staged), h))

        try:
            results = self._run_steps(steps, arrays, opname, inplace, ready)
        except Exception as exc:
            if checked:
                raise
            # Failed while staging, before the check: the peers must not enter the transfer without us.
            self._agree_or_raise(key, exc, timeout)
            raise
        if not checked:  # a backend that took ready and never called it: a bug, caught on every rank
            self._agree_or_raise(key, RuntimeError(
                f"all-reduce backend {type(steps[0].backend).__name__} took `ready` and never called it"), timeout)
        return results

    def _run_steps(
        self, steps: list[Step], arrays: list, opname: str, inplace: bool, ready: Callable[[], Any] | None = None
    ) -> list:
        if self.size == 1:
            return arrays if inplace else [a.copy() for a in arrays]
        return run_steps(steps, arrays, opname, inplace, self._scratch, ready)

    def _finish_check(self, staged: bool = True) -> None:
        """Finish the started agreement check of an all-reduce (its ``ready``)."""
        assert self._guard is not None
        require_same_pack(self._guard.finish())

    # ------------------------------------------------------------------ all-gather

    @_traced("allgather")
    def allgather(self, array: Any, axis: int = 0, options: CommunicationOptions | None = None) -> Any:
        """Concatenate every rank's ``array`` along ``axis`` (rank order).

        Sizes along ``axis`` may differ between ranks; the other dimensions
        and the dtype must agree.
        """
        timeout, _ = self._settings(options)
        error = None
        shape: tuple = ()
        code = ""
        try:
            cupy_array = is_cupy_array(array)
            if not cupy_array:
                if is_device_buffer(array):
                    raise TypeError(f"allgather: {type(array).__name__} buffers are not supported; use CuPy or NumPy")
                array = np.asarray(array)
            if array.ndim == 0:
                raise ValueError("allgather needs an array with at least one dimension; got a scalar")
            if not isinstance(axis, (int, np.integer)) or not -array.ndim <= axis < array.ndim:
                raise ValueError(f"allgather: axis {axis!r} is out of range for an array of rank {array.ndim}")
            axis = int(axis) % array.ndim
            shape = tuple(array.shape)
            code = array.dtype.str
            mpi_datatype(array.dtype)
        except (TypeError, ValueError) as exc:
            error = exc
        other = tuple(-1 if d == axis else n for d, n in enumerate(shape))
        key = ("allgather", (("axis", axis),), ((other, code),))
        counts = self._agree_or_raise(key, error, timeout, aux=shape[axis] if shape else 0)
        if self.size == 1:
            return array.copy()
        counts = [int(c) for c in counts]
        xp = sys.modules["cupy"] if cupy_array else np
        if cupy_array and not self.cuda_aware:
            return xp.asarray(self._allgatherv(array.get(), axis, counts, np))
        return self._allgatherv(array, axis, counts, xp)

    def _allgatherv(self, array: Any, axis: int, counts: list[int], xp: Any) -> Any:
        moved = xp.ascontiguousarray(xp.moveaxis(array, axis, 0)) if axis else xp.ascontiguousarray(array)
        rest = moved.shape[1:]
        row = int(np.prod(rest, dtype=np.int64))
        out = xp.empty((sum(counts),) + rest, dtype=moved.dtype)
        sizes = [c * row for c in counts]
        displs = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64).tolist()
        if xp is not np:
            synchronize_producer(moved)  # the transposing copy ran on the stream
        self.comm.Allgatherv(moved, [out, sizes, displs, mpi_datatype(moved.dtype)])
        return xp.ascontiguousarray(xp.moveaxis(out, 0, axis)) if axis else out

    # ------------------------------------------------------------------ broadcast

    @_traced("broadcast")
    def broadcast(self, arrays: Sequence[Any], root: int = 0, options: CommunicationOptions | None = None) -> list:
        """Every rank gets ``root``'s arrays (new arrays; inputs untouched).

        Every rank passes arrays of the same shapes and dtypes (their values
        are ignored except on ``root``).
        """
        timeout, pack_bytes = self._settings(options)
        arrays = list(arrays)
        error = None
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            error = ValueError(f"broadcast: root {root!r} is not a rank of this {self.size}-rank communicator")
            sig, kinds = (), None
        else:
            sig, kinds, error = self._signature(arrays, inplace=False)
            if error is None and kinds is not None and CAI in kinds:
                error = TypeError("broadcast: buffers with only __cuda_array_interface__ are not supported")
        key = ("broadcast", (("root", int(root) if error is None else repr(root)),), sig)
        aux = self._agree_or_raise(key, error, timeout, check_aux(pack_bytes))
        if aux is not None:  # buckets cut at different sizes: different Bcast calls
            require_same_pack(aux, "broadcast")
        for entry in sig:
            mpi_datatype(np.dtype(entry[1]))
        if self.size == 1:
            return [a.copy() for a in arrays]
        kinds_list = kinds if kinds is not None else (HOST,) * len(sig)
        results: list = [None] * len(arrays)
        host_index = [i for i, k in enumerate(kinds_list) if k == HOST]
        device_index = [i for i, k in enumerate(kinds_list) if k == CUPY]
        if host_index:
            got = self._bcast_list([arrays[i] for i in host_index], root, pack_bytes, np)
            for i, v in zip(host_index, got):
                results[i] = v
        if device_index:
            cupy = sys.modules["cupy"]
            items = [arrays[i] for i in device_index]
            if self.cuda_aware:
                got = self._bcast_list(items, root, pack_bytes, cupy)
            else:
                got = [cupy.asarray(h) for h in self._bcast_list([a.get() for a in items], root, pack_bytes, np)]
            for i, v in zip(device_index, got):
                results[i] = v
        return results

    def _bcast_list(self, arrays: list, root: int, pack_bytes: int, xp: Any) -> list:
        out: list = [None] * len(arrays)
        for b in plan_buckets([(a.shape, a.dtype) for a in arrays], pack_bytes):
            block = xp.empty(b.count, dtype=b.dtype)
            if self.rank == root:
                pack(arrays, b, block, xp)
            if xp is not np:
                synchronize_producer(block)
            self.comm.Bcast(block, root=root)
            for i, o, n, s in zip(b.members, b.offsets, b.sizes, b.shapes):
                out[i] = block[o : o + n].reshape(s)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s picklable object on every rank."""
        error = None
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            error = ValueError(f"broadcast_object: root {root!r} is not a rank of this {self.size}-rank communicator")
        self._agree_or_raise(("broadcast_object", (("root", repr(root)),), ()), error, self._timeout)
        if self.size == 1:
            return obj
        return self.comm.bcast(obj, root=int(root))

    def allgather_object(self, obj: Any, options: CommunicationOptions | None = None) -> list:
        """Every rank's picklable object, in rank order."""
        timeout, _ = self._settings(options)
        self._check(("allgather_object", (), ()), timeout)
        if self.size == 1:
            return [obj]
        return self.comm.allgather(obj)

    # ------------------------------------------------------------------ agreement

    def step_agreement(self, code: int, options: CommunicationOptions | None = None) -> np.ndarray:
        """Every rank's ``code`` (an int64 array, index = rank), with the timeout.

        For input pipelines to agree on end-of-data or errors at each step.
        """
        timeout, _ = self._settings(options)
        error = None
        if isinstance(code, bool) or not isinstance(code, (int, np.integer)) or not -(2**63) <= int(code) < 2**63:
            error = TypeError(f"step_agreement: code must be an int64 integer, got {code!r}")
        codes = self._agree_or_raise(("step_agreement", (), ()), error, timeout, aux=0 if error else int(code))
        if codes is None:
            return np.array([int(code)], dtype=np.int64)
        return codes.copy()

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Wait until every rank is here (with the timeout)."""
        timeout, _ = self._settings(options)
        self._check(("barrier", (), ()), timeout)

    def close(self) -> None:
        """Release buffers, backends and communicators (collective; idempotent)."""
        if self._closed:
            return
        if self._guard is not None and self._guard.broken is None:
            try:
                # Agree on closing too: a rank still inside another collective
                # gets a clear mismatch instead of a hang in collective clean-up.
                self._guard.check(("close", (), ()), self._timeout)
            except CollectiveError:
                self._closed = True
                self._guard.broken = self._guard.broken or "closed after a failed close()"
                self._guard.close()
                raise
        self._closed = True
        self._plans.clear()
        self._finalizer.detach()
        self._resources.release()  # local clean-up only if the guard broke (peers may be gone)

    def __enter__(self) -> "RankCommunicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankCommunicator(rank={self.rank}, size={self.size}, options={self.options!r})"
