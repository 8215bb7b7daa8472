"""``ms.experimental``: the names of tf.distribute.experimental (communication options, strategy aliases)."""

from mpistrat.comm import CommunicationImplementation, CommunicationOptions  # loads no MPI
from mpistrat.distribute import partitioners  # ms.experimental.partitioners.FixedShardsPartitioner, ...
from mpistrat.distribute.central_storage import CentralStorageStrategy
from mpistrat.distribute.sharded_variable import ShardedVariable
from mpistrat.distribute.tpu import TPUStrategy
from mpistrat.distribute.multi_worker import MultiWorkerMirroredStrategy  # loads MPI only when one is made
from mpistrat.ops import ReduceOp

CollectiveCommunication = CommunicationImplementation  # TF's older name

__all__ = ["CentralStorageStrategy", "CommunicationImplementation", "CommunicationOptions", "CollectiveCommunication",
           "MultiWorkerMirroredStrategy", "ReduceOp", "ShardedVariable", "TPUStrategy", "partitioners"]
