"""``mpistrat.data.experimental``: AutoShardPolicy and DistributeOptions, as in ``tf.data.experimental``."""

from .options import AutoShardPolicy, DistributeOptions

__all__ = ["AutoShardPolicy", "DistributeOptions"]
