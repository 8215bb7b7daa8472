"""``ms.experimental``: the names of tf.distribute.experimental (communication options, strategy aliases)."""

from mpistrat.comm import CommunicationImplementation, CommunicationOptions  # loads no MPI
from mpistrat.distribute import partitioners  # ms.experimental.partitioners.FixedShardsPartitioner, ...
from mpistrat.distribute.central_storage import CentralStorageStrategy
from mpistrat.distribute.sharded_variable import ShardedVariable
from mpistrat.distribute.tpu import TPUStrategy
from mpistrat.distribute.multi_worker import MultiWorkerMirroredStrategy  # loads MPI only when one is made
from mpistrat.ops import ReduceOp
from mpistrat.train.preemption import PreemptionCheckpointHandler, TerminationConfig

CollectiveCommunication = CommunicationImplementation  # TF's older name

__all__ = ["CentralStorageStrategy", "CommunicationImplementation", "CommunicationOptions", "CollectiveCommunication",
           "MultiWorkerMirroredStrategy", "PreemptionCheckpointHandler", "ReduceOp", "ShardedVariable", "TPUStrategy",
           "TerminationConfig", "partitioners"]


def __getattr__(name: str) -> object:
    """``ParameterServerStrategy`` and ``coordinator`` (TF's ``experimental.coordinator``), imported on first use:
    they load MPI (documented as ``mpistrat.ParameterServerStrategy`` and ``mpistrat.coordinator``)."""
    import importlib  # noqa: PLC0415

    if name == "ParameterServerStrategy":
        return importlib.import_module("mpistrat.distribute.parameter_server.strategy").ParameterServerStrategy
    if name == "coordinator":
        return importlib.import_module("mpistrat.coordinator")
    raise AttributeError(f"module 'mpistrat.experimental' has no attribute {name!r}")
