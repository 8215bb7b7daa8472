"""Cluster resolvers: who each rank is in the job, where its peers are, which GPUs it uses."""
