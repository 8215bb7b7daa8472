"""``mpistrat.checkpoint``: the public path of :mod:`mpistrat.train.checkpoint`."""

from mpistrat.train.checkpoint import *  # noqa: F403
from mpistrat.train.checkpoint import __all__  # noqa: F401
