"""``mpistrat.data.experimental``: AutoShardPolicy and DistributeOptions, as in ``tf.data.experimental``."""

from mpistrat.data.options import AutoShardPolicy, DistributeOptions

__all__ = ["AutoShardPolicy", "DistributeOptions"]
