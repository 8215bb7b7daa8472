"""``ms.experimental``: the names of tf.distribute.experimental (communication options, strategy aliases)."""

from mpistrat.comm import CommunicationImplementation, CommunicationOptions  # loads no MPI
from mpistrat.distribute.multi_worker import MultiWorkerMirroredStrategy  # loads MPI only when one is made
from mpistrat.ops import ReduceOp

CollectiveCommunication = CommunicationImplementation  # TF's older name

__all__ = ["CommunicationImplementation", "CommunicationOptions", "CollectiveCommunication",
           "MultiWorkerMirroredStrategy", "ReduceOp"]
