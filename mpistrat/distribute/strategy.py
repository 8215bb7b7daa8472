"""The strategy API (``Strategy``, ``StrategyExtended``) as one implementation every strategy shares.

A strategy is defined by this rank's local replica devices and, for
multi-worker strategies, a ``RankCommunicator`` over the MPI ranks; global
replica id = worker index x local replicas + local id. The concrete
strategies (``one_device``, ``mirrored``, ``multi_worker``) only choose
devices, communicator and variable policy.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from typing import Any, Callable, Iterator, NoReturn, Sequence

import numpy as np

from mpistrat import arrays, nest, timeline
from mpistrat.distribute import context
from mpistrat import devices as dev
from mpistrat.distribute.context import Frame
from mpistrat.distribute import variables
from mpistrat.distribute.cross_device_ops import CrossDeviceOps, check_reducible, select_cross_device_ops
from mpistrat.distribute.input_options import InputWorkerInfo
from mpistrat.distribute.regroup import contains_distributed, local_values, regroup, select_component, select_replica
from mpistrat.distribute.reduce_along import reduce_along, sum_and_count
from mpistrat.distribute.replica_context import ReplicaContext
from mpistrat.distribute.replica_group import ReplicaGroup
from mpistrat.distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp
from mpistrat.ops import mean_dtype

__all__ = ["Strategy", "StrategyExtended", "ReplicaContext", "ValueContext", "RunOptions"]


class ValueContext:
    """What ``experimental_distribute_values_from_function``'s function learns about its replica."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """The global id of the replica the value is for."""
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync."""
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


class RunOptions:
    """Options for ``Strategy.run`` (accepted for compatibility; they do not change NumPy execution)."""

    def __init__(self, experimental_enable_dynamic_batch_size: bool = True,
                 experimental_bucketizing_dynamic_shape: bool = False,
                 experimental_xla_options: Any = None):
        self.experimental_enable_dynamic_batch_size = experimental_enable_dynamic_batch_size
        self.experimental_bucketizing_dynamic_shape = experimental_bucketizing_dynamic_shape
        self.experimental_xla_options = experimental_xla_options


class _DefaultScopeEntry:
    """The ``_StrategyScope`` entry saying the default strategy's scope was entered (no frame was pushed)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<default strategy scope>"


_DEFAULT_SCOPE = _DefaultScopeEntry()


class _StrategyScope:
    """Context manager returned by ``Strategy.scope()`` (TF's nesting rules)."""

    def __init__(self, strategy: "Strategy"):
        self._strategy = strategy
        # One entry per __enter__: the frame pushed, None (nothing pushed) or _DEFAULT_SCOPE.
        self._entries: list[Frame | _DefaultScopeEntry | None] = []

    def __enter__(self) -> "Strategy":
        strategy = self._strategy
        if strategy._extended._is_default:
            _scope_needs_frame(strategy)  # raises inside another strategy's scope
            context.enter_default_scope()
            self._entries.append(_DEFAULT_SCOPE)
        else:
            self._entries.append(_enter_scope(strategy))
        return strategy

    def __exit__(self, *exc: Any) -> None:
        entry = self._entries.pop()
        if entry is _DEFAULT_SCOPE:
            context.exit_default_scope()
        elif entry is not None:
            context.pop(entry)


def _enter_scope(strategy: "Strategy") -> Frame | None:
    """Make ``strategy`` current in cross-replica mode (TF's nesting rules); the frame pushed, if any."""
    if not _scope_needs_frame(strategy):
        return None
    frame = Frame(strategy, None)
    context.push(frame)
    return frame


def _scope_needs_frame(strategy: "Strategy") -> bool:
    """Raise where ``strategy``'s scope may not be entered (TF's nesting rules); whether entering pushes a frame."""
    current = context.current_frame()
    in_default = current.strategy is context.default_strategy()
    if strategy._extended._is_default:
        if not in_default:
            raise RuntimeError("Must not nest tf.distribute.Strategy scopes.")
        return False
    if in_default:
        return True
    if current.strategy is not strategy:
        raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {current.strategy} is not "
                           f"{strategy}")
    if current.replica_context is not None:
        raise RuntimeError("Method requires being in cross-replica context, use "
                           "get_replica_context().merge_call()")
    return False  # re-entering the same strategy's scope is allowed and changes nothing


class StrategyExtended:
    """The additional API of a strategy (``strategy.extended``), and its implementation."""

    _is_default = False
    _distributed_variables = True

    def __init__(self, container_strategy: "Strategy", local_devices: Sequence[str], *,
                 cross_device_ops: CrossDeviceOps | None = None, communicator: Any = None,
                 worker_index: int = 0, num_workers: int = 1, job: str = "localhost"):
        if not local_devices:
            raise ValueError("A strategy needs at least one device")
        canonical = [dev.canonicalize(d, job=job, task=worker_index) for d in local_devices]
        if len(set(canonical)) != len(canonical):
            raise ValueError(f"No duplicates allowed in `devices` argument: {list(local_devices)}")
        self._container_strategy_obj = container_strategy
        self._local_devices = tuple(canonical)
        self._num_local = len(canonical)
        self._all_cpu = not any(dev.is_gpu(d) for d in canonical)  # no device to make current in a replica
        self._communicator = communicator
        self._worker_index = worker_index
        self._num_workers = num_workers
        self._host_device = dev.host_device(task=worker_index, job=job)
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(self._local_devices)
        self._cross_device_ops._bind(communicator)
        self._start_replicas()

    # The state of running replicas: every strategy has its own, made by _start_replicas (a deep copy too).
    _REPLICA_STATE = ("_step_marker", "_group", "_solo_frame", "_cpu_scopes")

    def _start_replicas(self) -> None:
        """Make this strategy's replica threads and step state."""
        self._step_marker = threading.local()  # shared by this strategy's replica groups (nested runs)
        self._group = ReplicaGroup(self._num_local, self._step_marker)
        self._solo_frame: Frame | None = None  # _run_solo's replica frame: its context holds nothing of a step
        weakref.finalize(self, self._group.close)  # stop replica threads with the strategy

    def __deepcopy__(self, memo: dict) -> "StrategyExtended":
        """Copies of the settings and cross-device ops, with replica threads of its own.

        Reached from ``Strategy.__deepcopy__``, which puts the new strategy in
        ``memo`` first. A strategy over MPI ranks is not copied: its
        communicator is one collective resource of all the ranks.
        """
        if self._communicator is not None:
            raise ValueError(f"{self._container_strategy_obj!r} spans MPI ranks and cannot be deep copied")
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            if key not in self._REPLICA_STATE:
                setattr(copied, key, copy.deepcopy(value, memo))
        copied._start_replicas()
        return copied

    # -- properties ---------------------------------------------------------------
    def _container_strategy(self) -> "Strategy":
        return self._container_strategy_obj

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas in sync across all workers."""
        return self._num_local * self._num_workers

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's replica devices."""
        return self._local_devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices holding this worker's variable copies."""
        return self._local_devices

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker should save checkpoints (the chief only)."""
        return self._worker_index == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker should write summaries (the chief only)."""
        return self._worker_index == 0

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker initialises variables (every worker does; values come from the chief)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """True: every worker runs its own program (MPI SPMD)."""
        return True

    def _global_replica_id(self, local_id: int) -> int:
        return self._worker_index * self._num_local + local_id

    # -- running --------------------------------------------------------------------
    def _check_distributed_args(self, structure: Any) -> None:
        for leaf in nest.flatten(structure):
            if isinstance(leaf, DistributedValues) and len(leaf.values) != self._num_local:
                raise ValueError(
                    f"A {type(leaf).__name__} with {len(leaf.values)} value(s) was passed to a strategy with "
                    f"{self._num_local} local replica(s); it was probably made by another strategy."
                )

    def call_for_each_replica(self, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        """Run ``fn`` once per local replica in its replica context; regroup the results."""
        kwargs = kwargs or {}
        strategy = self._container_strategy_obj
        # A run from inside a step (a merge_fn calling strategy.run) gets replica threads of its own.
        nested = self._group.in_step()
        if self._num_local == 1 and not nested:  # the common multi-worker case: this thread is the replica
            return self._run_solo(fn, args, kwargs)
        group = ReplicaGroup(self._num_local, self._step_marker) if nested else self._group
        try:
            frames = [[Frame(strategy, ReplicaContext(strategy, self._global_replica_id(i), i, group.rendezvous))]
                      for i in range(self._num_local)]
            if (args and contains_distributed(args)) or (kwargs and contains_distributed(kwargs)):
                self._check_distributed_args((args, kwargs))
                call_args = [(tuple(select_replica(i, list(args))), select_replica(i, kwargs))
                             for i in range(self._num_local)]
            else:
                call_args = [(tuple(args), kwargs)] * self._num_local
            return regroup(group.run(fn, frames, self._device_scopes(), call_args))
        finally:
            if nested:
                group.close()

    def _run_solo(self, fn: Callable, args: Sequence[Any], kwargs: dict | None) -> Any:
        """``call_for_each_replica`` with one local replica, outside a step: ``fn`` runs in this thread."""
        if (args and contains_distributed(args)) or (kwargs and contains_distributed(kwargs)):
            self._check_distributed_args((args, kwargs))
            args, kwargs = select_replica(0, list(args)), select_replica(0, kwargs)
        group = self._group
        frame = self._solo_frame
        if frame is None or frame.replica_context._rendezvous is not group.rendezvous:
            strategy = self._container_strategy_obj
            frame = self._solo_frame = Frame(strategy, ReplicaContext(strategy, self._worker_index, 0, group.rendezvous))
        scope = None if self._all_cpu else self._device_scope(self._local_devices[0])
        return group.run_alone(fn, frame, scope, args, kwargs or {})

    def _device_scopes(self) -> list:
        cached = self.__dict__.get("_cpu_scopes")
        if cached is not None:
            return cached
        scopes = [self._device_scope(d) for d in self._local_devices]
        if self._all_cpu:
            self._cpu_scopes = scopes  # nullcontexts: stateless, reusable by every step
        return scopes

    def _device_scope(self, device: str) -> Any:
        return dev.device_scope(device) if dev.is_gpu(device) else contextlib.nullcontext()

    # -- reductions -----------------------------------------------------------------
    def _reduce_plan(self, value: Any, op: ReduceOp) -> tuple[str, Any]:
        """How to reduce ``value``: ("reduce", local components) or ("place", the value as it is).

        Follows tf.distribute: a Mirrored value's MEAN is itself; a plain value
        is this worker's replica value when the worker has one replica and
        there are several workers; otherwise a plain value is the same on every
        replica, so MEAN/MIN/MAX give it back and SUM over several replicas is
        an error (except the literal 0).
        """
        if isinstance(value, DistributedValues):
            comps = tuple(_read(v) for v in local_values(value, self._num_local))
            if op is ReduceOp.MEAN and getattr(value, "_is_mirrored", isinstance(value, Mirrored)):
                return "place", _copy_if_variable(value, comps[0])
            return "reduce", comps
        if getattr(value, "_is_variable", False):  # a plain variable: its value, not its storage
            value = _copy_if_variable(value, value.value())
        else:
            value = arrays.as_array(value, what="reduce")
        check_reducible(op, [[value]])  # as several ranks would reduce it, even where one process places it
        if self._num_workers > 1 and self._num_local == 1:
            return "reduce", (value,)
        if op is ReduceOp.SUM:
            if not _is_array_like(value) and np.ndim(value) == 0 and value == 0:
                return "place", value
            if self.num_replicas_in_sync != 1:
                raise ValueError(f"A non-DistributedValues value {value!r} cannot be reduced with the given "
                                 f"reduce op {op}.")
            return "place", value
        if self._num_workers == 1:
            return "place", value
        return "reduce", (value,) * self._num_local

    def reduce_to(self, reduce_op: "ReduceOp | str", value: Any, destinations: Any, options: Any = None) -> Any:
        """Combine a distributed value across all replicas and place it on ``destinations``."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple],
                        options: Any = None) -> list:
        """Several ``reduce_to`` in one fused cross-replica reduction."""
        return self._batch_reduce_to(reduce_op, value_destination_pairs, options)

    def _batch_reduce_to(self, reduce_op: "ReduceOp | str", value_destination_pairs: Sequence[tuple],
                         options: Any = None, structure: str | None = None) -> list:
        """:meth:`batch_reduce_to` of the leaves of a nest whose nesting (``nest.structure_signature``)
        every rank must share, or None."""
        op = ReduceOp.from_string(reduce_op)
        self._require_cross_replica_or_default_context()
        results: list[Any] = [None] * len(value_destination_pairs)
        pending: list[tuple[int, PerReplica, Any]] = []
        for k, (value, destinations) in enumerate(value_destination_pairs):
            try:
                how, payload = self._reduce_plan(value, op)
            except Exception as exc:  # raised on every rank, so no rank waits or pairs the wrong reductions
                self._raise_everywhere("allreduce", exc, options)
            if how == "reduce":
                pending.append((k, PerReplica(payload), destinations))
            elif _is_array_like(payload) or not (np.ndim(payload) == 0 and payload == 0):
                results[k] = self._cross_device_ops.broadcast(payload, destinations)
            else:
                results[k] = payload
        if pending:
            reduced = self._cross_device_ops._batch_reduce(op, [(v, d) for _, v, d in pending], options,
                                                           replica_devices=self._local_devices, structure=structure)
            for (k, _, _), r in zip(pending, reduced):
                results[k] = r
        elif self._communicator is not None and self._num_workers > 1:
            # A rank with nothing to reduce still joins the ranks' agreement (zero arrays), so a rank reducing
            # values while another reduces none raises a mismatch on every rank instead of pairing one rank's
            # next reduction with the other's current one.
            self._communicator.allreduce([], op.wire, options, structure=structure)
        return results

    def _require_cross_replica_or_default_context(self) -> None:
        """Raise inside a replica of this strategy, or in another strategy's scope (TF's rule)."""
        if not context.has_strategy():
            return
        frame = context.current_frame()
        if frame.strategy is not self._container_strategy():
            raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {frame.strategy} is not "
                               f"{self._container_strategy()}")
        if not frame.cross_replica:
            raise RuntimeError("Method requires being in cross-replica context, use "
                               "get_replica_context().merge_call()")

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copy ``tensor`` to ``destinations``."""
        return self._cross_device_ops.broadcast(tensor, destinations)

    def _raise_everywhere(self, collective: str, error: Exception, options: Any = None) -> NoReturn:
        """Raise ``error``, found on this rank before the ``collective`` its peers are calling, on every rank
        (``CrossDeviceOps._fail_everywhere``, bound to this strategy's communicator)."""
        self._cross_device_ops._fail_everywhere(error, options, collective)

    def _gather_leaf(self, local_values_: Sequence[Any], axis: int, options: Any) -> Any:
        """Concatenate local replicas' values along ``axis`` and all-gather across ranks (on the host)."""
        try:
            host = [dev.to_device(arrays.as_array(v, what="gather"), self._host_device) for v in local_values_]
            for h in host:
                if h.ndim == 0:
                    raise ValueError("gather/all_gather needs arrays with at least one dimension; got a scalar")
                if not -h.ndim <= axis < h.ndim:
                    raise ValueError(f"axis {axis} is out of range for a value of rank {h.ndim}")
            local = np.concatenate(host, axis=axis) if len(host) > 1 else host[0]
        except Exception as exc:  # a rank-local error: raised on every rank
            self._raise_everywhere("allgather", exc, options)
        comm = self._communicator
        if len(host) == 1 and (comm is None or comm.size == 1):
            return local.copy()  # a new array, never the caller's (or a variable's) storage
        if comm is not None and comm.size > 1:
            return comm.allgather(local, axis=axis % local.ndim, options=options)
        return local

    # -- variables --------------------------------------------------------------------
    def update(self, var: Any, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Run ``fn(copy, *args, **kwargs)`` on every local copy of ``var``, as tf.distribute.

        In cross-replica context (or with no strategy in scope) each copy is
        updated on its device, with distributed arguments taken apart per
        copy. Inside a replica of this strategy the update goes through
        ``merge_call`` (all replicas must call it). With ``group=True`` the
        results are regrouped (the copies of a variable become the variable, a
        result shared by every copy is returned as is, others become a
        ``Mirrored``); with ``group=False`` each result is a tuple of the
        per-copy results.
        """
        kwargs = kwargs or {}
        self._require_updatable((var,))
        if not self._is_default:
            replica_ctx = context.get_replica_context()
            if replica_ctx is not None and replica_ctx.strategy is self._container_strategy():
                return replica_ctx.merge_call(
                    lambda strategy, *a, **kw: strategy.extended.update(var, fn, a, kw, group), args=args,
                    kwargs=kwargs)
            self._require_cross_replica_or_default_context()
        strategy = self._container_strategy()
        if not isinstance(var, DistributedValues):
            with self._device_scope(getattr(var, "device", self._host_device)):
                result = fn(var, *args, **kwargs)
            return result if group else nest.map_structure(lambda r: (r,), result)
        results = []
        per_copy = bool(args and contains_distributed(args)) or bool(kwargs and contains_distributed(kwargs))
        for i, component in enumerate(var.values):
            frame = Frame(strategy, None, update_replica=i)
            context.push(frame)
            try:
                with self._device_scope(self._local_devices[i]):
                    if per_copy:
                        results.append(fn(component, *select_replica(i, list(args)), **select_replica(i, kwargs)))
                    else:
                        results.append(fn(component, *args, **kwargs))
            finally:
                context.pop(frame)
        if all(r is None for r in results):  # the common case (updates that return nothing): no regrouping
            return None if group else tuple(results)
        if group:
            return regroup(results, Mirrored)
        return nest.map_structure(lambda leaf: tuple(leaf.values), regroup(results, Mirrored, always_wrap=True))

    def _update_each(self, variables: Sequence[Any], fn: Callable[[Any, Any, int], None],
                     values: Sequence[Any]) -> None:
        """``update(variables[j], fn, (values[j], j), group=False)`` for every j, results dropped (an optimizer's
        step, in cross-replica context).

        Where every variable is a distributed variable with one copy per local replica, the updates are
        :meth:`update`'s, in its order (every copy of one variable, then the next: when an update fails,
        every variable before it is updated on every copy), without its per-call checks and with each copy's frame
        made once; with one local copy its frame is entered once for all. Anything else goes through
        :meth:`update` one variable at a time (a strategy's own ``update`` included). The caller checks every
        variable of its step with :meth:`_require_updatable` first, so that none changes where one cannot.
        """
        n = self._num_local
        if self._is_default or not all(isinstance(v, DistributedValues) and len(v.values) == n for v in variables):
            for j, (var, value) in enumerate(zip(variables, values)):
                self.update(var, fn, (value, j), group=False)
            return
        self._require_cross_replica_or_default_context()
        strategy = self._container_strategy()
        frames = [Frame(strategy, None, update_replica=i) for i in range(n)]
        if n == 1:  # one copy per variable: one frame for the whole step
            context.push(frames[0])
            try:
                with self._device_scope(self._local_devices[0]):
                    for j, (var, value) in enumerate(zip(variables, values)):
                        if isinstance(value, DistributedValues):
                            value = select_replica(0, value)
                        fn(var.values[0], value, j)
            finally:
                context.pop(frames[0])
            return
        for j, (var, value) in enumerate(zip(variables, values)):
            distributed = isinstance(value, DistributedValues)
            for i, (frame, component) in enumerate(zip(frames, var.values)):
                context.push(frame)
                try:
                    with self._device_scope(self._local_devices[i]):
                        fn(component, select_replica(i, value) if distributed else value, j)
                finally:
                    context.pop(frame)

    def _require_updatable(self, variables: Sequence[Any]) -> None:
        """Raise ValueError, before anything is updated, where a distributed value in ``variables`` has not one
        copy per local replica of this strategy (made under a strategy with another number of them):
        updating its copies on this strategy's devices would stop part way, the copies no longer equal."""
        n = self._num_local
        for var in variables:
            if isinstance(var, DistributedValues) and len(var.values) != n:
                owner = getattr(var, "_distribute_strategy", None)
                raise ValueError(
                    f"{type(var).__name__} {getattr(var, 'name', '')!r} has {len(var.values)} copies "
                    f"(made under {owner if owner is not None else 'another strategy'}) but is updated under "
                    f"{self._container_strategy()}, which has {n} local replica{'s' if n != 1 else ''}: update it "
                    f"inside the scope or the run of the strategy that created it; nothing was updated")

    def value_container(self, value: Any) -> Any:
        """The distributed variable holding ``value`` when it is one of its copies, else ``value``."""
        container = getattr(value, "_distributed_container", None)
        return value if container is None else container

    def read_var(self, var: Any) -> Any:
        """The variable's value in cross-replica context."""
        return var.read_value()

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` was created under this strategy's scope."""
        return getattr(v, "_distribute_strategy", None) is self._container_strategy()

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Place variables created inside on the same devices as ``colocate_with_variable``.

        Every variable of this strategy already has one copy on each local
        replica device, so this only checks its argument, as TF does.
        """
        if not context.has_strategy():
            raise RuntimeError(f'Need to be inside "with strategy.scope()" for {self._container_strategy()}')
        self._require_cross_replica_or_default_context()
        if getattr(colocate_with_variable, "_distribute_strategy", None) is not self._container_strategy():
            raise ValueError("`colocate_vars_with` must only be passed a variable created in this "
                             f"tf.distribute.Strategy.scope(), not: {colocate_with_variable!r}")
        yield

    def _create_variable(self, kwargs: dict) -> Any:
        """The distributed variable for ``Variable(**kwargs)``.

        In a replica of this strategy, as TF's shared variable creator: the
        replicas meet, the first replica's arguments create the variable and
        every replica gets that same variable.
        """
        replica_ctx = context.get_replica_context()
        if replica_ctx is not None:
            return replica_ctx._create_variable(kwargs)
        return variables.create_for_strategy(self._container_strategy(), kwargs)

    def _broadcast_initial_values(self, arrays: list) -> list:
        """The chief's values (multi-worker strategies broadcast them; others keep their own)."""
        comm = self._communicator
        if comm is not None and comm.size > 1:
            return comm.broadcast(arrays, root=0)
        return arrays


def _is_array_like(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and getattr(value, "ndim", 0) > 0


def _copy_if_variable(source: Any, array: Any) -> Any:
    """``array`` read from ``source``, copied when ``source`` is a variable (results never share its storage)."""
    if getattr(source, "_is_variable", False) and hasattr(array, "copy"):
        return array.copy()
    return array


def _divide(numer: Any, denom: Any) -> Any:
    """``numer / denom`` in ``numer``'s floating dtype (``ops.mean_dtype``), as TF's mean along an axis."""
    numer = np.asarray(numer)
    return numer / np.asarray(denom).astype(mean_dtype(numer.dtype))


def _read(value: Any) -> Any:
    """A variable component's current array; anything else as it is."""
    return value.read_value() if getattr(value, "_is_variable", False) else value


class Strategy:
    """A way to run a computation on several devices and workers (tf.distribute.Strategy)."""

    def __init__(self, extended: StrategyExtended):
        self._extended = extended
        timeline.start_from_environment()  # MPISTRAT_TIMELINE: recording starts with the program's first strategy

    def __deepcopy__(self, memo: dict) -> "Strategy":
        """A new strategy of the same kind, devices and settings, whose ``extended`` is its own and points back to
        it (TF's ``Strategy.__deepcopy__``). It is another strategy: its scope does not nest in this one's and
        its variables are its own."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, copy.deepcopy(value, memo))
        copied._extended._container_strategy_obj = copied
        return copied

    def __copy__(self) -> "Strategy":
        raise RuntimeError("Must only deepcopy DistributionStrategy.")

    @property
    def extended(self) -> StrategyExtended:
        """Additional methods for advanced use (``StrategyExtended``)."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas over which gradients are aggregated."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver (None for single-worker strategies)."""
        return getattr(self, "_cluster_resolver", None)

    def scope(self) -> _StrategyScope:
        """A context manager making this strategy current (cross-replica context)."""
        return _StrategyScope(self)

    def run(self, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None, options: RunOptions | None = None) -> Any:
        """Run ``fn`` on each replica with the given arguments; per-replica results are regrouped."""
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"positional args must be a list or tuple, got {type(args)}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"`kwargs` to `run` must be a dict, got {type(kwargs).__name__}")
        ext = self._extended
        traced = timeline.enabled()  # the timeline records a span around the same path; off, this is its cost
        if traced:
            start = timeline.now_us()
        try:
            # The common multi-worker step: this thread is the one replica, and a cross-replica frame
            # pushed under the replica's own frame would never be seen: only the scope's rules are checked.
            # A thread with no frame entered is in no step (a step pushes its replica's frame) and in the
            # default frame, where no scope rule can fail.
            if ext._num_local == 1:
                if not context.entered():
                    return ext._run_solo(fn, args, kwargs)
                if not ext._group.in_step():
                    _scope_needs_frame(self)
                    return ext._run_solo(fn, args, kwargs)
            frame = _enter_scope(self)  # what `with self.scope()` does, without the scope object
            try:
                return ext.call_for_each_replica(fn, args, kwargs)
            finally:
                if frame is not None:
                    context.pop(frame)
        finally:
            if traced:
                timeline.record("run", "step", start, timeline.now_us() - start,
                                fn=getattr(fn, "__name__", "fn"), replicas=ext._num_local)

    def reduce(self, reduce_op: "ReduceOp | str", value: Any, axis: int | None) -> Any:
        """Reduce ``value`` across replicas (and along ``axis`` within each replica) to the host.

        ``value`` may be a nested structure: each leaf is reduced, all of them
        in one fused reduction, and the structure is kept.
        """
        op = ReduceOp.from_string(reduce_op)
        with self.scope():
            ext = self._extended
            host = ext._host_device
            leaves = nest.flatten(value)
            structure = nest.structure_signature(value) if nest.is_nested(value) else None
            if axis is None:
                reduced = ext._batch_reduce_to(op, [(leaf, host) for leaf in leaves], structure=structure)
            elif op is ReduceOp.MEAN:
                # The global mean along the axis: global sum / global count, not a mean of means.
                pairs = []
                try:
                    for leaf in leaves:
                        numer, denom = self._per_replica(lambda v: sum_and_count(v, axis), leaf)
                        pairs += [(numer, host), (denom, host)]
                except Exception as exc:  # a rank-local error (conversion, axis): raised on every rank
                    ext._raise_everywhere("allreduce", exc)
                sums = ext._batch_reduce_to(ReduceOp.SUM, pairs, structure=structure)
                reduced = [_divide(numer, denom) for numer, denom in zip(sums[::2], sums[1::2])]
            else:
                try:
                    pairs = [(self._per_replica(lambda v: reduce_along(op, v, axis), leaf), host) for leaf in leaves]
                except Exception as exc:  # a rank-local error (conversion, axis): raised on every rank
                    ext._raise_everywhere("allreduce", exc)
                reduced = ext._batch_reduce_to(op, pairs, structure=structure)
            return nest.pack_sequence_as(value, reduced)

    def _per_replica(self, fn: Callable[[Any], Any], value: Any) -> Any:
        """``fn`` applied to each local replica's part of ``value`` on its device, regrouped (no replica threads)."""
        ext = self._extended
        parts = []
        for component, device in zip(local_values(value, ext._num_local), ext._local_devices):
            with ext._device_scope(device):
                parts.append(fn(_read(component)))
        return regroup(parts)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's ``value`` along ``axis`` on the host (global replica order)."""
        ext = self._extended
        ext._require_cross_replica_or_default_context()
        if not contains_distributed(value) and ext._num_workers == 1:
            # As TF: in one process a value that is not per replica is already "gathered"; it is converted
            # and checked as a gathered value is, so that a laptop refuses what the cluster would.
            return nest.map_structure(lambda v: ext._gather_leaf((_read(v),), axis, None), value)
        if nest.is_nested(value):  # a nest of per-replica values, as strategy.run returns for a nested result
            comps = tuple(nest.map_structure(_read, c) for c in self.experimental_local_results(value))
            return nest.map_structure(lambda *leaves: ext._gather_leaf(leaves, axis, None), *comps)
        comps = tuple(_read(c) for c in local_values(value, ext._num_local))
        return ext._gather_leaf(comps, axis, None)

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's per-replica values of ``value`` as a tuple.

        As TF: a distributed value gives its components; a nested structure
        gives one structure per local replica (each distributed leaf replaced
        by that replica's component, plain leaves repeated); a plain value
        gives ``(value,)``.
        """
        if isinstance(value, DistributedValues):
            return tuple(value.values)
        if nest.is_nested(value):
            return tuple(select_component(i, value) for i in range(self._extended._num_local))
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Call ``value_fn(ValueContext)`` for each local replica and regroup the results.

        With several local replicas, every leaf of the (possibly nested)
        result becomes a ``PerReplica``; with one, the value is returned as is.
        """
        ext = self._extended
        values = []
        for i, device in enumerate(ext._local_devices):
            ctx = ValueContext(ext._global_replica_id(i), ext.num_replicas_in_sync)
            with ext._device_scope(device):
                values.append(value_fn(ctx))
        return values[0] if len(values) == 1 else regroup(values, always_wrap=True)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """Distribute a batched ``mpistrat.data.Dataset`` over the replicas (see mpistrat.data)."""
        from mpistrat.data.distribute import DistributedDataset  # noqa: PLC0415

        return DistributedDataset(dataset, self._input_worker_info(), options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """Build one dataset per worker (or replica) with ``dataset_fn(InputContext)`` and distribute them."""
        from mpistrat.data.distribute import DistributedDatasetsFromFunction  # noqa: PLC0415

        return DistributedDatasetsFromFunction(dataset_fn, self._input_worker_info(), options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> Any:
        """A ``mpistrat.data.Dataset`` of the slices of ``numpy_input`` (arrays, tuples or dicts of them).

        As TF's (``StrategyExtendedV1.experimental_make_numpy_dataset``), in
        cross-replica context of this strategy or with no strategy in scope.
        """
        self._extended._require_cross_replica_or_default_context()
        from mpistrat.data import Dataset  # noqa: PLC0415

        return Dataset.from_tensor_slices(numpy_input)

    def _input_worker_info(self) -> InputWorkerInfo:
        ext = self._extended
        return InputWorkerInfo(
            num_workers=ext._num_workers,
            worker_index=ext._worker_index,
            local_devices=ext._local_devices,
            num_replicas_in_sync=ext.num_replicas_in_sync,
            first_replica_id=ext._global_replica_id(0),
            communicator=ext._communicator if ext._num_workers > 1 else None,
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} devices={list(self._extended._local_devices)}>"


class _DefaultExtended(StrategyExtended):
    _is_default = True
    _distributed_variables = False


class _DefaultDistributionStrategy(Strategy):
    """The strategy in effect when no other is in scope: one replica, on the host."""

    def __init__(self) -> None:
        super().__init__(_DefaultExtended(self, ["/cpu:0"]))

    def __deepcopy__(self, memo: dict) -> "Strategy":
        raise RuntimeError("Should only create a single instance of _DefaultDistributionStrategy")

    def run(self, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None, options: Any = None) -> Any:
        if not isinstance(args, (list, tuple)):
            raise ValueError(f"positional args must be a list or tuple, got {type(args)}")
        return fn(*args, **(kwargs or {}))

    def __repr__(self) -> str:
        return "<_DefaultDistributionStrategy>"


def _default_strategy_and_replica_context() -> tuple[Strategy, ReplicaContext]:
    strategy = _DefaultDistributionStrategy()
    return strategy, ReplicaContext(strategy, 0, 0)


context.set_default_factory(_default_strategy_and_replica_context)
