"""``ReplicaContext``: what a replica function sees inside ``Strategy.run``.

Cross-replica calls (``all_reduce``, ``all_gather``, ``merge_call``) meet the
step's other local replicas at the step's ``Rendezvous``; replica 0 runs the
shared work (the cross-device ops, hence the ranks) for all of them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from mpistrat import nest
from mpistrat.distribute import context
from mpistrat import devices as dev
from mpistrat.distribute.context import Frame
from mpistrat.distribute.in_flight import AllReduceHandle, InFlightReduction
from mpistrat.distribute.regroup import regroup, select_replica
from mpistrat.distribute.replica_group import Rendezvous
from mpistrat.distribute.values import DistributedValues, ReduceOp
from mpistrat.distribute.variables import check_same_creation

__all__ = ["ReplicaContext"]


# The logical ops a lone replica's repeated all-reduce takes straight to the communicator, by every
# spelling ReduceOp.from_string takes exactly: their wire op (MEAN divides afterwards: the general path).
_REPEAT_WIRE = {spelling: op.wire for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX)
                for spelling in (op, op.value, op.value.lower())}
_OP_TYPES = (str, ReduceOp)  # hashable spellings of an op

class ReplicaContext:
    """The context of one replica inside ``Strategy.run``."""

    def __init__(self, strategy: Any, replica_id_in_sync_group: int, local_replica_id: int = 0,
                 rendezvous: Rendezvous | None = None):
        self._strategy = strategy
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._local_replica_id = local_replica_id
        self._rendezvous = rendezvous if rendezvous is not None else Rendezvous(1)
        self._initializing = 0  # depth of variable initializers this replica is calling (see _create_variable)

    @property
    def strategy(self) -> Any:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas in sync across all workers."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's global id, in ``[0, num_replicas_in_sync)``."""
        return self._replica_id_in_sync_group

    @property
    def devices(self) -> tuple[str, ...]:
        """The device(s) this replica runs on."""
        return (self._strategy.extended._local_devices[self._local_replica_id],)

    def _meet(self, kind: str, payload: Any, fn: Callable[[list], Sequence[Any]]) -> Any:
        if self._initializing and self._rendezvous.n > 1:
            raise RuntimeError(
                f"{kind} was called from a variable's initial_value inside strategy.run. The first replica alone "
                "calls the initializer (as TF's shared variable creator) while the other replicas wait to create "
                "the variable, so it cannot meet them: compute the value first and pass it as initial_value.")
        return self._rendezvous.meet(self._local_replica_id, kind, payload, fn)

    def _require_current(self) -> None:
        """Raise unless this context is the current one (TF's ``require_replica_context``)."""
        frame = context.current_frame()
        if frame.replica_context is self:
            return
        if frame.replica_context is None:
            raise RuntimeError("Need to be inside `call_for_each_replica()`: this ReplicaContext was used in "
                               "cross-replica context (e.g. captured and called from a merge_call's merge_fn).")
        if frame.strategy is self._strategy:
            raise RuntimeError("Mismatching ReplicaContext: a ReplicaContext was used outside the replica it "
                               "belongs to; call mpistrat.get_replica_context() in the replica function instead.")
        raise RuntimeError(f"Mismatching tf.distribute.Strategy objects: {frame.strategy} is not {self._strategy}.")

    def merge_call(self, merge_fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Pause all replicas, run ``merge_fn(strategy, *args)`` once in cross-replica context.

        Arguments are regrouped (``PerReplica`` where replicas passed different
        values); each replica gets its own component of the result.
        """
        self._require_current()
        kwargs = kwargs or {}
        strategy = self._strategy

        def run_merge(payloads: list) -> list:
            # As tf.distribute: replica 0's merge_fn runs, with every replica's arguments regrouped.
            grouped_args, grouped_kwargs = regroup([(p[1], p[2]) for p in payloads],
                                                   what="passed merge_call arguments")
            frame = Frame(strategy, None)
            context.push(frame)
            try:
                result = payloads[0][0](strategy, *grouped_args, **grouped_kwargs)
            finally:
                context.pop(frame)
            return [select_replica(i, result) for i in range(len(payloads))]

        return self._meet("merge_call", (merge_fn, tuple(args), dict(kwargs)), run_merge)

    def _create_variable(self, kwargs: dict) -> Any:
        """``Variable(**kwargs)`` from this replica: created once, shared by every replica (TF's shared creator).

        As TF's creator, the first replica alone calls a callable initial
        value, in its own thread, replica context and device, before the
        replicas meet: a variable created inside that initializer is created
        by the first replica alone, and with several local replicas a
        cross-replica call inside it (``all_reduce``, ``merge_call``, ...)
        raises RuntimeError. The replicas then meet; their arguments must
        describe the same variable (``variables.check_same_creation``), the
        first replica's make it in cross-replica context, and every replica
        gets it. Under a multi-worker strategy the initial value is the
        chief's, as for a variable made in the scope.
        """
        self._require_current()
        if self._local_replica_id == 0 and callable(kwargs["initial_value"]):
            kwargs = dict(kwargs, initial_value=self._call_initializer(kwargs["initial_value"]))
        if self._initializing:  # inside the first replica's initializer: nobody to meet
            return self._make_variable(kwargs)

        def run_create(payloads: list) -> list:
            check_same_creation(payloads)
            return [self._make_variable(payloads[0])] * len(payloads)

        return self._meet("create_variable", kwargs, run_create)

    def _call_initializer(self, initial_value: Callable[[], Any]) -> Any:
        """``initial_value()`` on the first local device, marked as a variable initializer (see ``_meet``)."""
        self._initializing += 1
        try:
            with dev.device_scope(self._strategy.extended._local_devices[0]):
                return initial_value()
        finally:
            self._initializing -= 1

    def _make_variable(self, kwargs: dict) -> Any:
        """The strategy's variable for ``kwargs`` (initial value already called), made in cross-replica context."""
        strategy = self._strategy
        frame = Frame(strategy, None)
        context.push(frame)
        try:
            return strategy.extended._create_variable(kwargs)
        finally:
            context.pop(frame)

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any, options: Any = None) -> Any:
        """Reduce ``value`` (a nested structure of arrays/scalars) across all replicas."""
        if context.current_frame().replica_context is not self:
            self._require_current()  # raises
        ext = self._strategy._extended
        # The hot case, a repeat of a lone replica's SUM, MIN or MAX (spelled as ReduceOp.from_string takes
        # them): of one array (or a list of one), or of a list of arrays.
        if options is None and self._rendezvous.n == 1 and type(reduce_op) in _OP_TYPES:
            wire = _REPEAT_WIRE.get(reduce_op)
            if wire is not None and type(value) is list and len(value) > 1:
                out = ext._cross_device_ops.all_reduce_repeat_list(wire, value)
                if out is not None:
                    return out
            elif wire is not None:
                a = value[0] if type(value) is list and len(value) == 1 else value
                if type(a) is np.ndarray or dev.is_cupy_array(a):
                    out = ext._cross_device_ops.all_reduce_repeat(wire, a)
                    if out is not None:
                        return out if a is value else [out]
        op = ReduceOp.from_string(reduce_op)
        if type(value) is np.ndarray and self._rendezvous.n == 1:  # nothing to walk or rebuild
            return ext._cross_device_ops._all_reduce_alone(op, [value], ext._local_devices, options)[0]
        flat = _replica_leaves("all_reduce", value)
        structure = _structure(value, flat)
        if self._rendezvous.n == 1:  # a lone replica: nobody to meet or to agree with, its leaves are the batch
            reduced = ext._cross_device_ops._all_reduce_alone(op, flat, ext._local_devices, options, structure)
            if flat is value:  # a flat list of plain leaves (see _replica_leaves): no structure to rebuild
                return reduced
        else:

            def run_reduce(payloads: list) -> list:
                _check_agree("all_reduce", "reduce ops", [p[0].name for p in payloads])
                _check_agree("all_reduce", "structures", [p[2] for p in payloads])
                leaves = [p[1] for p in payloads]
                _check_same_leaves("all_reduce", leaves)
                return ext._cross_device_ops.batch_all_reduce(op, leaves, ext._local_devices, options, structure)

            reduced = self._meet("all_reduce", (op, flat, structure), run_reduce)
        return nest.pack_sequence_as(value, reduced)

    def experimental_all_reduce_async(self, reduce_op: "ReduceOp | str", value: Any,
                                      options: Any = None) -> AllReduceHandle:
        """Start :meth:`all_reduce` and return a handle at once (Horovod's ``allreduce_async``).

        ``handle.result()`` waits and returns what ``all_reduce(reduce_op, value,
        options)`` returns (a new value of the same structure); ``handle.done()``
        says, without blocking, whether it has finished. The cross-rank
        reduction runs on the communicator's worker thread while this replica
        goes on, so a step can reduce one layer's gradients while it computes
        the next (DDP's bucket overlap).

        The rules are ``all_reduce``'s: every local replica starts the same
        collectives in the same order, and every rank is checked to make the same
        call (shapes, dtypes, op); a mismatch, or any error of the reduction, is
        raised by ``result()`` on every rank. Collectives run in the order they
        were started; a blocking one waits until those started before it have
        finished. The arrays of ``value`` are read while the reduction is in
        flight: do not write them until the handle is done. A reduction whose
        result is never read is finished when ``strategy.run`` returns, and
        ``run`` raises its error. With one rank the reduction is done at once.
        """
        self._require_current()
        op = ReduceOp.from_string(reduce_op)
        ext = self._strategy.extended
        flat = _replica_leaves("experimental_all_reduce_async", value)
        structure = _structure(value, flat)
        rendezvous = self._rendezvous

        def start(payloads: list) -> list:
            if len(payloads) > 1:
                _check_agree("experimental_all_reduce_async", "reduce ops", [p[0].name for p in payloads])
                _check_agree("experimental_all_reduce_async", "structures", [p[2] for p in payloads])
                _check_same_leaves("experimental_all_reduce_async", [p[1] for p in payloads])
            reduction = ext._cross_device_ops.batch_all_reduce_async(
                op, [p[1] for p in payloads], ext._local_devices, options, structure)
            if not reduction.done():
                rendezvous.track(reduction)  # finished by the end of the step at the latest
            return [reduction] * len(payloads)

        reduction: InFlightReduction = self._meet("experimental_all_reduce_async", (op, flat, structure), start)
        return AllReduceHandle(reduction, self._local_replica_id, value, flat is value)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenate every replica's ``value`` along ``axis``, in global replica order."""
        self._require_current()
        ext = self._strategy.extended
        flat = _replica_leaves("all_gather", value)

        def run_gather(payloads: list) -> list:
            _check_agree("all_gather", "axes", [p[0] for p in payloads])
            leaves = [p[1] for p in payloads]
            _check_same_leaves("all_gather", leaves)
            gathered = [ext._gather_leaf([p[j] for p in leaves], axis, options) for j in range(len(leaves[0]))]
            return [[dev.to_device(g, d, copy=i > 0) for g in gathered] for i, d in enumerate(ext._local_devices)]

        return nest.pack_sequence_as(value, self._meet("all_gather", (axis, flat), run_gather))

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, strategy={self._strategy!r})"


_PLAIN_LEAVES = frozenset((np.ndarray, float, int, bool, np.float32, np.float64, np.int32, np.int64))


def _replica_leaves(kind: str, value: Any) -> list:
    """The leaves of a replica's ``value``; variables read as this replica's copy (one walk, no copies).

    A plain list of arrays and numbers (the common case) is returned as it is, not copied."""
    if type(value) is list and set(map(type, value)) <= _PLAIN_LEAVES:  # one scan: flat and nothing to read
        return value
    flat = nest.flatten(value)
    if set(map(type, flat)) <= _PLAIN_LEAVES:  # arrays and numbers: nothing to read
        return flat
    for j, leaf in enumerate(flat):
        if isinstance(leaf, DistributedValues):
            if not getattr(leaf, "_is_variable", False):
                raise ValueError(f"{kind} in replica context takes this replica's values; got a "
                                 f"{type(leaf).__name__}, a DistributedValues (pass it through strategy.run to "
                                 "unwrap it per replica).")
            flat[j] = leaf.value()
        elif getattr(leaf, "_is_variable", False):
            flat[j] = leaf.value()
    return flat


def _structure(value: Any, flat: list) -> str | None:
    """The nesting of a replica's ``value`` that every replica and rank must share (dict keys, namedtuple
    types), or None for a lone array or a flat list of leaves (their count and order say it all), whatever
    the leaves are (NumPy or CuPy arrays, numbers, variables)."""
    if flat is value or not nest.is_nested(value):
        return None
    if type(value) is list and not any(map(nest.is_nested, value)):
        return None
    return nest.structure_signature(value)


def _check_same_leaves(kind: str, payloads: list) -> None:
    counts = [len(p) for p in payloads]
    if len(set(counts)) != 1:
        raise ValueError(f"Replicas passed structures with different numbers of values to {kind}: {counts}")


def _check_agree(kind: str, what: str, per_replica: list) -> None:
    """Raise naming every replica's choice when the local replicas passed different ``what`` to ``kind``."""
    if any(v != per_replica[0] for v in per_replica[1:]):
        detail = ", ".join(f"replica {i}: {v!r}" for i, v in enumerate(per_replica))
        raise ValueError(f"Replicas called {kind} with different {what} ({detail}); every replica must pass "
                         "the same one.")
