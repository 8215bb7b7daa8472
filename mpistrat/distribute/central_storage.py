"""CentralStorageStrategy: variables on one device of one process, compute replicated on the local devices."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from mpistrat import devices as dev
from mpistrat import nest
from mpistrat.distribute import context, variables
from mpistrat.distribute.context import Frame
from mpistrat.distribute.cross_device_ops import ReductionToOneDevice
from mpistrat.distribute.input_options import InputOptions, InputReplicationMode
from mpistrat.distribute.strategy import Strategy, StrategyExtended
from mpistrat.distribute.values import DistributedValues, Mirrored, ReduceOp
from mpistrat.distribute.variables import BaseVariable, Variable, VariableAggregation

__all__ = ["CentralStorageStrategy", "AggregatingVariable"]

_LOCAL_CPU = "/device:CPU:0"

# TF's values_util.aggregation_error_msg, for an AggregatingVariable updated in a replica with aggregation NONE.
_AGGREGATION_ERROR = (
    "You must specify an aggregation method to update a {variable_type} in Replica Context. You can do so by "
    "passing an explicit value for argument `aggregation` to tf.Variable(..).e.g. `tf.Variable(..., "
    "aggregation=tf.VariableAggregation.SUM)`.`tf.VariableAggregation` lists the possible aggregation methods.This "
    "is required because {variable_type} should always be kept in sync. When updating them or assigning to them in a "
    "replica context, we automatically try to aggregate the values before updating the variable. For this "
    "aggregation, we need to know the aggregation method. Another alternative is to not try to update such "
    "{variable_type} in replica context, but in cross replica context. You can enter cross replica context by calling "
    "`tf.distribute.get_replica_context().merge_call(merge_fn, ..)`.Inside `merge_fn`, you can then update the "
    "{variable_type} using `tf.distribute.StrategyExtended.update()`.")


class AggregatingVariable(BaseVariable):
    """One variable on the parameter device whose replica updates are aggregated first (TF's ps_values one).

    Reads give the variable's value everywhere. In a replica, ``assign``,
    ``assign_add`` and ``assign_sub`` meet the other replicas, combine their
    values by ``aggregation`` onto the parameter device and apply the result
    once; aggregation NONE raises ValueError there (TF's message). In
    cross-replica context they go through ``strategy.extended.update``.
    """

    def __init__(self, strategy: Any, v: Variable, aggregation: VariableAggregation):
        self._distribute_strategy = strategy
        self._v = v
        v._aggregating_container = weakref.ref(self)
        self._aggregation = aggregation

    def get(self) -> Variable:
        """The variable this wraps."""
        return self._v

    @property
    def distribute_strategy(self) -> Any:
        return self._distribute_strategy

    @property
    def name(self) -> str:
        return self._v.name

    @property
    def dtype(self) -> Any:
        return self._v.dtype

    @property
    def shape(self) -> tuple:
        return self._v.shape

    @property
    def device(self) -> str:
        return self._v.device

    @property
    def trainable(self) -> bool:
        return self._v.trainable

    @property
    def synchronization(self) -> Any:
        return self._v.synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def constraint(self) -> Any:
        return self._v.constraint

    def value(self) -> Any:
        """The variable's value; read in a replica on another GPU, a copy on that replica's device (TF copies a
        variable's value to the op's device)."""
        value = self._v.value()
        frame = context.current_frame()
        if frame.strategy is self._distribute_strategy and frame.update_replica is None \
                and frame.replica_context is not None:
            device = self._distribute_strategy.extended._local_devices[frame.replica_context._local_replica_id]
            if device != self._v.device and (dev.is_gpu(device) or dev.is_gpu(self._v.device)):
                return dev.to_device(value, device)
        return value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._v, name)

    def __repr__(self) -> str:
        return repr(self._v)

    def _in_place_owner(self) -> Any:
        """Inside ``extended.update``, the one variable on the parameter device (the one ``_assign`` writes)."""
        return None if context.updating_copy(self._distribute_strategy) is None else self._v._in_place_owner()

    def _assign(self, method: str, value: Any, read_value: bool = True) -> Any:
        strategy = self._distribute_strategy
        frame = context.current_frame()
        if frame.strategy is not strategy and context.has_strategy():  # TF's enter_or_assert_strategy
            raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {frame.strategy} is not "
                               f"{strategy}")
        if frame.strategy is not strategy or frame.replica_context is None:
            if context.updating_copy(strategy) is not None:  # inside extended.update
                self._v._assign(method, value)
                return self
            strategy.extended.update(self, lambda v, x: v._assign(method, x), args=(value,))
            return self
        if self._aggregation is VariableAggregation.NONE:
            raise ValueError(_AGGREGATION_ERROR.format(variable_type="AggregatingVariable"))
        if getattr(value, "_is_variable", False):
            value = value.value()
        var = self

        def merge_fn(strategy: Any, v: Any) -> None:
            # TF's values_util.apply_aggregation, then one update on the parameter device.
            if var._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
                reduced = strategy.extended.broadcast_to(strategy.experimental_local_results(v)[0], var)
            else:
                reduced = strategy.extended.reduce_to(ReduceOp.from_variable_aggregation(var._aggregation), v, var)
            strategy.extended.update(var, lambda comp, r: comp._assign(method, r), args=(reduced,))

        frame.replica_context.merge_call(merge_fn, args=(value,))
        return self


Variable.register(AggregatingVariable)


def _same_array(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values (the same buffer, as reduced results shared by logical CPU
    replicas are, needs no comparison)."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype \
            and a.strides == b.strides and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]:
        return True
    if np.shape(a) != np.shape(b):
        return False
    device = dev.device_of(a)
    xp = dev.array_module(device)
    with dev.device_scope(device) if dev.is_gpu(device) else contextlib.nullcontext():
        return bool(xp.array_equal(xp.asarray(a), dev.to_device(b, device)))


def _select_single_value(structured: Any, strategy: Any) -> Any:
    """The one value an update of the central variable uses (TF's ``_select_single_value``): a distributed
    value's first component, when every replica holds that same value; a PerReplica of differing values raises."""

    def select(x: Any) -> Any:
        if not isinstance(x, DistributedValues):
            return x
        first = x.values[0]
        if isinstance(x, Mirrored) or all(_same_array(first, v) for v in x.values[1:]):
            return first
        raise ValueError(
            f"You cannot update variable with a PerReplica object {x!r} when using {type(strategy).__name__}. "
            "You must specify a single value or a Mirrored with a single value (reduce it first: "
            "strategy.reduce or strategy.extended.reduce_to).")

    return nest.map_structure(select, structured)


class _CentralStorageExtended(StrategyExtended):
    """``StrategyExtended`` with one copy of each variable, on the parameter device."""

    def __init__(self, container_strategy: "CentralStorageStrategy", compute_devices: Sequence[str],
                 parameter_device: str):
        super().__init__(container_strategy, compute_devices,
                         cross_device_ops=ReductionToOneDevice(reduce_to_device=_LOCAL_CPU))
        self._parameter_device = dev.canonicalize(parameter_device)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The one device holding the variables."""
        return (self._parameter_device,)

    @property
    def worker_devices_by_replica(self) -> list[list[str]]:
        """One compute device per replica."""
        return [[d] for d in self._local_devices]

    def _create_variable(self, kwargs: dict) -> Any:
        """One variable on the parameter device; wrapped in an ``AggregatingVariable`` with several replicas."""
        if context.get_replica_context() is not None:  # replicas meet; the first creates it in cross-replica mode
            return super()._create_variable(kwargs)
        kwargs = dict(kwargs)
        aggregation = kwargs.pop("aggregation")
        if not isinstance(aggregation, VariableAggregation):
            raise ValueError(f"Invalid variable aggregation mode: {aggregation} for variable: {kwargs['name']}")
        array = variables._initial_array(kwargs.pop("initial_value"), kwargs["dtype"], self._parameter_device)
        v = Variable(**kwargs, _device=self._parameter_device, _array=array)
        if self.num_replicas_in_sync > 1:
            return AggregatingVariable(self._container_strategy(), v, aggregation)
        return v

    def update(self, var: Any, fn: Callable, args: Sequence[Any] = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Run ``fn(var, *args, **kwargs)`` once, on the parameter device (TF's ParameterServerStrategyExtended).

        In a replica the update goes through ``merge_call``. A distributed
        argument gives its first value (TF 2.4+) when every replica holds the
        same value (a ``Mirrored``, or gradients all-reduced in the replicas);
        a ``PerReplica`` of differing values raises ValueError (TF 2.0-2.3
        raised for every PerReplica; TF 2.4+ would silently drop all but the
        first replica's value).
        """
        kwargs = kwargs or {}
        replica_ctx = context.get_replica_context()
        strategy = self._container_strategy()
        if replica_ctx is not None and replica_ctx.strategy is strategy:
            return replica_ctx.merge_call(
                lambda s, *a, **kw: s.extended.update(var, fn, a, kw, group), args=args, kwargs=kwargs)
        self._require_cross_replica_or_default_context()
        if isinstance(var, AggregatingVariable):
            var = var.get()
        if not getattr(var, "_is_variable", False) or isinstance(var, DistributedValues):
            raise ValueError(f"You can not update `var` {var!r}. It must be a Variable.")
        args = _select_single_value(list(args), strategy)
        kwargs = _select_single_value(kwargs, strategy)
        frame = Frame(strategy, None, update_replica=0)  # TF's UpdateContext(var.device)
        context.push(frame)
        try:
            with self._device_scope(var.device):
                result = fn(var, *args, **kwargs)
        finally:
            context.pop(frame)
        if group:
            return result
        return nest.map_structure(lambda r: tuple(r.values) if isinstance(r, DistributedValues) else (r,), result)

    def value_container(self, value: Any) -> Any:
        """The ``AggregatingVariable`` wrapping ``value``, when it wraps one; else ``value``."""
        ref = getattr(value, "_aggregating_container", None)
        if ref is not None and not isinstance(value, AggregatingVariable):
            wrapper = ref()
            if wrapper is not None:
                return wrapper
        return value

    def read_var(self, var: Any) -> Any:
        """The variable's value (one copy: nothing to aggregate)."""
        return var.read_value()


class CentralStorageStrategy(Strategy):
    """A one-machine strategy that puts all variables on a single device (TF's CentralStorageStrategy).

    Variables live on the CPU, or on the only GPU; compute is replicated on
    ``compute_devices`` (default: every GPU, else the CPU; logical CPU
    devices ``["/cpu:0", "/cpu:1"]`` give several replicas on NumPy), each
    replica in its own thread as in ``MirroredStrategy``. Reductions go to
    the CPU (``ReductionToOneDevice``). With several replicas a variable is
    an ``AggregatingVariable``: updates inside ``strategy.run`` are combined
    by its ``aggregation`` and applied once.

    Args:
      compute_devices: device strings to replicate the computation on.
      parameter_device: the device for the variables; default the compute
        device when there is one, else ``/device:CPU:0``.
    """

    def __init__(self, compute_devices: Sequence[str] | None = None, parameter_device: str | None = None):
        compute_devices = dev.device_list(
            dev.default_local_devices() if compute_devices is None else compute_devices, "compute_devices")
        if parameter_device is None:
            parameter_device = compute_devices[0] if len(compute_devices) == 1 else _LOCAL_CPU
        super().__init__(_CentralStorageExtended(self, compute_devices, parameter_device))

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> Any:
        """As :meth:`Strategy.experimental_distribute_dataset`; PER_REPLICA raises NotImplementedError (as TF)."""
        if isinstance(options, InputOptions) and \
                options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in "
                                      "`experimental_distribute_datasets_from_function`.")
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """One dataset for the whole machine, ``dataset_fn(InputContext(1, 0, replicas))``, split over the replicas.

        TF's strategy passes a single worker-level ``InputContext``, so
        PER_REPLICA raises NotImplementedError (as OneDeviceStrategy does).
        """
        if isinstance(options, InputOptions) and \
                options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in "
                                      "`experimental_distribute_datasets_from_function` of "
                                      "tf.distribute.MirroredStrategy")
        return super().distribute_datasets_from_function(dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def __repr__(self) -> str:
        ext = self._extended
        return (f"<CentralStorageStrategy compute_devices={list(ext._local_devices)} "
                f"parameter_device={ext._parameter_device}>")
