"""Cluster resolvers (``ms.cluster_resolver``, as ``tf.distribute.cluster_resolver``).

``MPIClusterResolver`` (one MPI rank = one worker), ``SlurmClusterResolver``
(TensorFlow's, read from a Slurm step), their base ``ClusterResolver``,
``ClusterSpec``, and ``default_cluster_resolver()`` (Slurm inside a matching
step, else MPI). Details in ``mpistrat.cluster.resolvers``.
"""

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
