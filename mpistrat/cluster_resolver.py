"""``ms.cluster_resolver`` (as ``tf.distribute.cluster_resolver``): the public path of :mod:`mpistrat.cluster`."""

from mpistrat.cluster.resolvers import (
    ClusterResolver,
    ClusterSpec,
    MPIClusterResolver,
    SlurmClusterResolver,
    default_cluster_resolver,
    local_devices_for,
)
from mpistrat.cluster.hostlist import expand_hostlist, expand_tasks_per_node

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "MPIClusterResolver",
    "SlurmClusterResolver",
    "default_cluster_resolver",
    "local_devices_for",
    "expand_hostlist",
    "expand_tasks_per_node",
]
