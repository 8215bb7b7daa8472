"""Variables held by parameter-server ranks: every read and update is a request to the ps that holds them."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mpistrat.distribute.parameter_server import protocol, rpc
from mpistrat.distribute.values import DistributedValues
from mpistrat.distribute.variables import BaseVariable, Variable, VariableAggregation, VariableSynchronization

__all__ = ["RemoteVariable"]


class RemoteVariable(BaseVariable):
    """A variable on a parameter server (rank ``ps_rank``), the same object on the chief and, pickled inside a
    scheduled function, on the workers: a handle, never a copy of the value.

    ``value()`` fetches the current value; ``assign``, ``assign_add`` and ``assign_sub`` are applied by
    the ps, each whole before any other request to it (atomic per variable). A ps that does not answer
    within the strategy's timeout raises :class:`~mpistrat.errors.UnavailableError`.
    """

    def __init__(self, var_id: int, ps_index: int, name: str, shape: tuple, dtype: Any, trainable: bool = True,
                 synchronization: VariableSynchronization = VariableSynchronization.ON_WRITE,
                 aggregation: VariableAggregation = VariableAggregation.NONE,
                 constraint: Callable[[Any], Any] | None = None) -> None:
        self._var_id = var_id
        self._ps_index = ps_index
        self._name = name
        self._shape = tuple(shape)
        self._dtype = np.dtype(dtype)
        self._trainable = trainable
        self._synchronization = synchronization
        self._aggregation = aggregation
        self._constraint = constraint

    def __reduce__(self) -> tuple:
        return (RemoteVariable, (self._var_id, self._ps_index, self._name, self._shape, self._dtype, self._trainable,
                                 self._synchronization, self._aggregation, self._constraint))

    @property
    def _distribute_strategy(self) -> Any:
        """The strategy of this rank's part in the job: the chief's ``ParameterServerStrategy``, a worker's own."""
        return protocol.runtime().strategy

    def _identity(self) -> Any:
        return ("ps", self._ps_index, self._var_id)

    def _call(self, request: tuple, what: str) -> Any:
        rt = protocol.runtime()
        return rpc.call(rt, rt.roles.rank_of("ps", self._ps_index), request, f"{what} of variable {self._name!r}")

    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def device(self) -> str:
        return f"/job:ps/replica:0/task:{self._ps_index}/device:CPU:0"

    @property
    def constraint(self) -> Callable[[Any], Any] | None:
        return self._constraint

    def value(self) -> np.ndarray:
        """The current value, fetched from the ps (a new array)."""
        array = np.asarray(self._call(("read", self._var_id), "read"))
        array.flags.writeable = False
        return array

    def _assign(self, method: str, value: Any, read_value: bool = True) -> Any:
        if isinstance(value, DistributedValues):
            raise ValueError(f"Cannot assign a {type(value).__name__} to variable {self._name}, which a parameter "
                             "server holds once; reduce it first")
        if getattr(value, "_is_variable", False):
            value = value.value()
        value = np.asarray(self._assignable(method, value))
        if method == "assign" and value.shape != self._shape:
            raise ValueError(f"Cannot assign a value of shape {value.shape} to variable {self._name} of shape "
                             f"{self._shape}")
        self._call((method, self._var_id, value, False), method)
        return self

    def __repr__(self) -> str:
        return (f"<RemoteVariable '{self._name}' shape={self._shape} dtype={self._dtype.name} "
                f"on ps {self._ps_index}>")


Variable.register(RemoteVariable)  # isinstance(v, ms.Variable), as TF's variables on ps are tf.Variables
