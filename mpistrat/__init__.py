"""mpistrat: the tf.distribute programming model on MPI, with NumPy and CuPy arrays.

``import mpistrat as ms`` and use it where you would use ``tf.distribute``:
``ms.MirroredStrategy``, ``ms.MultiWorkerMirroredStrategy``,
``ms.OneDeviceStrategy``, ``ms.get_replica_context()``, ``ms.ReduceOp`` and so on.
"""

from __future__ import annotations

import importlib
from typing import Any

from mpistrat.distribute.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from mpistrat.distribute.cross_device_ops import CrossDeviceOps, HierarchicalCopyAllReduce, NcclAllReduce, ReductionToOneDevice
from mpistrat.devices import DeviceSpec, device_of, to_device
from mpistrat.distribute.strategy import ReplicaContext, RunOptions, Strategy, StrategyExtended, ValueContext
from mpistrat.distribute.mirrored import MirroredStrategy
from mpistrat.distribute.one_device import OneDeviceStrategy
from mpistrat.distribute.values import DistributedValues, Mirrored, PerReplica, ReduceOp
from mpistrat.distribute.variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    Variable,
    VariableAggregation,
    VariableSynchronization,
)

from mpistrat import timeline  # noqa: E402, F401  (starts recording when MPISTRAT_TIMELINE is set)

__version__ = "0.1.0"

# Names whose modules need MPI or optional parts are imported on first use.
_LAZY = {
    "MultiWorkerMirroredStrategy": ("mpistrat.distribute.multi_worker", "MultiWorkerMirroredStrategy"),
    "TPUStrategy": ("mpistrat.distribute.tpu", "TPUStrategy"),
    "InputOptions": ("mpistrat.distribute.input_options", "InputOptions"),
    "InputContext": ("mpistrat.distribute.input_options", "InputContext"),
    "InputReplicationMode": ("mpistrat.distribute.input_options", "InputReplicationMode"),
    "DistributedDataset": ("mpistrat.data.distribute", "DistributedDataset"),
    "DistributedIterator": ("mpistrat.data.distribute", "DistributedIterator"),
    "cluster_resolver": ("mpistrat.cluster_resolver", None),
    "experimental": ("mpistrat.experimental", None),
    "nn": ("mpistrat.nn", None),
    "data": ("mpistrat.data", None),
    "optimizers": ("mpistrat.optimizers", None),
    "checkpoint": ("mpistrat.checkpoint", None),
    "ParameterServerStrategy": ("mpistrat.distribute.parameter_server.strategy", "ParameterServerStrategy"),
    "Server": ("mpistrat.distribute.parameter_server.server", "Server"),
    "coordinator": ("mpistrat.coordinator", None),
    "errors": ("mpistrat.errors", None),
    "Checkpoint": ("mpistrat.checkpoint", "Checkpoint"),
    "CheckpointManager": ("mpistrat.checkpoint", "CheckpointManager"),
}

__all__ = [
    "CrossDeviceOps", "DeviceSpec", "HierarchicalCopyAllReduce", "DistributedValues", "DistributedVariable", "Mirrored", "MirroredStrategy",
    "MirroredVariable", "NcclAllReduce", "OneDeviceStrategy", "PerReplica", "ReduceOp", "ReductionToOneDevice",
    "ReplicaContext", "RunOptions", "Strategy", "StrategyExtended", "SyncOnReadVariable", "ValueContext",
    "Variable", "VariableAggregation", "VariableSynchronization", "device_of", "experimental_set_strategy",
    "get_cross_replica_context", "get_replica_context", "get_strategy", "has_strategy", "in_cross_replica_context",
    "to_device", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpistrat' has no attribute {name!r}")
