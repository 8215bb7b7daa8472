"""``ms.experimental``: CommunicationOptions and CommunicationImplementation (as tf.distribute.experimental)."""

from mpistrat.comm.options import CommunicationImplementation, CommunicationOptions
from mpistrat.distribute.values import ReduceOp

CollectiveCommunication = CommunicationImplementation  # TF's older name

__all__ = ["CommunicationImplementation", "CommunicationOptions", "CollectiveCommunication", "ReduceOp"]
