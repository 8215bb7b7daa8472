"""RankCommunicator: the cross-rank collectives under the strategies.

Every collective takes one path: plan (:mod:`~mpistrat.comm.plan`) -> agreement
(:mod:`mpistrat.comm.agreement`) -> execute (:mod:`~mpistrat.comm.execute`, :mod:`mpistrat.comm.transport`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
from mpi4py import MPI

from mpistrat import config, ops, timeline
from mpistrat.comm.agreement.call import CHECKED, FOLD, CallAgreement, FoldedCheck, check_aux, choose_mode, require_same_pack
from mpistrat.comm.agreement.guard import AgreementGuard
from mpistrat.comm.agreement.lane import compiled_lane, compiled_step
from mpistrat.comm.agreement.signatures import CallKey, fingerprint
from mpistrat.comm.deterministic import replicas_error, reproducible_sum
from mpistrat.comm.errors import CollectiveError, allgather_checked
from mpistrat.comm.execute import run_steps
from mpistrat.comm.fusion import pack, plan_buckets
from mpistrat.comm.options import CommunicationOptions
from mpistrat.comm.pending import OrderedWorker, Pending, run_now
from mpistrat.comm.plan import Plan, Planner
from mpistrat.comm.runtime.lifetime import Resources, release_dropped, track
from mpistrat.comm.runtime.topology import topology
from mpistrat.comm.signature import CAI, CUPY, HOST, allreduce_signature
from mpistrat.comm.transport import table
from mpistrat.comm.transport.base import NO_AGREEMENT, RepeatTransport, Transport, TransportContext
from mpistrat.comm.transport.buffers import GrowableBuffers
from mpistrat.comm.transport.cuda import DeviceMpiTransport, mpi_cuda_support
from mpistrat.comm.transport.mpi import MpiTransport, mpi_datatype
from mpistrat.devices import device_of, device_scope, is_cupy_array, is_device_buffer, synchronize_producer

__all__ = ["RankCommunicator", "normalize_op"]


normalize_op = ops.wire_op  # the name earlier releases exported from here


def _op_param(op: Any) -> tuple[str, Exception | None]:
    """The wire op of ``op``, or its repr and the error (carried by the agreement check)."""
    try:
        return ops.wire_op(op), None
    except ValueError as exc:
        return repr(op), exc


def _op_params(opname: str, divisor: int | None, structure: str | None = None, phase: str | None = None) -> tuple:
    """The agreement key's parameters of an all-reduce: its logical op (MEAN: the sum and its divisor), the
    nesting of its arrays when the caller gave one, and its phase of a deterministic all-reduce (so ranks
    asking ``deterministic=True`` and ranks not asking it raise a mismatch)."""
    params: tuple = (("op", opname),) if divisor is None else (("op", "mean"), ("divisor", divisor))
    if structure is not None:
        params += (("structure", structure),)
    return params if phase is None else params + (("deterministic", phase),)


def _divisor_error(opname: str, divisor: Any) -> Exception | None:
    """Why ``divisor`` is not a MEAN's divisor of a sum, or None."""
    if divisor is None:
        return None
    if isinstance(divisor, bool) or not isinstance(divisor, (int, np.integer)) or divisor < 1:
        return ValueError(f"allreduce: divisor must be a positive int (MEAN's replica count), got {divisor!r}")
    if opname != "sum":
        return ValueError(f"allreduce: divisor is MEAN's, a sum divided afterwards; op must be 'sum', got {opname!r}")
    return None


@functools.cache
def _threads_allowed() -> bool:
    """Whether a worker thread may call MPI beside the caller's (``MPI_THREAD_MULTIPLE``)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _on_device(device: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with CuPy's current device (thread-local) set to ``device``."""
    with device_scope(device):
        return fn(*args, **kwargs)


def _traced(name: str) -> Callable:
    """Record a collective other than all-reduce in the timeline (bytes and count of what it returns)."""
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


def _plain_array(a: Any) -> bool:
    """Whether ``a`` is exactly a NumPy or a CuPy ndarray (no subclass): a call of one such array may take
    the lean path of a repeated call (its plan filed by op, divisor, shape and dtype)."""
    kind = type(a)
    if kind is np.ndarray:
        return True
    cupy = sys.modules.get("cupy")
    return cupy is not None and kind is cupy.ndarray


class RankCommunicator:
    """Cross-rank collectives over a duplicate of ``comm`` (collective to create).

    Every collective takes one path: plan (the call's signature and, for an
    all-reduce, its buckets, each with a transport: plan.py) -> agreement (do
    all ranks make the same call? agreement/) -> execute (the transports move
    the data: execute.py, transport/). The agreement check honours
    ``options.timeout_seconds`` and carries per-rank sizes or codes where a call
    needs them; a local error travels in it, so every rank raises. A one-rank
    communicator makes no MPI call and keeps the same semantics. A communicator
    is used by one thread at a time: its worker while asynchronous calls are
    pending (:meth:`allreduce_async`), else the caller.

    Args:
      comm: the ranks taking part (default ``MPI.COMM_WORLD``); duplicated.
      options: default :class:`CommunicationOptions`; per-call options
        override them (:meth:`CommunicationOptions.merge`).
    """

    def __init__(self, comm: MPI.Comm | None = None, options: CommunicationOptions | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        timeline.start_from_environment()  # MPISTRAT_TIMELINE: recording starts with the first communicator
        if options is None:
            options = CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a CommunicationOptions, got {type(options).__name__}")
        self.options = options
        release_dropped(comm)  # what earlier communicators on these ranks left behind
        error = settings = None
        try:  # a malformed setting on one rank raises on every rank, before anything else collective
            settings = config.settings()
            self._timeout = options.timeout(settings)
        except ValueError as exc:
            error = exc
        allgather_checked(comm, None, error, "mpistrat settings")
        assert settings is not None
        self.settings = settings
        self._pack = options.pack_bytes()
        self.comm: MPI.Comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.topology = self._guard = self._context = None
        try:  # every error here is raised on every rank alike (settings were agreed): release, then raise
            if self.size > 1:
                pretend = settings.pretend_nodes
                self.topology = topology(self.comm, None if pretend is None else min(pretend, self.size))
                self._guard = AgreementGuard(self.comm, self.topology, settings)
                self._context = TransportContext(self.comm, options, settings, self.topology, self._timeout)
            # One rank moves nothing; its list still ends with the fallback, as every list does.
            self.transports: list[Transport] = (
                table.select(self._context, table.HOST) if self._context else [MpiTransport(self.comm)])
        except BaseException:
            if self._guard is not None:
                self._guard.close()
            if self.topology is not None:
                self.topology.free()
            self.comm.Free()
            raise
        self._agreement = CallAgreement(self._guard)
        self._device_transports: list[Transport] | None = None
        # Dropped without close(): released at the next collective point (lifetime.py).
        self._resources = Resources(self.comm, self._guard, self.transports, self.topology)
        self._finalizer = track(self, self._resources)
        self._planner = Planner(self.transports, self._device)
        # In-place buckets are reduced into this, then copied into the arrays (execute.py).
        self._scratch = GrowableBuffers(lambda n, dt: np.empty(n, dtype=dt))
        self._worker: OrderedWorker | None = None  # the thread of allreduce_async's calls (at the first)
        self._closed = False

    # ------------------------------------------------------------------ helpers

    def _settings(self, options: CommunicationOptions | None) -> tuple[float, int]:
        if options is None:
            return self._timeout, self._pack
        merged = self.options.merge(options)
        return merged.timeout(self.settings), merged.pack_bytes()

    def _agree(self, key: CallKey, timeout: float, aux: int = 0, error: Exception | None = None,
               h: int | None = None) -> np.ndarray | None:
        """The call's agreement check (a local ``error`` raises on every rank; ``h``: ``fingerprint(key)``).

        Every collective but a repeated all-reduce passes here first: collectives started asynchronously
        before it finish first (:class:`~mpistrat.comm.pending.OrderedWorker`)."""
        if self._worker is not None:
            self._worker.drain()
        if self._closed and self._guard is None:
            raise RuntimeError("RankCommunicator used after close()")
        return self._agreement.agree(key, timeout, aux, error, h)

    def fail_collective(self, name: str, error: Exception, options: CommunicationOptions | None = None) -> NoReturn:
        """Take part in the collective ``name`` the peers are calling with a local ``error`` instead: every rank
        raises. Where every rank failed with an error of one type, each raises its own; where some did not
        fail, every rank raises a mismatch naming the errors.

        For a caller that failed before its collective (converting or reducing its own input):
        raising alone would leave the peers waiting, or pair this rank's next collective with
        theirs and combine the wrong data.
        """
        timeout = self._timeout if options is None else self._settings(options)[0]
        self._agree((name, (), ()), timeout, error=error)
        raise error  # one rank: the agreement had no one to tell

    def _record(self, name: str, t0: float, nbytes: int, **args: Any) -> None:
        """A ``collective`` timeline event from ``t0`` to now (wait = the check)."""
        t2 = timeline.now_us()
        c0, c1 = self._agreement.span
        if c0 < t0:
            c0 = c1 = t0
        timeline.record(name, "collective", t0, t2 - t0, bytes=nbytes, wait_us=c1 - c0,
                        transfer_us=t2 - c1, ranks=self.size, **args)

    @functools.cached_property
    def cuda_aware(self) -> bool:
        """Whether CuPy buffers go to MPI directly (else host-staged), from this communicator's settings."""
        return bool(mpi_cuda_support(self.settings))

    @property
    def device_transports(self) -> list[Transport] | None:
        """The transports of device buckets in the order they are tried (None before the first device bucket)."""
        return None if self._device_transports is None else list(self._device_transports)

    def _device(self) -> list[Transport]:
        """The device transports, made at the first device bucket."""
        if self._device_transports is None:
            self._device_transports = self._resources.device = (
                table.select(self._context, table.DEVICE) if self._context else [DeviceMpiTransport(self.comm, False)])
        return self._device_transports

    def _device_mpi_missing(self) -> bool:
        return self.size > 1 and not self.cuda_aware

    # ------------------------------------------------------------------ all-reduce

    def allreduce(
        self,
        arrays: Sequence[Any],
        op: Any,
        options: CommunicationOptions | None = None,
        *,
        inplace: bool = False,
        divisor: int | None = None,
        structure: str | None = None,
    ) -> list:
        """Reduce each array element-wise across ranks; every rank gets the results.

        ``op`` is ``"sum"``, ``"min"`` or ``"max"``. With ``inplace=True`` the
        input arrays are overwritten and returned; otherwise the inputs are
        untouched and the results are new arrays, never overwritten later.
        ``divisor``: the caller's MEAN, a sum (``op`` ``"sum"``) the caller divides
        by ``divisor`` afterwards. The agreement check covers the logical op, so
        ranks asking MEAN and SUM, or MEAN over different counts, raise a mismatch
        on every rank. ``structure``: the caller's nesting of the arrays (``nest.structure_signature``,
        dict keys included), checked with the rest, so ranks reducing ``{"a": x}`` and ``{"b": y}`` raise.
        """
        if (type(arrays) is list and arrays and options is None and not inplace and type(op) is str
                and (divisor is None or type(divisor) is int) and structure is None):
            # A call repeated with the communicator's options: its plan, key and fingerprint are filed by
            # what the call is made of (one NumPy or CuPy array; a list of NumPy arrays, matched in C), so
            # nothing is built or hashed but that.
            if len(arrays) > 1:
                results = self.allreduce_repeat_list(arrays, op, divisor)
                if results is not None:
                    return results
            elif _plain_array(arrays[0]):
                result = self.allreduce_repeat(arrays[0], op, divisor)
                if result is not None:
                    return [result]
        if self.options.deterministic or getattr(options, "deterministic", False):
            return self._deterministic(arrays, op, options, inplace, divisor, structure)
        return self._allreduce(arrays, op, options, inplace, divisor, structure)

    def allreduce_repeat(self, a: Any, op: str, divisor: int | None = None) -> Any:
        """``allreduce([a], op, divisor=divisor)[0]`` when it repeats an earlier such call of a NumPy or CuPy
        array (``op`` spelled as then), else None: the caller then calls :meth:`allreduce`.

        The steady state of a training step's reductions: the plan, key, fingerprint and hook were made
        with the first call. Where the check folds into the transport's synchronisation (``FOLD``: one
        node, host arrays up to 4 MiB) the plan's :class:`FoldedCheck` is the hook, and the call is the
        pool's result, the transport and the check, each called once (``_execute`` and ``run_steps`` for
        that case). The check still runs on every call, before any data is combined. Calls started
        asynchronously before it finish first, as before any collective; the worker's own calls keep off
        the compiled lane, whose copies and sums hold the GIL the caller computes with meanwhile."""
        worker = self._worker
        if worker is not None:
            worker.drain()  # returns at once in the worker itself
        plan = self._planner.singles.get((op, divisor, a.shape, a.dtype, type(a)))
        if plan is None or self.size == 1 or timeline.enabled():
            return None
        folded = plan.folded
        if folded is None:
            return self._execute(plan, [a], False, plan.repeat_mode, self._timeout, self._pack)[0]
        guard = self._guard
        if guard.broken is not None:  # before staging: peers may still read this rank's last data
            guard.require_usable()
        step = plan.steps[0]
        prepared = plan.prepared
        folded.pending = True
        try:
            views = step.pool.get()[1]
            dst = views[0]
            src = a if a.flags.c_contiguous else np.ascontiguousarray(a)
            lane = plan.lane if self._kernels_here() else None
            if lane is not None and lane(src, dst):
                return step.pool.results(views)[0]
            if prepared is not None:
                step.transport.allreduce_prepared(prepared, src, dst, folded.staged)
            else:
                step.transport.allreduce_array(src, dst, plan.op, folded)
        except BaseException as exc:
            folded.fail(exc)
        if folded.pending:
            folded.unstaged(step.transport)
        return step.pool.results(views)[0]

    def allreduce_repeat_list(self, arrays: list, op: str, divisor: int | None = None) -> list | None:
        """``allreduce(arrays, op, divisor=divisor)`` when ``arrays``, a list of NumPy arrays, repeats the latest
        such call of as many arrays (op spelled as then), matched by its signature in one C loop
        (``Planner.file_list``), else None: the caller then calls :meth:`allreduce`. The check runs as for
        any repeated call of the plan."""
        if self._worker is not None:  # calls started asynchronously before this one run first
            self._worker.drain()
        filed = self._planner.lists.get((op, divisor, len(arrays)))
        if filed is None or timeline.enabled():
            return None
        arrays = list(arrays)  # what is matched is what is reduced, whatever happens to the caller's list
        if not filed[0].matches(arrays):
            return None
        plan = filed[1]
        folded = plan.folded
        if folded is None:
            return self._execute(plan, arrays, False, plan.repeat_mode, self._timeout, self._pack)
        # The check folds into the first array's transport, as for a repeated call of one array
        # (allreduce_repeat): the plan's FoldedCheck is the hook, and its lane the first step's.
        guard = self._guard
        if guard.broken is not None:  # before staging: peers may still read this rank's last data
            guard.require_usable()
        folded.pending = True
        try:
            results = run_steps(plan.steps, arrays, plan.op, False, folded, self._scratch, self._kernels_here(),
                                plan.lane)
        except BaseException as exc:
            folded.fail(exc)
        if folded.pending:
            folded.unstaged(plan.steps[0].transport)
        return results

    def _deterministic(self, arrays: Sequence[Any], op: Any, options: CommunicationOptions | None, inplace: bool,
                       divisor: int | None, structure: str | None) -> list:
        """:meth:`allreduce` with ``deterministic=True``: sums by :meth:`deterministic_sum`; min and max as
        always (every order gives the same bits), with the flag in the agreement key."""
        opname, error = _op_param(op)
        if error is None and opname != "sum":
            return self._allreduce(arrays, op, options, inplace, divisor, structure, phase="minmax")
        arrays = list(arrays)
        results = self.deterministic_sum([arrays], options, divisor=divisor, structure=structure, op=op)
        if not inplace:
            return results
        for a, r in zip(arrays, results):
            a[...] = r
        return arrays

    def deterministic_sum(self, per_replica: Sequence[Sequence[Any]], options: CommunicationOptions | None = None,
                          *, divisor: int | None = None, structure: str | None = None, op: Any = "sum") -> list:
        """The sum over every replica of every rank of each leaf, bitwise the same for any rank count and any
        spread of the replicas over ranks and nodes (``deterministic.reproducible_sum``).

        ``per_replica[i][j]``: leaf j of this rank's local replica i (NumPy or CuPy arrays; every rank the
        same number of replicas). Collective: every rank calls it (or :meth:`allreduce` with
        ``deterministic=True``) with leaves of the same shapes and dtypes; a rank that does not raises a
        mismatch on every rank. ``divisor``: MEAN's, for the agreement check (the caller divides). New arrays.
        """
        timeout = self._timeout if options is None else self._settings(options)[0]
        opname, error = _op_param(op)
        first = list(per_replica[0]) if per_replica else []
        sig, kinds, sig_error = allreduce_signature(first, False, self._device_mpi_missing)
        error = error or sig_error or _divisor_error(opname, divisor)
        if error is None and first:
            error = replicas_error(per_replica)
        if error is None and opname != "sum":
            error = ValueError(f"deterministic_sum: op must be 'sum', got {opname!r}")
        error = error or self._planner.invalid(sig, opname)
        if error is None and kinds is not None and CAI in kinds:
            error = TypeError("deterministic all-reduce: buffers with only __cuda_array_interface__ are not "
                              "supported; pass CuPy or NumPy arrays")
        if error is not None:
            self._agree(("allreduce", _op_params(opname, None, structure, "sum"), sig), timeout, error=error)
            raise error  # one rank: the agreement had no one to tell
        local = len(per_replica)
        if not first:  # nothing to reduce: still checked, so a rank reducing arrays meets a mismatch, not a wait
            self._allreduce([], "sum", options, True, divisor, structure, phase=f"exponents x{local}")
            return []
        n = local * self.size  # the scheme's bits depend on n: the key carries the local count (equal on all)

        def reduce(arrays: list, wire: str, phase: str) -> list:  # the arrays are reproducible_sum's own
            return self._allreduce(arrays, wire, options, True, divisor if wire == "sum" else None, structure,
                                   phase=f"{phase} x{local}")

        return reproducible_sum(per_replica, n, reduce)

    def _allreduce(self, arrays: Sequence[Any], op: Any, options: CommunicationOptions | None, inplace: bool,
                   divisor: int | None, structure: str | None = None, phase: str | None = None) -> list:
        """:meth:`allreduce`: plan (signature, validation, cached steps), agreement, execute. ``phase``: the
        step of a deterministic all-reduce this call is (part of its key)."""
        if self._worker is not None:  # calls started asynchronously before this one run first
            self._worker.drain()
        traced = timeline.enabled()
        t0 = timeline.now_us() if traced else 0.0
        timeout, pack_bytes = (self._timeout, self._pack) if options is None else self._settings(options)
        single = (arrays[0] if type(arrays) is list and len(arrays) == 1 and options is None and not inplace
                  and phase is None else None)
        arrays = list(arrays)
        # Plan: the signature and validation, then the steps, cached by everything the key is made of.
        opname, error = _op_param(op)
        sig, kinds, sig_error = allreduce_signature(arrays, inplace, self._device_mpi_missing)
        if divisor is not None:
            error = error or _divisor_error(opname, divisor)
            divisor = int(divisor) if error is None else None  # one spelling in the key on every rank
        error = error or sig_error
        plan = None
        if error is None:
            plan_key = (opname, divisor, sig, kinds, pack_bytes, inplace, structure, phase)
            plan = self._planner.cached(plan_key)
        if plan is not None:  # a repeated call: its key and fingerprint were made with its plan
            key, h, mode = plan.key, plan.h, plan.repeat_mode
        else:
            key = ("allreduce", _op_params(opname, divisor, structure, phase), sig)
            error = error or self._planner.invalid(sig, opname)
            if error is not None:
                self._agree(key, timeout, error=error)  # raises on every rank
            # Not planned before: every rank checks first, then plans. Planning may make transports
            # and a transport's first bucket of a size may grow shared memory (both collective), so
            # a plan is made, and cached, only for a call every rank agreed on.
            h = fingerprint(key)
            aux = self._agree(key, timeout, check_aux(pack_bytes), h=h)
            if aux is not None:
                require_same_pack(aux)
            plan = self._planner.plan(plan_key, sig, kinds, opname, pack_bytes)
            plan.key, plan.h = key, h
            for step in plan.steps:  # a result of its own: in place, the source is the result (the Python path)
                if step.direct and step.kind == HOST and not inplace:
                    step.lane = compiled_step(self.settings.compiled_lane, self._guard, step.transport,
                                              step.bucket.nbytes, step.bucket.dtype, plan.op)
            first = plan.steps[0] if plan.steps else None
            if first is not None:
                plan.repeat_mode = choose_mode(self._guard, first.kind == HOST, first.bucket.nbytes,
                                               first.transport.folds_agreement)
                if plan.repeat_mode == FOLD and first.direct and not inplace:
                    plan.folded = FoldedCheck(self._agreement, key, h, self._timeout, self._pack)
                    a = arrays[first.members[0]]
                    if isinstance(first.transport, RepeatTransport):
                        plan.prepared = first.transport.prepare_array(a.shape, a.dtype, plan.op)
                    plan.lane = compiled_lane(self.settings.compiled_lane, plan.folded, self._guard,
                                              first.transport, plan.prepared, a.nbytes, a.dtype, plan.op)
            mode = CHECKED
        if _plain_array(single) and type(op) is str and structure is None:
            self._planner.file_single(op, divisor, single, plan)
        elif (kinds is None and len(arrays) > 1 and self.size > 1 and options is None and not inplace
              and phase is None and type(op) is str and structure is None):  # every item exactly an ndarray
            self._planner.file_list(op, divisor, arrays, plan)
        if self.size == 1:
            if mode != CHECKED:
                self._agree(key, timeout)  # only checks that the communicator is open
            results = arrays if inplace else [a.copy() for a in arrays]
        else:
            results = self._execute(plan, arrays, inplace, mode, timeout, pack_bytes)
        if traced:
            self._record("allreduce", t0, plan.nbytes, op=opname, arrays=len(arrays), buckets=len(plan.steps))
        return results

    def _kernels_here(self) -> bool:
        """Whether this thread's calls may take the compiled kernels (agreement/lane.py): not the worker's, whose
        copies and sums would hold the GIL the caller computes with meanwhile."""
        worker = self._worker
        return worker is None or not worker.running_here()

    def _execute(self, plan: Plan, arrays: list, inplace: bool, mode: int, timeout: float, pack_bytes: int) -> list:
        """Agreement, then execute (two ranks or more): the first bucket's transport completes the check
        (agreement/call.py)."""
        agreement = self._agreement
        hook = agreement.begin(plan.key, plan.h, timeout, pack_bytes, mode)
        try:
            results = run_steps(plan.steps, arrays, plan.op, inplace, hook, self._scratch, self._kernels_here())
        except BaseException as exc:
            agreement.fail(exc)
            raise
        if hook is not NO_AGREEMENT:
            agreement.end(plan.steps[0].transport)
        return results

    def allreduce_async(
        self,
        arrays: Sequence[Any],
        op: Any,
        options: CommunicationOptions | None = None,
        **keywords: Any,
    ) -> Pending:
        """Start ``allreduce(arrays, op, options, **keywords)`` and return at once (Horovod's ``allreduce_async``).

        The handle's ``result()`` waits and returns what :meth:`allreduce` returns
        for the same arguments, or raises its error (a mismatch included, on every
        rank); ``done()`` never blocks. Collectives run in the order they were
        started: this one after those started before it, and any later
        collective of this communicator waits until it has finished. The call
        runs on the communicator's worker thread while the caller goes on; it
        reads the arrays (and writes them, with ``inplace=True``) until the handle
        is done, so leave them alone until then. With one rank, or where MPI runs
        below ``MPI_THREAD_MULTIPLE``, it runs in this call.
        """
        arrays = list(arrays)
        if self.size == 1 or not _threads_allowed():
            return run_now(self.allreduce, arrays, op, options, **keywords)
        fn: Callable[..., Any] = self.allreduce
        device = None
        for a in arrays:
            if type(a) is not np.ndarray and is_device_buffer(a):
                synchronize_producer(a)  # the worker reads what this thread's stream produced
                if device is None and is_cupy_array(a):
                    device = device_of(a)
        if device is not None:
            fn = functools.partial(_on_device, device, fn)
        worker = self._worker
        if worker is None:
            worker = self._worker = OrderedWorker(f"mpistrat-comm-{self._guard.index}")
            weakref.finalize(self, worker.stop)  # a dropped communicator's thread ends too
        return worker.submit(fn, arrays, op, options, **keywords)

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
        counts = self._agree(key, timeout, shape[axis] if shape else 0, error)
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
            sig, kinds, error = allreduce_signature(arrays, False, self._device_mpi_missing)
            if error is None and kinds is not None and CAI in kinds:
                error = TypeError("broadcast: buffers with only __cuda_array_interface__ are not supported")
        key = ("broadcast", (("root", int(root) if error is None else repr(root)),), sig)
        aux = self._agree(key, timeout, check_aux(pack_bytes), error)
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
        self._agree(("broadcast_object", (("root", repr(root)),), ()), self._timeout, error=error)
        if self.size == 1:
            return obj
        return self.comm.bcast(obj, root=int(root))

    def allgather_object(self, obj: Any, options: CommunicationOptions | None = None) -> list:
        """Every rank's picklable object, in rank order."""
        timeout, _ = self._settings(options)
        self._agree(("allgather_object", (), ()), timeout)
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
        codes = self._agree(("step_agreement", (), ()), timeout, 0 if error else int(code), error)
        if codes is None:
            return np.array([int(code)], dtype=np.int64)
        return codes.copy()

    def barrier(self, options: CommunicationOptions | None = None) -> None:
        """Wait until every rank is here (with the timeout)."""
        timeout, _ = self._settings(options)
        self._agree(("barrier", (), ()), timeout)

    def close(self) -> None:
        """Release buffers, transports and communicators (collective; idempotent)."""
        if self._closed:
            return
        if self._worker is not None:  # what was started asynchronously finishes first
            self._worker.stop()
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
        self._planner.clear()
        self._finalizer.detach()
        self._resources.release()  # local clean-up only if the guard broke (peers may be gone)

    def __enter__(self) -> "RankCommunicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RankCommunicator(rank={self.rank}, size={self.size}, options={self.options!r})"
