"""``ms.coordinator``: the names of ``tf.distribute.experimental.coordinator`` (parameter-server training)."""

from mpistrat.distribute.parameter_server.coordinator import (
    ClusterCoordinator,
    PerWorkerValue,
    PerWorkerValues,
    RemoteValue,
    experimental_get_current_worker_index,
)

__all__ = ["ClusterCoordinator", "PerWorkerValue", "PerWorkerValues", "RemoteValue",
           "experimental_get_current_worker_index"]
