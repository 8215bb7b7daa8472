"""``ms.experimental``: CommunicationOptions and CommunicationImplementation (as tf.distribute.experimental)."""

from mpistrat.comm import CommunicationImplementation, CommunicationOptions  # loads no MPI
from mpistrat.ops import ReduceOp

CollectiveCommunication = CommunicationImplementation  # TF's older name

__all__ = ["CommunicationImplementation", "CommunicationOptions", "CollectiveCommunication", "ReduceOp"]
