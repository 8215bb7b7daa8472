"""``mpistrat.optimizers``: the public path of :mod:`mpistrat.train.optimizers`."""

from mpistrat.train.optimizers import *  # noqa: F403
from mpistrat.train.optimizers import __all__, get  # noqa: F401
