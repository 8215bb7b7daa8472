"""Dataset options: ``Options().experimental_distribute.auto_shard_policy``."""

from __future__ import annotations

import enum
from typing import Optional

__all__ = ["AutoShardPolicy", "DistributeOptions", "Options"]


class AutoShardPolicy(enum.IntEnum):
    """How ``experimental_distribute_dataset`` shards a dataset across workers (ranks).

    FILE: worker w reads the files ``files[w::W]`` of the file-based source;
    DATA: every worker reads everything and keeps its own slices of each global batch;
    AUTO: FILE when the pipeline has one file-based source with at least W files, else DATA
    (one warning on rank 0); OFF: every worker reads all data. HINT is accepted and acts as AUTO.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


class DistributeOptions:
    """Distribution options of a dataset (``Options().experimental_distribute``)."""

    def __init__(self) -> None:
        self._auto_shard_policy: Optional[AutoShardPolicy] = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """The AutoShardPolicy (default AUTO)."""
        return AutoShardPolicy.AUTO if self._auto_shard_policy is None else self._auto_shard_policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, policy: AutoShardPolicy) -> None:
        if not isinstance(policy, AutoShardPolicy):
            try:
                policy = AutoShardPolicy(policy)
            except ValueError:
                raise ValueError(
                    f"auto_shard_policy must be an AutoShardPolicy (OFF, AUTO, FILE, DATA, HINT), got {policy!r}"
                ) from None
        self._auto_shard_policy = policy

    def _merge(self, other: "DistributeOptions") -> None:
        if other._auto_shard_policy is not None:
            self._auto_shard_policy = other._auto_shard_policy

    def __repr__(self) -> str:
        return f"DistributeOptions(auto_shard_policy={self.auto_shard_policy.name})"


class Options:
    """Options of a dataset, as ``tf.data.Options``; merged by ``Dataset.with_options``."""

    def __init__(self) -> None:
        self.experimental_distribute = DistributeOptions()
        self.deterministic: Optional[bool] = None

    def merge(self, other: "Options") -> "Options":
        """A new Options: ``self`` overridden by the options set in ``other``."""
        if not isinstance(other, Options):
            raise TypeError(f"with_options expects an mpistrat.data.Options, got {type(other).__name__}")
        out = Options()
        for src in (self, other):
            out.experimental_distribute._merge(src.experimental_distribute)
            if src.deterministic is not None:
                out.deterministic = src.deterministic
        return out

    def __repr__(self) -> str:
        return f"Options(experimental_distribute={self.experimental_distribute!r}, deterministic={self.deterministic})"
