"""Cross-device reduction: combine per-replica values and place the result.

Every :class:`CrossDeviceOps` subclass shares one hierarchical path (local replicas, then ranks, then
destination devices) and differs only in its two local primitives.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, NoReturn, Sequence

import numpy as np

from mpistrat import arrays, config, ops
from mpistrat import devices as dev
from mpistrat.comm import reproducible_sum  # loads no MPI
from mpistrat.distribute.in_flight import InFlightReduction
from mpistrat.distribute.values import DistributedValues, Mirrored
from mpistrat.ops import ReduceOp

__all__ = ["CrossDeviceOps", "ReductionToOneDevice", "HierarchicalCopyAllReduce", "NcclAllReduce",
           "select_cross_device_ops", "check_reducible"]

CHECK_NUMERICS_ENV = "MPISTRAT_CHECK_NUMERICS"
_NDARRAY_ONLY = {np.ndarray}
_NATIVE = arrays.NATIVE_NUMERIC
_dtype_of = operator.attrgetter("dtype")


def _as_array(value: Any) -> Any:
    """A leaf converted by ``arrays.as_arrays`` as an array: numbers become 0-d NumPy arrays."""
    return value if isinstance(value, np.ndarray) or dev.is_cupy_array(value) else np.asarray(value)


def check_reducible(op: ReduceOp, per_replica: Sequence[Sequence[Any]]) -> None:
    """Raise TypeError unless ``op`` can reduce every leaf, each of one dtype on every local replica.

    ``per_replica[i][j]`` is leaf j of local replica i (converted by ``arrays.as_arrays``). The dtype
    rule is ``ops.reduce_dtype_error``, the one the cross-rank all-reduce applies, so a reduction within
    one process fails where one across ranks would; replicas holding one leaf in different dtypes fail
    as ranks doing so do, instead of being cast to the first replica's dtype.
    """
    if not per_replica:
        return
    first = _dtypes(per_replica[0])
    for dtype in dict.fromkeys(first):  # each dtype once, in leaf order (the same error on every rank)
        reason = ops.reduce_dtype_error(dtype, op.wire)
        if reason is not None:
            raise TypeError(f"{op.name} reduction: value #{first.index(dtype)} {reason}")
    for i in range(1, len(per_replica)):
        other = _dtypes(per_replica[i])
        if other != first:
            j, (dtype, odd) = next((j, pair) for j, pair in enumerate(zip(first, other)) if pair[0] != pair[1])
            raise TypeError(f"{op.name} reduction: value #{j} has dtype {dtype} on local replica 0 and {odd} on "
                            f"local replica {i}; every replica must pass one dtype")


def _dtypes(leaves: Sequence[Any]) -> list:
    """The dtype of each leaf (numbers: NumPy's)."""
    if set(map(type, leaves)) <= _NDARRAY_ONLY:
        return list(map(_dtype_of, leaves))
    return [_as_array(leaf).dtype for leaf in leaves]


def _divide(array: Any, n: int) -> Any:
    """MEAN's division, as TF: floats keep their dtype, integers give a true (float64) quotient."""
    if n == 1:
        return array
    divisor = array.dtype.type(n) if array.dtype.kind in "fc" else n
    if dev.is_gpu(dev.device_of(array)):
        with dev.device_scope(dev.device_of(array)):
            return array / divisor
    return array / divisor


def _shared_copy(value: Any, device: str) -> Any:
    """``value`` on ``device`` for one of several replicas.

    Logical CPU devices share host memory, so each gets a read-only view of
    one buffer (no copy; an in-place write raises instead of leaking into the
    other replicas). Other devices get their own copy.
    """
    if not dev.is_gpu(device) and isinstance(value, np.ndarray):
        view = value.view()
        view.flags.writeable = False
        return view
    return dev.to_device(value, device, copy=True)


def destination_devices(destinations: Any, replica_devices: Sequence[str] | None = None) -> list[str]:
    """Canonical device strings named by ``destinations``.

    Accepts a device string, a list of them, or a distributed value or
    variable: its replicas' devices, so a value passed as its own
    destinations is all-reduced (TF's ``reduce_to``). Those are
    ``replica_devices`` when the caller knows them (a strategy does; a NumPy
    value carries no logical device) and the value has one entry per replica,
    else the entries' own devices.
    """
    if destinations is None:
        raise ValueError("destinations must be a device string, a list of them, or a distributed value")
    if isinstance(destinations, str):
        return [dev.canonicalize(destinations)]
    if isinstance(destinations, DistributedValues):
        if replica_devices is not None and len(replica_devices) == len(destinations.values):
            return [dev.canonicalize(d) for d in replica_devices]
        return [dev.canonicalize(d) for d in destinations._devices()]
    if hasattr(destinations, "device") and isinstance(getattr(destinations, "device"), str):
        return [dev.canonicalize(destinations.device)]
    if isinstance(destinations, (list, tuple)):
        if not destinations:
            raise ValueError("destinations must not be empty")
        return [dev.canonicalize(d) for d in destinations]
    raise ValueError(f"Invalid destinations {destinations!r}: expected a device string, a list, or a distributed value")


class CrossDeviceOps:
    """Base class of cross-device reduction and broadcast (tf.distribute.CrossDeviceOps).

    A reduction is hierarchical: the rank's local replicas are reduced onto one
    device by the subclass (``ReductionToOneDevice`` or ``NcclAllReduce``),
    the result goes through one fused cross-rank all-reduce when the strategy
    spans several MPI ranks (``RankCommunicator``), and is then broadcast back to
    the destination devices. All subclasses share this one code path and differ
    only in their two local primitives, ``_local_reduce`` and
    ``_local_broadcast``.

    With ``MPISTRAT_CHECK_NUMERICS=1`` (or ``check_numerics = True`` on the ops
    object) every reduction first checks its inputs for NaN/Inf and raises on
    every rank, naming the replicas that sent them (one small extra collective).
    """

    def __init__(self) -> None:
        self._communicator = None
        self._bound = False
        self.check_numerics = config.get("check_numerics")

    # -- wiring done by the strategy ------------------------------------------------
    def _bind(self, communicator: Any) -> None:
        """Attach the cross-rank communicator (None within one process).

        Several single-process strategies may share one object; one bound to
        a communicator belongs to that strategy alone.
        """
        if self._bound and communicator is not self._communicator:
            raise ValueError(f"This {type(self).__name__} already serves a strategy over other MPI ranks; "
                             "give each strategy its own CrossDeviceOps.")
        self._communicator = communicator
        self._bound = True

    def _global_count(self, num_local: int) -> int:
        """Replicas taking part in a reduction: the local ones on every rank."""
        comm = self._communicator
        return num_local * (comm.size if comm is not None else 1)

    def _divisor(self, op: ReduceOp, num_local: int) -> int | None:
        """MEAN's divisor for the cross-rank all-reduce's agreement (None for the other ops)."""
        return self._global_count(num_local) if op is ReduceOp.MEAN else None

    # -- local primitives, overridden by subclasses --------------------------------
    def _local_reduce(self, op: ReduceOp, values: Sequence[Any], devices: Sequence[str]) -> Any:
        raise NotImplementedError

    def _local_broadcast(self, value: Any, devices: Sequence[str]) -> list:
        return [_shared_copy(value, d) for d in devices]

    # -- the shared hierarchical path ----------------------------------------------
    def batch_all_reduce(
        self,
        reduce_op: "ReduceOp | str",
        per_replica_leaves: Sequence[Sequence[Any]],
        devices: Sequence[str],
        options: Any = None,
        structure: str | None = None,
    ) -> list[list]:
        """All-reduce lists of arrays, one list per local replica; results per replica.

        ``per_replica_leaves[i][j]`` is leaf j of local replica i; the result
        has the same layout, every replica's leaf j holding the reduction over
        all replicas of all ranks, on that replica's device. ``structure``: the
        leaves' nesting, which every rank must share (see ``RankCommunicator.allreduce``).
        """
        num_local = len(per_replica_leaves)
        num_leaves = len(per_replica_leaves[0]) if num_local else 0
        if num_leaves == 0:
            self._join_empty(reduce_op, num_local, options, structure)
            return [[] for _ in range(num_local)]
        try:
            per_replica_leaves = [arrays.as_arrays(leaves, what="all_reduce") for leaves in per_replica_leaves]
        except Exception as exc:
            self._fail_everywhere(exc, options)
        reduced = self._reduce_to_one(reduce_op, per_replica_leaves, devices, options, structure)
        if num_local == 1:
            return [list(reduced)]
        return self._spread(reduced, devices)

    def _join_empty(self, reduce_op: "ReduceOp | str", num_local: int, options: Any, structure: str | None) -> None:
        """Take part in the ranks' agreement with nothing to reduce (an empty nest): a rank reducing arrays
        meanwhile raises a mismatch on every rank, instead of waiting for this one."""
        comm = self._communicator
        if comm is not None and comm.size > 1:
            op = ReduceOp.from_string(reduce_op)
            comm.allreduce([], op.wire, options, divisor=self._divisor(op, max(num_local, 1)), structure=structure)

    def all_reduce_repeat(self, wire: str, a: Any) -> Any:
        """``_all_reduce_alone(op, [a], devices)[0]`` for the one local replica's SUM, MIN or MAX (``wire``:
        ``"sum"``, ``"min"``, ``"max"``) of one NumPy or CuPy array of a native dtype when it repeats an
        earlier such call (``RankCommunicator.allreduce_repeat``), else None: the caller then takes the
        general path, whose one-replica case hands the same array to the same communicator."""
        comm = self._communicator
        if comm is None or self.check_numerics or a.dtype not in _NATIVE:
            return None
        return comm.allreduce_repeat(a, wire)

    def all_reduce_repeat_list(self, wire: str, leaves: list) -> list | None:
        """``_all_reduce_alone(op, leaves, devices)`` for the one local replica's SUM, MIN or MAX of a list of
        NumPy arrays when it repeats the latest such call (``RankCommunicator.allreduce_repeat_list``: the
        list matched in C, so each item is a C-contiguous array of the native dtype planned then), else
        None: the caller then takes the general path."""
        comm = self._communicator
        if comm is None or self.check_numerics:
            return None
        return comm.allreduce_repeat_list(leaves, wire)

    def _all_reduce_alone(self, reduce_op: ReduceOp, leaves: list, devices: Sequence[str], options: Any = None,
                          structure: str | None = None) -> list:
        """``batch_all_reduce(reduce_op, [leaves], devices, options)[0]`` for the one local replica: native
        NumPy arrays, the commonest call of a multi-worker step, go straight to the communicator (nothing
        to wrap, reduce locally or spread; the results are new arrays, the inputs untouched)."""
        comm = self._communicator
        if leaves and comm is not None and comm.size > 1 and len(devices) == 1 and not self.check_numerics:
            try:
                native = arrays.as_arrays(leaves, what="all_reduce") is leaves  # native numeric NumPy arrays
            except Exception:  # a leaf that does not convert: batch_all_reduce raises it on every rank
                native = False
            if native:
                reduced = comm.allreduce(leaves, reduce_op.wire, options, divisor=self._divisor(reduce_op, 1),
                                         structure=structure)
                if reduce_op is ReduceOp.MEAN:
                    n = self._global_count(1)
                    return [_divide(r, n) for r in reduced]
                return reduced
        return self.batch_all_reduce(reduce_op, [leaves], devices, options, structure)[0]

    def batch_all_reduce_async(
        self,
        reduce_op: "ReduceOp | str",
        per_replica_leaves: Sequence[Sequence[Any]],
        devices: Sequence[str],
        options: Any = None,
        structure: str | None = None,
    ) -> InFlightReduction:
        """:meth:`batch_all_reduce` started now: its ``rows()`` waits and returns what that returns.

        The local replicas are reduced in this call; the cross-rank all-reduce
        runs on the communicator's worker thread (``allreduce_async``); MEAN's
        division and the copies to the replicas' devices happen at the first
        ``rows()``.
        """
        num_local = len(per_replica_leaves)
        if num_local == 0 or not per_replica_leaves[0]:
            self._join_empty(reduce_op, num_local, options, structure)
            return InFlightReduction(None, [], lambda _: [[] for _ in range(num_local)])
        op = ReduceOp.from_string(reduce_op)
        if self._deterministic(op, options):  # run now (after the reductions started before it)
            rows = self.batch_all_reduce(op, per_replica_leaves, devices, options, structure)
            return InFlightReduction(None, rows, lambda rows: rows)
        try:
            per_replica_leaves = [arrays.as_arrays(leaves, what="all_reduce") for leaves in per_replica_leaves]
            reduced, owned = self._reduce_locally(op, per_replica_leaves, devices)
        except Exception as exc:
            self._fail_everywhere(exc, options)
        comm = self._communicator
        pending = None
        if comm is not None and comm.size > 1:
            pending = comm.allreduce_async(reduced, op.wire, options, inplace=owned, divisor=self._divisor(op, num_local),
                                           structure=structure)

        def finish(reduced: list) -> list[list]:
            if op is ReduceOp.MEAN:
                n = self._global_count(num_local)
                reduced = [_divide(r, n) for r in reduced]
            return [list(reduced)] if num_local == 1 else self._spread(reduced, devices)

        return InFlightReduction(pending, reduced, finish)

    def _spread(self, reduced: list, devices: Sequence[str]) -> list[list]:
        """Each reduced leaf copied to every replica's device; per replica, its leaves."""
        columns = [self._local_broadcast(r, devices) for r in reduced]
        return [[column[i] for column in columns] for i in range(len(devices))]

    def reduce(self, reduce_op: "ReduceOp | str", per_replica_value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduce a PerReplica/Mirrored value to ``destinations``."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple], options: Any = None) -> list:
        """Reduce several values at once (one fused cross-rank call)."""
        return self._batch_reduce(reduce_op, value_destination_pairs, options)

    def _batch_reduce(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple], options: Any = None,
                      replica_devices: Sequence[str] | None = None, structure: str | None = None) -> list:
        """``batch_reduce`` with the replicas' devices when the caller knows them (a strategy does).

        Without them, each replica's device is taken from its first value
        (NumPy values say CPU even on GPU replicas).
        """
        if not value_destination_pairs:
            return []
        values = [v for v, _ in value_destination_pairs]
        local = [v.values if isinstance(v, DistributedValues) else (v,) for v in values]
        num_local = len(local[0])
        if any(len(x) != num_local for x in local):
            raise ValueError("All values in batch_reduce must have the same number of local replicas")
        try:
            per_replica = [arrays.as_arrays([local[k][i] for k in range(len(values))], what="reduce")
                           for i in range(num_local)]
        except Exception as exc:
            self._fail_everywhere(exc, options)
        source_devices = (list(replica_devices) if replica_devices is not None and len(replica_devices) == num_local
                          else [dev.device_of(leaves[0]) for leaves in per_replica])
        # Reduce everything onto the first replica's device, then place on the destinations.
        reduced = self._reduce_to_one(reduce_op, per_replica, source_devices, options, structure)
        return [self._place(r, destination_devices(d, replica_devices))
                for r, (_, d) in zip(reduced, value_destination_pairs)]

    def _check_finite(self, per_replica: list[list]) -> None:
        """Raise on every rank, naming the replicas, when any input holds NaN or Inf."""
        comm = self._communicator
        rank = comm.rank if comm is not None else 0
        bad = []
        for i, leaves in enumerate(per_replica):
            for j, leaf in enumerate(leaves):
                arr = _as_array(leaf)
                if arr.dtype.kind in "fc" and not bool(dev.array_module(dev.device_of(arr)).isfinite(arr).all()):
                    bad.append((rank * len(per_replica) + i, rank, j, tuple(arr.shape)))
        if comm is not None and comm.size > 1:
            bad = [b for rank_bad in comm.allgather_object(bad) for b in rank_bad]
        if bad:
            detail = "; ".join(f"replica {g} (rank {r}) value #{j} of shape {shape}" for g, r, j, shape in bad)
            raise FloatingPointError(f"NaN or Inf in all-reduce input ({CHECK_NUMERICS_ENV} is on): {detail}")

    def _reduce_to_one(self, reduce_op: Any, per_replica: list[list], devices: Sequence[str], options: Any,
                       structure: str | None = None) -> list:
        """Every replica's leaves (converted by ``arrays.as_arrays``) reduced over all replicas, on one device."""
        op = ReduceOp.from_string(reduce_op)
        num_local = len(per_replica)
        if self._deterministic(op, options):
            reduced = self._reproducible_sum(op, per_replica, devices, options, structure)
            n = self._global_count(num_local)
            return [_divide(r, n) for r in reduced] if op is ReduceOp.MEAN else reduced
        try:
            reduced, owned = self._reduce_locally(op, per_replica, devices)
        except Exception as exc:
            self._fail_everywhere(exc, options)
        comm = self._communicator
        if comm is not None and comm.size > 1:
            # MEAN goes as a sum, divided below; its divisor is part of the agreement check, so ranks
            # asking MEAN and SUM raise a mismatch on every rank.
            reduced = comm.allreduce(reduced, op.wire, options, inplace=owned, divisor=self._divisor(op, num_local),
                                     structure=structure)
        if op is ReduceOp.MEAN:
            n = self._global_count(num_local)
            reduced = [_divide(r, n) for r in reduced]
        return reduced

    def _deterministic(self, op: ReduceOp, options: Any) -> bool:
        """Whether a SUM or MEAN takes the reproducible sum: ``deterministic=True`` in the call's options or
        the communicator's (MIN and MAX give the same bits in every order)."""
        comm = self._communicator
        asked = getattr(options, "deterministic", False) or (comm is not None and comm.options.deterministic)
        return asked and op in (ReduceOp.SUM, ReduceOp.MEAN)

    def _reproducible_sum(self, op: ReduceOp, per_replica: list[list], devices: Sequence[str], options: Any,
                          structure: str | None) -> list:
        """The local replicas' leaves summed with every other rank's, bitwise the same for any layout of the
        replicas (``RankCommunicator.deterministic_sum``, no local sum first), on the first replica's device."""
        comm = self._communicator
        try:
            check_reducible(op, per_replica)
            if self.check_numerics:
                self._check_finite(per_replica)
            target = devices[0]
            per_replica = [[dev.to_device(v, target) if dev.is_gpu(target) else _as_array(v) for v in leaves]
                           for leaves in per_replica]
        except Exception as exc:
            self._fail_everywhere(exc, options)
        if comm is not None:
            return comm.deterministic_sum(per_replica, options, divisor=self._divisor(op, len(per_replica)),
                                          structure=structure)
        return reproducible_sum(per_replica, len(per_replica))

    def _fail_everywhere(self, error: Exception, options: Any, collective: str = "allreduce") -> NoReturn:
        """Raise ``error``, met on this rank before its ``collective`` (converting or checking its own values),
        on every rank: the peers are in that collective's agreement, and raising here alone would leave them
        waiting or pair this rank's next collective with their current one. The one place this is done."""
        comm = self._communicator
        if comm is not None and comm.size > 1:
            comm.fail_collective(collective, error, options)
        raise error

    def _reduce_locally(self, op: ReduceOp, per_replica: list[list], devices: Sequence[str]) -> tuple[list, bool]:
        """The local replicas' leaves reduced onto one device (checked for NaN/Inf first when asked), and
        whether those arrays are this object's own (False: the one replica's arrays themselves)."""
        check_reducible(op, per_replica)
        if self.check_numerics:
            self._check_finite(per_replica)
        num_local = len(per_replica)
        if num_local == 1:
            leaves = per_replica[0]
            # The caller's list itself when it holds only arrays (nothing here writes to it).
            return (leaves if set(map(type, leaves)) == _NDARRAY_ONLY else [_as_array(v) for v in leaves]), False
        return [self._local_reduce(op, [per_replica[i][j] for i in range(num_local)], devices)
                for j in range(len(per_replica[0]))], True

    def _place(self, value: Any, devices: list[str]) -> Any:
        if len(devices) == 1:
            return dev.to_device(value, devices[0])
        return Mirrored([_shared_copy(value, d) for d in devices])

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copy ``tensor`` to every destination device (a Mirrored when several)."""
        return self._place(arrays.as_array(tensor, what="broadcast"), destination_devices(destinations))


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce by copying every replica's value to one device and accumulating there."""

    def __init__(self, reduce_to_device: str | None = None, accumulation_fn: Callable | None = None):
        super().__init__()
        self.reduce_to_device = None if reduce_to_device is None else dev.canonicalize(reduce_to_device)
        self.accumulation_fn = accumulation_fn

    def _local_reduce(self, op: ReduceOp, values: Sequence[Any], devices: Sequence[str]) -> Any:
        target = self.reduce_to_device or devices[0]
        arrays = [dev.to_device(v, target) for v in values]
        xp = dev.array_module(target)
        if self.accumulation_fn is not None and op in (ReduceOp.SUM, ReduceOp.MEAN):
            return xp.asarray(self.accumulation_fn(arrays))
        ufunc = getattr(xp, ops.ufunc(op.wire).__name__)  # the same ufunc in CuPy
        with dev.device_scope(target):
            acc = xp.array(arrays[0], copy=True)
            for a in arrays[1:]:
                if a.shape != acc.shape:
                    raise ValueError(f"Replicas hold values of different shapes: {acc.shape} vs {a.shape}")
                ufunc(acc, a, out=acc)
        return acc


class HierarchicalCopyAllReduce(ReductionToOneDevice):
    """tf.distribute's hierarchical copy all-reduce, for code that names it.

    TF reduces over a DGX-1-like GPU topology in packs; here a rank's local
    replicas are reduced onto the first replica's device (as
    ``ReductionToOneDevice``), and the cross-rank stage is the same MPI (or
    shared-memory) all-reduce every subclass uses. ``num_packs`` is accepted
    and checked as TF does.
    """

    def __init__(self, num_packs: int = 1):
        if num_packs < 0:
            raise ValueError(f"HierarchicalCopy requires num_packs >= 0, but {num_packs} is specified")
        super().__init__()
        self.num_packs = num_packs


class NcclAllReduce(CrossDeviceOps):
    """Reduce across the rank's GPUs with NCCL (``cupy.cuda.nccl``)."""

    def __init__(self, num_packs: int = 1):
        super().__init__()
        if num_packs < 0:
            raise ValueError(f"NCCL all-reduce requires num_packs >= 0, but {num_packs} is specified")
        self.num_packs = num_packs
        self._comms: dict[tuple[int, ...], Any] = {}

    def __deepcopy__(self, memo: dict) -> "NcclAllReduce":
        """The same settings; NCCL communicators belong to one object, so the copy makes its own at first use."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied._comms = {}
        memo[id(self)] = copied
        return copied

    def _nccl_comms(self, device_ids: tuple[int, ...]) -> Any:
        if device_ids not in self._comms:
            from cupy.cuda import nccl  # noqa: PLC0415

            self._comms[device_ids] = nccl.NcclCommunicator.initAll(list(device_ids))
        return self._comms[device_ids]

    def _ids(self, devices: Sequence[str]) -> tuple[int, ...]:
        if not all(dev.is_gpu(d) for d in devices):
            raise ValueError(f"NcclAllReduce needs every device to be a GPU, got {list(devices)}")
        return tuple(dev.device_index(d) for d in devices)

    def _local_reduce(self, op: ReduceOp, values: Sequence[Any], devices: Sequence[str]) -> Any:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        ids = self._ids(devices)
        comms = self._nccl_comms(ids)
        arrays = []
        for v, d, i in zip(values, devices, ids):
            with cupy.cuda.Device(i):  # NCCL reads C-ordered bytes
                arrays.append(cupy.ascontiguousarray(dev.to_device(v, d)))
        dtype = ops.nccl_dtype(arrays[0].dtype)
        if dtype is None:
            return ReductionToOneDevice()._local_reduce(op, values, devices)
        with cupy.cuda.Device(ids[0]):
            out = cupy.empty(arrays[0].shape, arrays[0].dtype)  # C order, whatever the input's layout
        nccl.groupStart()
        for i, (comm, a) in enumerate(zip(comms, arrays)):
            with cupy.cuda.Device(ids[i]):
                recv = out.data.ptr if i == 0 else a.data.ptr
                comm.reduce(a.data.ptr, recv, a.size, getattr(nccl, dtype), getattr(nccl, ops.nccl_op(op)), 0,
                            cupy.cuda.get_current_stream().ptr)
        nccl.groupEnd()
        for i in ids:
            cupy.cuda.Device(i).synchronize()
        return out

    def _local_broadcast(self, value: Any, devices: Sequence[str]) -> list:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        ids = self._ids(devices)
        dtype = ops.nccl_dtype(value.dtype)
        if dtype is None:
            return super()._local_broadcast(value, devices)
        comms = self._nccl_comms(ids)
        with cupy.cuda.Device(ids[0]):
            outs = [cupy.ascontiguousarray(dev.to_device(value, devices[0]))]
        for i in ids[1:]:
            with cupy.cuda.Device(i):
                outs.append(cupy.empty(value.shape, value.dtype))
        nccl.groupStart()
        for i, (comm, o) in enumerate(zip(comms, outs)):
            with cupy.cuda.Device(ids[i]):
                comm.broadcast(o.data.ptr, o.data.ptr, o.size, getattr(nccl, dtype), 0, cupy.cuda.get_current_stream().ptr)
        nccl.groupEnd()
        for i in ids:
            cupy.cuda.Device(i).synchronize()
        return outs


def select_cross_device_ops(devices: Sequence[str]) -> CrossDeviceOps:
    """NCCL when every device is a GPU (and there are several), else ReductionToOneDevice."""
    if len(devices) > 1 and all(dev.is_gpu(d) for d in devices):
        try:
            from cupy.cuda import nccl  # noqa: PLC0415
        except Exception:
            nccl = None
        if getattr(nccl, "available", False):  # the module imports with any CuPy; NCCL may still be absent
            return NcclAllReduce()
    return ReductionToOneDevice()
