"""What the collectives run on: topology, waiting, shared-memory windows, lifetime of resources, abort."""
