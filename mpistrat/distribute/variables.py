"""Variables as tf.distribute has them: plain, mirrored (ON_WRITE) or sync-on-read (ON_READ).

``Variable(...)`` makes the kind the current strategy's scope calls for. An
assignment replaces a copy's array, or writes into it only while nothing outside
the variable refers to it (``in_place``), so ``value()`` is a read-only snapshot
that never changes; updates of one variable from several replica threads are
atomic.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import enum
import itertools
import re
import threading
from typing import Any, Callable

import numpy as np

from mpistrat.distribute import context, in_place
from mpistrat import aligned, arrays
from mpistrat import devices as dev
from mpistrat.distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp, ValueOperators

_NO_SCOPE = contextlib.nullcontext()  # the CPU device scope (stateless, shared)

__all__ = [
    "VariableSynchronization",
    "VariableAggregation",
    "Variable",
    "DistributedVariable",
    "MirroredVariable",
    "SyncOnReadVariable",
]


class VariableSynchronization(enum.Enum):
    """When a distributed variable's copies are synchronised."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How replicas' updates (or copies, for ON_READ) are combined."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


_names = itertools.count()


def _operand(x: Any) -> Any:
    return x.value() if getattr(x, "_is_variable", False) else x


class _Operators(ValueOperators):
    """Operators through the variable's current value, and Python number conversion."""

    def _operand_value(self) -> Any:
        return self.value()

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    __hash__ = object.__hash__


class BaseVariable(_Operators):
    """What every variable offers: reading, assigning, NumPy conversion.

    Arithmetic, comparison and bitwise operators apply to the current value.
    ``==`` and ``!=`` compare identity, so variables stay hashable (TF 2 makes
    them elementwise and variables unhashable): compare ``v.numpy()`` instead.
    """

    _is_variable = True

    # subclasses provide: value(), _assign(method, value), name, dtype, shape, device, and the settings
    # ``_trainable``, ``_synchronization`` and ``_aggregation`` (or their own properties below)
    @property
    def trainable(self) -> bool:
        return self._trainable  # type: ignore[attr-defined]

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization  # type: ignore[attr-defined]

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation  # type: ignore[attr-defined]

    def _identity(self) -> Any:
        """What identifies this variable in every copy of it (optimizers file slots by it): the object here."""
        return id(self)

    def read_value(self) -> Any:
        """The current value (an array on the variable's device)."""
        return self.value()

    def numpy(self) -> np.ndarray:
        """The current value as a new NumPy array on the host (writing into it leaves the variable alone)."""
        value = self.value()
        host = dev.to_device(value, "/cpu:0")
        return np.array(host, copy=True) if host is value or isinstance(value, np.ndarray) else np.asarray(host)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        return arr.astype(dtype) if dtype is not None else arr

    def assign(self, value: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Set the variable to ``value``, cast to the variable's dtype within its kind (float64 values into a
        float32 variable, as TF); a change of kind (floats into an integer variable, complex into real,
        numbers into bool) raises TypeError, as do ``assign_add`` and ``assign_sub``."""
        return self._assign("assign", value, read_value)

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Add ``delta`` to the variable."""
        return self._assign("assign_add", delta, read_value)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None, read_value: bool = True) -> Any:
        """Subtract ``delta`` from the variable."""
        return self._assign("assign_sub", delta, read_value)

    def _assignable(self, method: str, value: Any) -> Any:
        """``value`` converted by ``arrays.as_array``; TypeError, naming this variable, its dtype and the
        value's, when becoming this variable's dtype would change its kind (``arrays.kind_change_error``:
        no float truncated into an integer, no imaginary part dropped, no number made a bool)."""
        if type(value) is np.ndarray and value.dtype == self.dtype:  # the common case (native: as the variable's)
            return value
        value = arrays.as_array(value, what=f"{method} to variable {self.name}")
        if type(value) is np.ndarray and value.dtype == self.dtype:
            return value
        error = arrays.kind_change_error(value, self.dtype, f"{method} to variable {self.name!r}")
        if error is not None:
            raise error
        return value

    def _in_place_owner(self) -> "Variable | None":
        """The plain variable whose own host array an update here may write into (``in_place.run``), or
        None: this one keeps no such array (it is updated by assignment)."""
        return None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def get_shape(self) -> tuple:
        return self.shape

    def __repr__(self) -> str:
        try:
            shown = np.array2string(self.numpy(), separator=", ")
        except Exception as exc:  # a cross-replica read may need all replicas
            shown = f"<unavailable: {exc}>"
        return (f"<{type(self).__module__.split('.')[0]}.{type(self).__name__} '{self.name}' shape={self.shape} "
                f"dtype={self.dtype.name}, numpy={shown}>")


def _as_dtype(dtype: Any) -> np.dtype | None:
    """A ``dtype`` argument as a NumPy dtype (anything with a ``name`` NumPy knows, e.g. CuPy's); None stays None."""
    if dtype is None or isinstance(dtype, np.dtype):
        return dtype
    return np.dtype(getattr(dtype, "name", dtype))


def _default_dtype(initial: Any, dtype: Any) -> np.dtype | None:
    if dtype is not None:
        return _as_dtype(dtype)
    return arrays.python_default_dtype(initial)


def _frozen(array: Any) -> Any:
    """``array`` made read-only when it is a NumPy array the variable owns (CuPy has no such flag)."""
    if isinstance(array, np.ndarray):
        array.flags.writeable = False
    return array


def _stored(array: Any) -> Any:
    """The array a variable holds: a NumPy array C-ordered and, for bool and numeric dtypes, on a cache line, as
    TF places tensors (a copy where it is not: ``mpistrat.aligned``), read-only; a CuPy array as it is (its
    memory pool aligns to 256 bytes)."""
    return _frozen(aligned.ensure(array) if type(array) is np.ndarray else array)


def _initial_array(initial_value: Any, dtype: Any, device: str) -> Any:
    if initial_value is None:
        raise ValueError("initial_value must be specified.")
    if callable(initial_value):
        with dev.device_scope(device):
            initial_value = initial_value()
    target = _default_dtype(initial_value, dtype)
    xp = dev.array_module(device)
    with dev.device_scope(device):
        arr = dev.to_device(arrays.as_array(initial_value, what="Variable initial_value"), device, copy=True)
        return xp.asarray(arr, dtype=target, order="C")  # TF has no strides; updates work on C order in place


class _VariableMeta(abc.ABCMeta):
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is Variable and "_array" not in kwargs:
            strategy = context.get_strategy()
            _require_default_scope_strategy(strategy)
            if strategy.extended._distributed_variables:
                return strategy.extended._create_variable(_bind_variable_args(*args, **kwargs))
        return super().__call__(*args, **kwargs)


def _require_default_scope_strategy(strategy: Any) -> None:
    """Raise when a variable is made under another strategy inside the default strategy's scope.

    TF's default scope installs a variable creator that requires the default
    strategy to be current (distribute_lib ``_DefaultDistributionContext``):
    entering another strategy's scope inside it, or running it, and creating
    a variable there raises.
    """
    if context.in_default_scope() and strategy is not context.default_strategy():
        raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {strategy} is not "
                           f"{context.default_strategy()}")


def _bind_variable_args(initial_value: Any = None, trainable: bool | None = None, name: str | None = None,
                        dtype: Any = None, synchronization: VariableSynchronization = VariableSynchronization.AUTO,
                        aggregation: VariableAggregation = VariableAggregation.NONE, shape: Any = None,
                        constraint: Callable[[Any], Any] | None = None, **unknown: Any) -> dict:
    if unknown:
        raise TypeError(f"Variable got unexpected keyword argument(s): {sorted(unknown)}")
    return dict(initial_value=initial_value, trainable=trainable, name=name, dtype=dtype,
                synchronization=synchronization, aggregation=aggregation, shape=shape, constraint=constraint)


def _validate(kwargs: dict) -> tuple[VariableSynchronization, VariableAggregation, bool]:
    """The checked synchronization and aggregation, and ``trainable`` (default: not for ON_READ), as tf.Variable."""
    sync, agg, trainable = kwargs["synchronization"], kwargs["aggregation"], kwargs["trainable"]
    if not isinstance(sync, VariableSynchronization):
        raise ValueError(f"Invalid variable synchronization mode: {sync} for variable: {kwargs['name']}")
    if not isinstance(agg, VariableAggregation):
        raise ValueError(f"Invalid variable aggregation mode: {agg} for variable: {kwargs['name']}")
    constraint = kwargs["constraint"]
    if constraint is not None and not callable(constraint):
        raise ValueError(f"Argument `constraint` must be None or a callable. Got a {type(constraint)}: {constraint!r}")
    if trainable is None:
        trainable = sync is not VariableSynchronization.ON_READ
    return sync, agg, bool(trainable)


def check_same_creation(per_replica: list[dict]) -> None:
    """Raise naming the replicas when replicas of one step create different variables at the same point.

    Compared: the name (without uniquifying ``_<digit>`` suffixes, as TF's
    shared variable creator: ``foo_0`` and ``foo_1`` match), synchronization,
    aggregation, trainable and dtype given, and the shape (given, or of an
    initial value that is not a callable; a callable is only ever called for
    the first replica, as TF's creator does).
    """
    first = _creation_signature(per_replica[0])
    for i, kwargs in enumerate(per_replica[1:], start=1):
        other = _creation_signature(kwargs)
        differ = [k for k in first if first[k] != other[k] and None not in (first[k], other[k])]  # None: not given
        if differ:
            detail = ", ".join(f"{k}: {first[k]!r} (replica 0) vs {other[k]!r} (replica {i})" for k in differ)
            what = "an unnamed variable" if kwargs["name"] is None else f"variable {kwargs['name']}"
            raise RuntimeError(
                f"Tried to create {what} with mismatching {differ[0]} on device {i} ({detail}). "
                "Inside strategy.run every replica must create the same variables in the same order: the first "
                "replica creates each one and the others get it.")


_UNIQUIFIED_SCOPE = re.compile(r"_\d/")
_UNIQUIFIED_END = re.compile(r"_\d$")


def _canonical_name(name: str | None) -> str:
    """``name`` without the ``_<digit>`` suffixes name uniquification adds (TF's shared creator matches on it)."""
    if name is None:
        return "Variable"
    return _UNIQUIFIED_END.sub("", _UNIQUIFIED_SCOPE.sub("/", name))


def _creation_signature(kwargs: dict) -> dict:
    initial = kwargs["initial_value"]
    shape = kwargs["shape"]
    if shape is None and initial is not None and not callable(initial):
        shape = np.shape(initial)
    return {"name": _canonical_name(kwargs["name"]), "shape": None if shape is None else tuple(shape),
            "dtype": _as_dtype(kwargs["dtype"]),
            "synchronization": kwargs["synchronization"], "aggregation": kwargs["aggregation"],
            "trainable": kwargs["trainable"]}


class Variable(BaseVariable, metaclass=_VariableMeta):
    """A mutable array on one device (``tf.Variable``); distributed under a multi-replica scope.

    ``Variable(...)`` creates a plain variable on the current strategy's
    device, or, under the scope of a strategy with distributed variables
    (Mirrored, MultiWorkerMirrored), a ``MirroredVariable`` or
    ``SyncOnReadVariable`` with one copy per local replica device.

    Assignments replace the array, or write into it only while nothing outside
    the variable refers to it (``distribute/in_place.py``: ``assign_add``,
    ``assign_sub`` and the optimizers' update rules), so an array returned by
    ``value()`` is a snapshot that later updates do not change.
    NumPy values are read-only (as a ``tf.Tensor`` is immutable): write into
    ``numpy()``, which is a copy.
    """

    def __init__(self, initial_value: Any = None, trainable: bool | None = None, name: str | None = None,
                 dtype: Any = None, synchronization: VariableSynchronization = VariableSynchronization.AUTO,
                 aggregation: VariableAggregation = VariableAggregation.NONE, shape: Any = None,
                 constraint: Callable[[Any], Any] | None = None,
                 *, _device: str | None = None, _array: Any = None):
        kwargs = _bind_variable_args(initial_value, trainable, name, dtype, synchronization, aggregation, shape,
                                     constraint)
        sync, agg, trainable = _validate(kwargs)
        strategy = context.get_strategy()
        device = _device or strategy.extended._local_devices[0]
        self._device = dev.canonicalize(device)
        self._on_gpu = dev.is_gpu(self._device)
        self._array = _stored(_array if _array is not None else _initial_array(initial_value, dtype, self._device))
        self._update_lock = threading.RLock()  # re-entrant: a warning or signal handler may read it mid-update
        self._writing = False  # an update is writing into the array itself (in_place.run)
        self._name = name if name is not None else f"Variable_{next(_names)}"
        self._trainable = trainable
        self._synchronization = sync
        self._aggregation = agg
        self._constraint = constraint
        self._distribute_strategy = strategy
        self._distributed_container = None
        if shape is not None and tuple(shape) != tuple(self._array.shape):
            raise ValueError(f"Variable {self._name}: initial value has shape {tuple(self._array.shape)}, "
                             f"not the given shape {tuple(shape)}")

    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def shape(self) -> tuple:
        return tuple(self._array.shape)

    @property
    def device(self) -> str:
        """The canonical device, e.g. ``/job:localhost/replica:0/task:0/device:CPU:0``."""
        return self._device

    @property
    def constraint(self) -> Callable[[Any], Any] | None:
        """The projection an optimizer applies after each update (``assign`` does not), or None."""
        return self._constraint

    def value(self) -> Any:
        """The current array: a snapshot (later assignments replace, not modify, it), read-only for NumPy."""
        with self._update_lock:  # not while another thread's update writes in place
            if self._writing:  # read from inside that update (a warning or signal handler): a copy
                return _frozen(self._array.copy())
            return self._array

    def __deepcopy__(self, memo: dict) -> "Variable":
        """A new variable with this one's value, name, settings and strategy, on the same device (as TF)."""
        with dev.device_scope(self._device) if self._on_gpu else _NO_SCOPE:
            array = self.value().copy()
        copied = Variable(trainable=self._trainable, name=self._name, synchronization=self._synchronization,
                          aggregation=self._aggregation, constraint=self._constraint, _device=self._device,
                          _array=array)
        copied._distribute_strategy = self._distribute_strategy
        memo[id(self)] = copied
        return copied

    def _assign(self, method: str, value: Any, read_value: bool = True) -> Any:
        value = _operand(value)  # another variable: its value here (its copy for this replica or update)
        if isinstance(value, DistributedValues):
            raise ValueError(
                f"Cannot assign a {type(value).__name__} to variable {self._name}, which holds a single value; "
                "reduce it first (strategy.reduce) or update it per replica with strategy.extended.update.")
        on_gpu = self._on_gpu
        value = self._assignable(method, value)
        new = value if not on_gpu and type(value) is np.ndarray else dev.to_device(value, self._device)
        with (dev.device_scope(self._device) if on_gpu else _NO_SCOPE), self._update_lock:
            xp = dev.array_module(self._device) if on_gpu else np
            if method == "assign":  # TF has no strides; on the host, one copy straight onto a cache line
                new = (xp.array(new, dtype=self.dtype, copy=True, order="C") if on_gpu
                       else aligned.copy(new, self.dtype))
                if new.shape != self._array.shape:
                    raise ValueError(f"Cannot assign a value of shape {new.shape} to variable {self._name} "
                                     f"of shape {self._array.shape}")
            elif not on_gpu and self._update_in_place(method, new):
                return self
            elif method == "assign_add":
                new = xp.asarray(self._array + new).astype(self.dtype, copy=False)
            else:
                new = xp.asarray(self._array - new).astype(self.dtype, copy=False)
            if new.shape != self._array.shape:
                raise ValueError(f"Update of variable {self._name} would change its shape from "
                                 f"{self._array.shape} to {new.shape}")
            self._array = _stored(new)
        return self

    def _update_in_place(self, method: str, delta: Any) -> bool:
        """Add or subtract ``delta`` into the NumPy array itself where ``in_place.run`` allows it, and only
        when the result has the variable's own dtype and shape, so the outcome is bitwise that of the
        copying path; False if not done. This saves an allocation (and its page faults) per update."""
        if (type(delta) is not np.ndarray or delta.dtype != self._array.dtype
                or (delta.shape != self._array.shape and delta.ndim != 0)):
            return False
        return in_place.run((self,), None, _add_into if method == "assign_add" else _subtract_from, delta)

    def _in_place_owner(self) -> "Variable | None":
        """This variable, when its array is NumPy's (see ``BaseVariable._in_place_owner``)."""
        return None if self._on_gpu else self


def _add_into(array: np.ndarray, delta: np.ndarray) -> None:
    np.add(array, delta, out=array)


def _subtract_from(array: np.ndarray, delta: np.ndarray) -> None:
    np.subtract(array, delta, out=array)


class DistributedVariable(BaseVariable, DistributedValues):
    """A variable with one copy per local replica device.

    Assignment follows tf.distribute: inside ``strategy.run`` a mirrored
    variable aggregates the replicas' updates (its ``aggregation``) and
    applies the same update to every copy; a sync-on-read variable updates
    only the replica's own copy and aggregates when read in cross-replica
    context. Used with no strategy in scope, it behaves as in its strategy's
    cross-replica context (TF enters the strategy). Updates from several
    replica threads are atomic.
    """

    _is_mirrored = False
    _is_sync_on_read = False

    def __init__(self, strategy: Any, components: list[Variable], name: str, trainable: bool,
                 synchronization: VariableSynchronization, aggregation: VariableAggregation):
        DistributedValues.__init__(self, components)
        self._strategy = strategy
        self._distribute_strategy = strategy
        self._name = name
        self._trainable = trainable
        self._synchronization = synchronization
        self._aggregation = aggregation
        for c in components:
            c._distributed_container = self

    @property
    def distribute_strategy(self) -> Any:
        return self._strategy

    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype:
        return self._values[0].dtype

    @property
    def shape(self) -> tuple:
        return self._values[0].shape

    @property
    def constraint(self) -> Callable[[Any], Any] | None:
        """The copies' constraint (see ``Variable.constraint``)."""
        return self._values[0].constraint

    def __deepcopy__(self, memo: dict) -> "DistributedVariable":
        """A new distributed variable of the same class, aggregation and strategy, with copies of the values.

        As TF (values.py ``DistributedVariable.__deepcopy__``), only inside
        this variable's strategy, or with no strategy in scope.
        """
        self._in_this_strategy()
        components = [copy.deepcopy(c, memo) for c in self._values]
        copied = type(self)(self._strategy, components, self._name, self._trainable, self._synchronization,
                            self._aggregation)
        memo[id(self)] = copied
        return copied

    def _devices(self) -> tuple[str, ...]:
        return tuple(c.device for c in self._values)

    def __len__(self) -> int:
        raise TypeError(f"len() of a variable is not defined ({type(self).__name__} {self._name!r}); "
                        "use .shape[0], or len(strategy.experimental_local_results(v)) for its copies")

    def _local_component(self) -> Variable | None:
        """The copy that reads and writes use here: this replica's, the one being updated, or None (whole)."""
        local_id = context.local_replica_id_of(self._strategy)
        return None if local_id is None else self._values[local_id]

    def __repr__(self) -> str:
        # Per copy, as tf.distribute prints distributed values: no collective in a repr.
        inner = ",\n  ".join(f"{i}: {BaseVariable.__repr__(c)}" for i, c in enumerate(self._values))
        return f"{type(self).__name__}:{{\n  {inner}\n}}"

    @property
    def device(self) -> str:
        """The device of the current replica's copy (the primary copy in cross-replica context)."""
        comp = self._local_component()
        return (comp or self._values[0]).device

    @property
    def primary(self) -> Variable:
        """The first local copy."""
        return self._values[0]

    def _get(self) -> Variable:
        """The copy that stands for the variable here (attributes the variable lacks are looked up on it)."""
        comp = self._local_component()
        return comp if comp is not None else self._values[0]

    def _in_this_strategy(self) -> None:
        if context.has_strategy() and context.get_strategy() is not self._strategy:
            raise RuntimeError(f"Mixing different tf.distribute.Strategy objects: {context.get_strategy()} is not "
                               f"{self._strategy}")

    def _first_replica_value(self, value: Any) -> Any:
        """The value of global replica 0 (rank 0's first local replica), on every rank."""
        first = value.values[0] if isinstance(value, DistributedValues) else value
        comm = self._strategy.extended._communicator
        if comm is not None and comm.size > 1:
            first = comm.broadcast([np.asarray(dev.to_device(first, "/cpu:0"))], root=0)[0]
        return first


class MirroredVariable(DistributedVariable, Mirrored):
    """A variable kept identical on every replica (synchronization ON_WRITE)."""

    _is_mirrored = True

    def value(self) -> Any:
        comp = self._local_component()
        return (comp or self._values[0]).value()

    def _in_place_owner(self) -> Variable | None:
        """Inside ``extended.update``, the copy being updated (the one ``_assign`` writes); else None."""
        j = context.updating_copy(self._strategy)
        return None if j is None else self._values[j]._in_place_owner()

    def _assign(self, method: str, value: Any, read_value: bool = True) -> Any:
        self._in_this_strategy()
        j = context.updating_copy(self._strategy)
        if j is not None:  # inside extended.update
            self._values[j]._assign(method, value)
            return self
        frame = context.current_frame()
        ext = self._strategy.extended
        if frame.strategy is not self._strategy or frame.cross_replica:
            if isinstance(value, PerReplica):
                raise ValueError(
                    f"Cannot assign a PerReplica value to MirroredVariable {self._name} in cross-replica context: "
                    "its copies must stay identical. Reduce the value first (strategy.reduce / extended.reduce_to), "
                    "or assign inside strategy.run with an aggregation.")
            if isinstance(value, DistributedValues):  # one value per copy: check all before any copy changes
                for v in value.values:
                    self._assignable(method, _operand(v))
            ext.update(self, lambda comp, v: comp._assign(method, v), args=(value,))
            return self
        value = _operand(value)  # another variable: this replica's copy of it
        if isinstance(value, DistributedValues):
            raise ValueError(
                f"Cannot update MirroredVariable {self._name} in replica context with a {type(value).__name__}: "
                "pass this replica's own value (strategy.run unwraps distributed arguments per replica).")
        if self._aggregation is VariableAggregation.NONE:
            # As tf.distribute: only this replica's copy changes (keeping the copies equal is the caller's job).
            self._values[frame.replica_context._local_replica_id]._assign(method, value)
            return self
        try:
            value = self._assignable(method, value)
        except TypeError as exc:  # raised in the merge, where every replica and rank meets it
            value = _Refused(exc)
        var = self

        def merge_fn(strategy: Any, v: Any) -> None:
            var._raise_refused(strategy, v)
            if var._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
                reduced = var._first_replica_value(v)
            else:
                op = ReduceOp.from_variable_aggregation(var._aggregation)
                reduced = strategy.extended.reduce_to(op, v, var)
            strategy.extended.update(var, lambda comp, r: comp._assign(method, r), args=(reduced,))

        context.get_replica_context().merge_call(merge_fn, args=(value,))
        return self

    def _raise_refused(self, strategy: Any, value: Any) -> None:
        """Raise, on every rank, the error of a local replica whose update this variable refused.

        The merge's collective (the aggregation's all-reduce, or ONLY_FIRST_REPLICA's broadcast) would
        combine the replicas' values: a rank raising alone before it would leave its peers waiting there,
        so the error goes through the collective's agreement (``fail_collective``). Every rank raises:
        the TypeError itself where every rank refused the same update, else a mismatch naming it.
        """
        for v in strategy.experimental_local_results(value):
            if type(v) is _Refused:
                comm = strategy.extended._communicator
                if comm is not None and comm.size > 1:
                    only_first = self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA
                    comm.fail_collective("broadcast" if only_first else "allreduce", v.error)
                raise v.error


class _Refused:
    """A replica's update that failed its conversion or kind check, carried into the merge to be raised there."""

    __slots__ = ("error",)

    def __init__(self, error: TypeError) -> None:
        self.error = error


class SyncOnReadVariable(DistributedVariable):
    """A variable each replica updates alone; reads in cross-replica context aggregate the copies."""

    _is_sync_on_read = True

    def value(self) -> Any:
        comp = self._local_component()
        if comp is not None:
            return comp.value()
        return self._cross_replica_value()

    def _cross_replica_value(self) -> Any:
        agg = self._aggregation
        if agg is VariableAggregation.ONLY_FIRST_REPLICA:
            return self._first_replica_value(PerReplica([c.value() for c in self._values]))
        if agg is VariableAggregation.NONE:
            raise ValueError(f"SyncOnReadVariable {self._name} has aggregation NONE, so it has no value in "
                             "cross-replica context; give it SUM, MEAN or ONLY_FIRST_REPLICA, or read it inside "
                             "strategy.run.")
        op = ReduceOp.from_variable_aggregation(agg)
        return self._strategy.extended.reduce_to(op, PerReplica([c.value() for c in self._values]),
                                                 self._values[0].device)

    def _assign(self, method: str, value: Any, read_value: bool = True) -> Any:
        self._in_this_strategy()
        comp = self._local_component()
        if comp is not None:
            comp._assign(method, value)
            return self
        if isinstance(value, PerReplica):
            raise ValueError(f"Cannot assign a PerReplica value to SyncOnReadVariable {self._name} in "
                             "cross-replica context; assign inside strategy.run to set each replica's copy.")
        if self._aggregation is VariableAggregation.SUM:
            if method != "assign":
                raise ValueError(f"SyncOnReadVariable does not support `{method}` in cross-replica context when "
                                 "aggregation is set to `VariableAggregation.SUM`.")
            # Preserve the sum: every copy holds value / num_replicas_in_sync.
            n = self._strategy.num_replicas_in_sync
            value = dev.to_device(self._assignable(method, value), "/cpu:0")
            value = np.asarray(value / n).astype(self.dtype)
        for c in self._values:
            c._assign(method, value)
        return self


def create_for_strategy(strategy: Any, kwargs: dict) -> DistributedVariable:
    """Create the distributed variable for ``Variable(**kwargs)`` under ``strategy``'s scope."""
    ext = strategy.extended
    devices = ext._local_devices
    try:
        sync, agg, trainable = _validate(kwargs)
        name = kwargs["name"] if kwargs["name"] is not None else f"Variable_{next(_names)}"
        if sync is VariableSynchronization.NONE:
            raise ValueError("`NONE` variable synchronization mode is not supported with tf.distribute strategy. "
                             f"Please change the `synchronization` for variable: {name}")
        if sync is VariableSynchronization.AUTO:
            sync = VariableSynchronization.ON_WRITE  # a distributed variable says what AUTO chose (as TF)
        initial = _initial_array(kwargs["initial_value"], kwargs["dtype"], devices[0])
        if agg is VariableAggregation.MEAN and initial.dtype.kind not in "fc":
            raise ValueError(f"Creating a distributed variable ({name}) with aggregation=MEAN and a non-floating "
                             f"dtype ({initial.dtype}) is not supported, please use a different aggregation or dtype")
        host = np.asarray(dev.to_device(initial, "/cpu:0"))
        if kwargs["shape"] is not None and tuple(kwargs["shape"]) != host.shape:
            raise ValueError(f"Variable {name}: initial value has shape {host.shape}, not the given shape "
                             f"{tuple(kwargs['shape'])}")
    except Exception as exc:  # found on this rank before the initial value's broadcast: raised on every rank
        ext._raise_everywhere("broadcast", exc)
    host = ext._broadcast_initial_values([host])[0]
    components = [
        Variable(trainable=trainable, name=name, synchronization=sync, aggregation=agg,
                 constraint=kwargs["constraint"], _device=d, _array=dev.to_device(host, d, copy=True))
        for d in devices
    ]
    cls = SyncOnReadVariable if sync is VariableSynchronization.ON_READ else MirroredVariable
    return cls(strategy, components, name, trainable, sync, agg)


Variable.register(DistributedVariable)
