"""TPUStrategy: the tf.distribute name, refusing at construction because mpistrat drives no TPUs."""

from __future__ import annotations

from typing import Any

from mpistrat.distribute.strategy import Strategy

__all__ = ["TPUStrategy"]

_MESSAGE = (
    "mpistrat drives no TPUs: TPUStrategy cannot be created. Use MultiWorkerMirroredStrategy for synchronous "
    "training across MPI ranks (one rank per GPU or CPU worker), or MirroredStrategy for several devices "
    "(GPUs, or logical CPU devices) within one process.")


class TPUStrategy(Strategy):
    """``tf.distribute.TPUStrategy``'s name and signature; constructing it raises NotImplementedError.

    mpistrat runs on MPI ranks with NumPy and CuPy arrays and has no TPU
    runtime. The error names what to use instead:
    ``MultiWorkerMirroredStrategy`` across ranks, ``MirroredStrategy``
    within one process.
    """

    def __init__(self, tpu_cluster_resolver: Any = None, experimental_device_assignment: Any = None,
                 experimental_spmd_xla_partitioning: bool = False, **kwargs: Any):
        raise NotImplementedError(_MESSAGE)
