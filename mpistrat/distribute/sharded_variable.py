"""``ShardedVariable``: one variable stored as several variables split along axis 0 (TF's ShardedVariable)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mpistrat import arrays
from mpistrat import devices as dev
from mpistrat.distribute import partitioners
from mpistrat.distribute.values import ValueOperators
from mpistrat.distribute.variables import Variable

__all__ = ["ShardedVariable", "create_sharded_variable"]


class ShardedVariable(ValueOperators):
    """A container of variables treated as the shards of one larger variable, split along axis 0.

    As TF's ``ShardedVariable`` (``sharded_variable.ShardedVariableMixin``):
    ``variables`` must be a non-empty list of variables of one dtype whose
    shapes agree beyond axis 0 (TypeError, ValueError otherwise); ``shape`` is
    theirs with the rows added up. Iterating gives the shards; reading gives
    their concatenation; ``assign``, ``assign_add`` and ``assign_sub`` take a
    value of the full shape and give each shard its rows. Operators and
    indexing apply to the full value.
    """

    _is_variable = True

    def __init__(self, variables: Sequence[Any], name: str = "ShardedVariable"):
        if (not isinstance(variables, Sequence) or isinstance(variables, (str, bytes)) or not variables
                or any(not isinstance(v, Variable) for v in variables)):
            raise TypeError(f"Argument `variables` should be a non-empty list of `variables.Variable`s. "
                            f"Received {variables}")
        dtypes = [v.dtype for v in variables]
        if len(set(dtypes)) > 1:
            raise ValueError(f"All elements in argument `variables` must have the same dtype. Received dtypes: "
                             f"{dtypes}")
        shapes = [tuple(v.shape) for v in variables]
        if any(len(s) == 0 for s in shapes) or len({s[1:] for s in shapes}) > 1:
            raise ValueError("All elements in argument `variables` must have the same shapes except for the first "
                             f"axis. Received shapes: {shapes}")
        self._variables = list(variables)
        self._name = name
        self._dtype = dtypes[0]
        self._shape = (sum(s[0] for s in shapes),) + shapes[0][1:]
        self._offsets = [0]
        for s in shapes[:-1]:
            self._offsets.append(self._offsets[-1] + s[0])
        for v in self._variables:
            v._sharded_container = weakref.ref(self)

    # -- what the shards make up ------------------------------------------------------

    @property
    def _distribute_strategy(self) -> Any:
        """The strategy its shards belong to (None when they belong to none)."""
        return getattr(self._variables[0], "_distribute_strategy", None)

    @property
    def variables(self) -> list:
        """The list of variables that make up the shards of this object."""
        return self._variables

    @property
    def name(self) -> str:
        """The name of this object (``"ShardedVariable"`` unless given)."""
        return self._name

    @property
    def dtype(self) -> np.dtype:
        """The dtype of every shard."""
        return self._dtype

    @property
    def shape(self) -> tuple:
        """The full shape: the shards' rows added up, the other axes theirs."""
        return self._shape

    @property
    def trainable(self) -> bool:
        """Whether the first shard is trainable (as TF's saving variable takes it)."""
        return self._variables[0].trainable

    def __iter__(self) -> Iterator[Any]:
        """The shard variables, in order."""
        return iter(self._variables)

    # -- reading ------------------------------------------------------------------------
    def value(self) -> Any:
        """The full value: the shards concatenated along axis 0 (on the host)."""
        parts = [np.asarray(dev.to_device(v.value(), "/cpu:0")) for v in self._variables]
        return np.concatenate(parts, axis=0)

    read_value = value

    def numpy(self) -> np.ndarray:
        """The full value as a new NumPy array."""
        return self.value()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.value()
        return arr.astype(dtype) if dtype is not None else arr

    def _operand_value(self) -> Any:
        return self.value()

    __hash__ = object.__hash__

    # -- writing ------------------------------------------------------------------------
    def _split(self, method: str, value: Any) -> list:
        """``value`` (the full shape) cut into each shard's rows (TF slices it at the shards' offsets)."""
        value = arrays.as_array(value.value() if getattr(value, "_is_variable", False) else value,
                                what=f"{method} to {self._name}")
        shape = tuple(np.shape(value))
        if shape != self._shape:
            raise ValueError(f"Cannot {method} a value of shape {shape} to ShardedVariable {self._name} of shape "
                             f"{self._shape}: the value must have the full shape, so that each shard gets its rows")
        return [value[o:o + v.shape[0]] for o, v in zip(self._offsets, self._variables)]

    def _apply(self, method: str, value: Any) -> "ShardedVariable":
        parts = self._split(method, value)
        for v, part in zip(self._variables, parts):
            getattr(v, method)(part)
        return self

    def assign(self, value: Any, use_locking: bool | None = None, name: str | None = None,
               read_value: bool = True) -> "ShardedVariable":
        """Give each shard its rows of ``value`` (which has the full shape)."""
        return self._apply("assign", value)

    def assign_add(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> "ShardedVariable":
        """Add each shard's rows of ``delta`` (which has the full shape) to it."""
        return self._apply("assign_add", delta)

    def assign_sub(self, delta: Any, use_locking: bool = False, name: str | None = None,
                   read_value: bool = True) -> "ShardedVariable":
        """Subtract each shard's rows of ``delta`` (which has the full shape) from it."""
        return self._apply("assign_sub", delta)

    def __repr__(self) -> str:
        return (f"<mpistrat.ShardedVariable '{self._name}' shape={self._shape} dtype={self._dtype.name} "
                f"shards={[v.shape[0] for v in self._variables]}>")


def create_sharded_variable(initial_value: Any, partitioner: Callable[..., Sequence[int]],
                            name: str = "ShardedVariable", dtype: Any = None,
                            trainable: bool | None = None) -> "ShardedVariable | Any":
    """A ``ShardedVariable`` made of plain variables, ``initial_value`` split as TF's parameter-server strategy
    splits it (mpistrat's helper; TF makes them inside ``ParameterServerStrategy``'s scope).

    ``partitioner(shape=..., dtype=...)`` says how many shards; TF's rules
    (``ParameterServerStrategyV2._create_variable``): a scalar, or an answer of
    one shard, gives a plain variable; shards are never more than the rows,
    and the rows are split with :func:`partitioners.shard_sizes`. A callable
    ``initial_value`` is called once for the full value.
    """
    full = initial_value() if callable(initial_value) else initial_value
    full = arrays.as_array(full, what="ShardedVariable initial_value")
    if dtype is not None:
        full = np.asarray(full, dtype=np.dtype(getattr(dtype, "name", dtype)))
    shape = tuple(np.shape(full))
    if len(shape) == 0:
        return Variable(full, name=name, trainable=trainable)
    num = partitioners.num_shards_for(partitioner(shape=shape, dtype=full.dtype), shape[0])
    if num == 1:
        return Variable(full, name=name, trainable=trainable)
    offsets = partitioners.shard_offsets(shape[0], num)
    shards = [Variable(full[offsets[i]:offsets[i + 1]], name=f"{name}/part_{i}", trainable=trainable)
              for i in range(num)]
    return ShardedVariable(shards, name=name)
