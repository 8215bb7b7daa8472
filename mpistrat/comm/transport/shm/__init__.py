"""The node shared-memory transport: its all-reduce, reduce plans, result blocks, settings, chunk measurement."""
